"""What the gate reads from a request and its response: the request id, the deadline, the
retry count, and the token units the upstream reports. Pure: no I/O.

Headers read (first one present wins; of the deadlines, the smallest):

| what | headers |
|---|---|
| request id | `X-Request-Id`, `Idempotency-Key`: 1-256 printable ASCII characters, no spaces (none: a fresh id, and a request that says it is a retry is matched to its first copy by `retry_fingerprint`); ids are scoped by tenant |
| deadline, absolute | `X-Request-Deadline-Ms`: Unix ms, from a day ago to a week ahead |
| deadline, remaining budget | `X-Request-Timeout-Ms`, `X-Envoy-Expected-Rq-Timeout-Ms`: 0 to 604800000 ms; `x-llm-d-inference-ttl` (llm-d's router): a Go duration up to a week, 0 none |
| retry count | `X-Retry-Count`, `X-Stainless-Retry-Count` (the OpenAI SDKs), `X-Retry-Attempt`: 0 to 1000 |
| route | `X-Route` (else the route whose `models` has the body's model, else the first) |
| tenant | `X-Tenant`: 1-64 of letters, digits and `_ . : -` (else `default`) |

Numbers are unsigned decimal integers; anything else (`1e20`, `inf`, `3.5`, a sign: `+5`,
`-5`, out of range) is refused with a 400 that names the header, before anything is
written to Redis. A header of the table sent more than once with different values (two
deadlines, two request ids) is refused the same way: the request is ambiguous; copies
with the same value are one. Of two different headers of one row the first listed wins,
except the deadlines: every one present is read, and the smallest deadline wins.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping

from ..core.errors import LLMHealthError

ID_HEADERS = ("X-Request-Id", "Idempotency-Key")
RETRY_HEADERS = ("X-Retry-Count", "X-Stainless-Retry-Count", "X-Retry-Attempt")
_USAGE = re.compile(rb'"usage"\s*:\s*(\{[^{}]*\})')


# Documented ranges: a header outside them is refused with a 400 that names it.
MAX_TIMEOUT_MS = 7 * 86400 * 1000  # a week: any longer is a unit mistake
DEADLINE_PAST_MS = 86400 * 1000  # an absolute deadline may lie up to a day in the past
MAX_RETRY_COUNT = 1000
MAX_ID_LENGTH = 256
_INTEGER = re.compile(r"^\s*[0-9]{1,16}\s*$")  # no sign: `+5` and `-5` are refused
_TENANT = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_ID = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces


class GateError(LLMHealthError):
    """The gate room's branch of the error tree (core.errors)."""


class BadRequest(GateError, ValueError):
    pass


def _get(headers: Mapping[str, str], name: str) -> str | None:
    """The header's value; BadRequest naming it if it came more than once with different
    values. Doors hand aiohttp's multidict (every copy: `getall`) or a plain mapping."""
    getall = getattr(headers, "getall", None)
    if getall is None:
        return headers.get(name)
    values = getall(name, [])
    if len({v.strip() for v in values}) > 1:
        raise BadRequest(f"{name} was sent {len(values)} times with different values: the request is ambiguous")
    return values[0] if values else None


def first_header(headers: Mapping[str, str], names: Iterable[str]) -> str | None:
    for n in names:
        v = _get(headers, n)
        if v is not None and v.strip():
            return v.strip()
    return None


def _integer(name: str, raw: str, low: int, high: int, what: str) -> int:
    """A decimal integer in [low, high], or BadRequest naming the header."""
    if not _INTEGER.match(raw) or not low <= int(raw) <= high:
        raise BadRequest(f"{name} must be {what}, an integer from {low} to {high}, got {raw[:64]!r}")
    return int(raw)


def read_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's request id (None: the gate makes one up, never a retry)."""
    for name in ID_HEADERS:
        value = _get(headers, name)
        if value is not None and value.strip():
            value = value.strip()
            if len(value) > MAX_ID_LENGTH or not _ID.match(value):
                raise BadRequest(f"{name} must be 1 to {MAX_ID_LENGTH} printable ASCII characters without spaces")
            return value
    return None


def read_tenant(headers: Mapping[str, str]) -> str:
    value = _get(headers, "X-Tenant")
    tenant = ("default" if value is None else value).strip()
    if not _TENANT.match(tenant):
        raise BadRequest(f"X-Tenant must be 1 to 64 of letters, digits and _ . : -, got {tenant[:64]!r}")
    return tenant


# llm-d's router (llm-d/llm-d-router, pkg/epp/metadata/consts.go: InferenceTTLHeaderKey):
# the request's flow-control queue TTL, a Go duration (`time.ParseDuration`: `1500ms`, `2s`,
# `1m30s`), counted from the request's arrival; its admission ignores one that is not
# positive (pkg/epp/requestcontrol/admission.go), and so does the gate.
LLMD_TTL_HEADER = "x-llm-d-inference-ttl"
_GO_DURATION = re.compile(r"^(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|\u00b5s|\u03bcs|ms|s|m|h))+$")
_GO_PART = re.compile(r"([0-9]*\.?[0-9]*)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_GO_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "\u00b5s": 1e-3, "\u03bcs": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4, "h": 3.6e6}


def go_duration_ms(name: str, raw: str) -> int:
    """A Go duration without a sign (`1500ms`, `2s`, `1m30s`, `0`) in whole milliseconds,
    from 0 to a week; BadRequest naming the header otherwise."""
    value = raw.strip()
    if value == "0":
        return 0
    if len(value) > 64 or not _GO_DURATION.match(value):
        raise BadRequest(f"{name} must be a Go duration such as 1500ms or 2s, from 0 to a week, got {raw[:64]!r}")
    ms = sum(float(n) * _GO_UNIT_MS[u] for n, u in _GO_PART.findall(value))
    if ms > MAX_TIMEOUT_MS:
        raise BadRequest(f"{name} must be a Go duration such as 1500ms or 2s, from 0 to a week, got {raw[:64]!r}")
    return int(ms)


def read_deadline_ms(headers: Mapping[str, str], now: int, default_ms: float | None) -> int:
    """The absolute deadline in Unix ms: the smallest of those the headers state (each
    malformed one a 400 naming it), else the route's default."""
    found: list[int] = []
    absolute = _get(headers, "X-Request-Deadline-Ms")
    if absolute is not None:
        found.append(_integer("X-Request-Deadline-Ms", absolute, now - DEADLINE_PAST_MS, now + MAX_TIMEOUT_MS, "Unix time in milliseconds within a week"))
    for name in ("X-Request-Timeout-Ms", "X-Envoy-Expected-Rq-Timeout-Ms"):
        budget = _get(headers, name)
        if budget is not None:
            found.append(now + _integer(name, budget, 0, MAX_TIMEOUT_MS, "the milliseconds left"))
    ttl = _get(headers, LLMD_TTL_HEADER)
    if ttl is not None and (ttl_ms := go_duration_ms(LLMD_TTL_HEADER, ttl)) > 0:  # 0: no TTL, as llm-d reads it
        found.append(now + ttl_ms)
    if found:
        return min(found)
    if default_ms is None:
        raise BadRequest(
            "no deadline: send X-Request-Deadline-Ms (Unix ms), X-Request-Timeout-Ms (remaining ms) or x-llm-d-inference-ttl, or set the route's default_deadline_ms"
        )
    return now + int(default_ms)


def read_retry_count(headers: Mapping[str, str]) -> int:
    for name in RETRY_HEADERS:
        value = _get(headers, name)
        if value is not None:
            return _integer(name, value, 0, MAX_RETRY_COUNT, "the attempts before this one")
    return 0


# What a client re-sends unchanged on a retry and tells one caller's request from
# another's: the credentials (hashed, never kept), the deadline as stated, the body.
CREDENTIAL_HEADERS = ("Authorization", "Api-Key", "X-Api-Key")
DEADLINE_HEADERS = ("X-Request-Deadline-Ms", "X-Request-Timeout-Ms", "X-Envoy-Expected-Rq-Timeout-Ms", LLMD_TTL_HEADER)
LENGTH_HEADERS = ("X-Original-Content-Length", "Content-Length")


def retry_fingerprint(tenant: str, route: str, method: str, raw_path: str, headers: Mapping[str, str], body: bytes | None) -> str:
    """The digest that matches a retry sent without an id to its first copy: the OpenAI
    SDK sends no request id and re-sends the request byte for byte, with the same headers
    but `X-Stainless-Retry-Count`. Over the tenant, the route, the method and path, the
    credentials, the deadline headers as sent, and the body; a door that sees no body
    (nginx `auth_request`, Envoy `ext_authz`) uses its length instead, so two requests of
    one caller with the same length and deadline header look alike there (docs/admission.md:
    their retries are matched first in, first out across them)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (tenant, route, method.upper(), raw_path):
        h.update(part.encode("utf-8", "surrogateescape") + b"\0")
    for name in (*CREDENTIAL_HEADERS, *DEADLINE_HEADERS):
        value = headers.get(name)
        h.update(name.encode() + b"=" + (value or "").encode("utf-8", "surrogateescape") + b"\0")
    if body is not None:
        h.update(b"body\0" + body)
    else:
        h.update(b"length\0" + (first_header(headers, LENGTH_HEADERS) or "").encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def token_units(tail: bytes) -> int:
    """Token units of a response: `usage.total_tokens` (or prompt + completion) of the
    last `usage` object in the body or the SSE stream's tail."""
    found = _USAGE.findall(tail)
    if not found:
        return 0
    try:
        usage = json.loads(found[-1])
    except ValueError:
        return 0
    total = usage.get("total_tokens")
    if total is None:
        total = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
    return int(total) if isinstance(total, int | float) else 0
