"""Which requests a door forwards to an engine: its inference API, never its admin and
dev endpoints. Pure; every door (the gate today) asks `check` before any other work.

The default allowlist is the OpenAI-compatible API and each registered engine's own
inference routes (its profile in core.engines; read from the engines' own code:
tests/data/engine-routes/). A
route may replace it (`allow:`, entries like ``"POST /v1/chat/completions"`` or
``"GET /v1/responses/*"``, where ``*`` is one path segment), but never with a path of
`NEVER`: what can put an engine to sleep, drop its caches, load weights or adapters, run
a profiler or an RPC on its workers, or show its metrics.

The check is on the raw path, byte for byte: an allowed path has only letters, digits,
``_``, ``-``, ``.`` inside names and ``/`` between them, so ``/v1/completions/../../sleep``,
``/%73leep``, ``//sleep`` or ``/v1/chat/completions/`` match nothing. The door forwards
that same raw path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import engines
from .errors import CoreError

METHODS = ("GET", "POST")

# OpenAI-compatible: every engine's server.
OPENAI_ROUTES: tuple[str, ...] = (
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/embeddings",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/audio/transcriptions",
    "POST /v1/audio/translations",
    "POST /v1/rerank",
    "GET /v1/models",
)

# The OpenAI-compatible API, then each registered engine's own routes (its profile's
# `routes`, core.engines).
DEFAULT_ALLOW: tuple[str, ...] = tuple(dict.fromkeys((*OPENAI_ROUTES, *engines.ROUTES)))

# Never forwarded, whatever a route's `allow:` says (a path, or a path and what is under
# it): each engine's admin and dev endpoints (its profile's `never`: what can put it to
# sleep, drop its caches, load weights or adapters, run a profiler or an RPC on its
# workers), and every engine's own metrics, the exporter's to read.
NEVER: tuple[str, ...] = (*engines.NEVER, "/metrics")

_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_PATH = re.compile(rf"^(/(?:{_SEGMENT}|\*))+$")
_RAW = re.compile(rf"^(/{_SEGMENT})+$")


class AllowError(CoreError, ValueError):
    """An `allow:` entry that cannot be used; the message names it."""


@dataclass(frozen=True)
class Rule:
    method: str
    path: str  # with * for one segment
    pattern: re.Pattern[str]


@dataclass(frozen=True)
class Verdict:
    forward: bool
    status: int = 200  # 404 (path not forwarded) or 405 (method not, `allow` names those that are)
    reason: str = ""
    allow: tuple[str, ...] = ()


def never(path: str) -> str | None:
    """The entry of NEVER that `path` is or is under, if any."""
    for p in NEVER:
        if path == p or path.startswith(p + "/"):
            return p
    return None


def parse_rule(entry: str) -> Rule:
    parts = entry.split()
    if len(parts) != 2:
        raise AllowError(f"{entry!r}: expected 'METHOD /path', for example 'POST /v1/chat/completions'")
    method, path = parts[0].upper(), parts[1]
    if method not in METHODS:
        raise AllowError(f"{entry!r}: method {parts[0]!r} is not forwarded by a door ({', '.join(METHODS)})")
    if not _PATH.match(path):
        raise AllowError(f"{entry!r}: path segments are letters, digits, _ . - or one *, separated by single /")
    concrete = path.replace("*", "x")
    if (hit := never(concrete)) is not None:
        raise AllowError(f"{entry!r}: {hit} is an engine admin or dev endpoint, never forwarded")
    pattern = re.compile("^" + "/".join(_SEGMENT if seg == "*" else re.escape(seg) for seg in path.split("/")) + "$")
    return Rule(method, path, pattern)


def parse_allow(entries: tuple[str, ...] | list[str]) -> tuple[Rule, ...]:
    rules = tuple(parse_rule(e) for e in entries)
    if not rules:
        raise AllowError("empty: a route must forward at least one endpoint")
    return rules


DEFAULT_RULES = parse_allow(DEFAULT_ALLOW)


def check(method: str, raw_path: str, rules: tuple[Rule, ...] = DEFAULT_RULES) -> Verdict:
    """Is ``method raw_path`` (the path as sent, without the query) forwarded?"""
    path_ok = bool(_RAW.match(raw_path)) and never(raw_path) is None
    methods = tuple(sorted({r.method for r in rules if r.pattern.match(raw_path)})) if path_ok else ()
    if not methods:
        shown = raw_path if len(raw_path) <= 200 else raw_path[:200] + "..."
        why = "an engine admin or dev endpoint, never forwarded" if never(raw_path) else "not an endpoint this route forwards"
        return Verdict(False, 404, f"{shown!r}: {why}")
    if method.upper() not in methods:
        return Verdict(False, 405, f"{method} {raw_path}: only {', '.join(methods)} is forwarded", methods)
    return Verdict(True)
