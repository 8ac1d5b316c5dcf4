"""What the gate reads from a request and its response: the request id, the deadline, the
retry count, and the token units the upstream reports. Pure: no I/O.

Headers read (first one present wins):

| what | headers |
|---|---|
| request id | `X-Request-Id`, `Idempotency-Key` (none: a fresh id, never a retry) |
| deadline, absolute | `X-Request-Deadline-Ms` (Unix ms) |
| deadline, remaining budget | `X-Request-Timeout-Ms`, `X-Envoy-Expected-Rq-Timeout-Ms` |
| retry count | `X-Retry-Count`, `X-Stainless-Retry-Count` (the OpenAI SDKs), `X-Retry-Attempt` |
| route | `X-Route` (else the route whose `models` has the body's model, else the first) |
| tenant | `X-Tenant` (else `default`) |
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping

ID_HEADERS = ("X-Request-Id", "Idempotency-Key")
RETRY_HEADERS = ("X-Retry-Count", "X-Stainless-Retry-Count", "X-Retry-Attempt")
_USAGE = re.compile(rb'"usage"\s*:\s*(\{[^{}]*\})')


class BadRequest(ValueError):
    pass


def first_header(headers: Mapping[str, str], names: Iterable[str]) -> str | None:
    for n in names:
        v = headers.get(n)
        if v is not None and v.strip():
            return v.strip()
    return None


def read_deadline_ms(headers: Mapping[str, str], now: int, default_ms: float | None) -> int:
    """The absolute deadline in Unix ms, from the headers or the route's default."""
    absolute = headers.get("X-Request-Deadline-Ms")
    if absolute is not None:
        try:
            value = float(absolute)
        except ValueError:
            raise BadRequest(f"X-Request-Deadline-Ms must be Unix time in milliseconds, got {absolute!r}") from None
        if not 1e12 <= value <= 1e14:
            raise BadRequest(f"X-Request-Deadline-Ms {absolute!r} is not Unix time in milliseconds (expected 13 digits)")
        return int(value)
    for name in ("X-Request-Timeout-Ms", "X-Envoy-Expected-Rq-Timeout-Ms"):
        budget = headers.get(name)
        if budget is not None:
            try:
                ms = float(budget)
            except ValueError:
                raise BadRequest(f"{name} must be a number of milliseconds, got {budget!r}") from None
            if ms < 0 or ms != ms:
                raise BadRequest(f"{name} must not be negative, got {budget!r}")
            return now + int(ms)
    if default_ms is None:
        raise BadRequest("no deadline: send X-Request-Deadline-Ms (Unix ms) or X-Request-Timeout-Ms (remaining ms), or set the route's default_deadline_ms")
    return now + int(default_ms)


def read_retry_count(headers: Mapping[str, str]) -> int:
    for name in RETRY_HEADERS:
        v = headers.get(name)
        if v is not None:
            try:
                n = int(v)
            except ValueError:
                raise BadRequest(f"{name} must be a non-negative integer, got {v!r}") from None
            if n < 0:
                raise BadRequest(f"{name} must be a non-negative integer, got {v!r}")
            return n
    return 0


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
