"""gate.fast_doors (the fast path) against its library counterpart, the doors' aiohttp app
on aiohttp's own server (tests/fixtures/doors.py, `SERVERS`: both a `ServeDoors`), on one
real redis-server: the same requests, sent byte for byte on a connection of their own,
get the same status, the same headers and the same body (JSON compared parsed), with what
cannot be equal taken out: aiohttp's `Date` and `Server` (the fast path writes neither),
the record token (signed with each process's own key: its presence is compared), a
request id made for a request without one (a uuid4 each) and the figures of time (the queue's age, the deadline's slack: their presence is compared).

A request that cannot be read (`UNREADABLE`) gets the same status from both, as plain
text that each words its own way. A request past a limit is refused by both, nothing
decided, each with its own status: aiohttp says 400 for a line it cannot read, the fast
path the status that names the limit (431, 414; tests/integration/test_fast_doors.py).
Those are listed in `LIMITS`, each pair of statuses asserted."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from llm_health.config.gate import parse_gate_config
from llm_health.gate import fast_doors
from llm_health.gate.doors import Doors
from tests.fixtures.doors import SERVERS, serve_doors

DEADLINE = b"X-Request-Timeout-Ms: 30000\r\n"
AUTH = b"GET /-/auth_request%s HTTP/1.1\r\nHost: d\r\nX-Original-Method: %s\r\nX-Request-Id: %s\r\n"


def auth(path: bytes = b"/v1/completions", method: bytes = b"POST", rid: bytes = b"r1", extra: bytes = DEADLINE) -> bytes:
    return AUTH % (path, method, rid) + extra + b"\r\n"


def refusal(status: int, body: dict[str, Any]) -> bytes:
    data = {"status": status, "headers": {"X-Request-Id": "r9", "Retry-After": "3", "X-Evil": "no"}, "body": body}
    return base64.urlsafe_b64encode(json.dumps(data).encode())


CASES: dict[str, bytes] = {
    "auth_request admitted": auth(),
    "auth_request, a resent id": auth(rid=b"again") + auth(rid=b"again"),
    "auth_request without X-Original-Method": b"GET /-/auth_request/v1/completions HTTP/1.1\r\nHost: d\r\n" + DEADLINE + b"\r\n",
    "auth_request with a bad method": auth(method=b"P0ST"),
    "auth_request without a deadline": auth(extra=b""),
    "auth_request, a path never forwarded": auth(path=b"/sleep"),
    "auth_request, a method not forwarded": auth(method=b"DELETE"),
    "auth_request, a bad deadline": auth(extra=b"X-Request-Timeout-Ms: soon\r\n"),
    "auth_request, two ids": auth(extra=DEADLINE + b"X-Request-Id: other\r\n"),
    "auth_request, a query string": auth(path=b"/v1/completions?stream=true"),
    "ext_authz admitted": b"POST /-/ext_authz/v1/completions HTTP/1.1\r\nHost: d\r\nX-Request-Id: e1\r\nContent-Length: 0\r\n" + DEADLINE + b"\r\n",
    "ext_authz, no id: one is made": b"POST /-/ext_authz/v1/completions HTTP/1.1\r\nHost: d\r\nContent-Length: 0\r\n" + DEADLINE + b"\r\n",
    "ext_authz refused": b"POST /-/ext_authz/v1/completions HTTP/1.1\r\nHost: d\r\nX-Request-Id: e2\r\nContent-Length: 0\r\n\r\n",
    "ext_authz GET of the root": b"GET /-/ext_authz HTTP/1.1\r\nHost: d\r\nX-Request-Id: e3\r\n" + DEADLINE + b"\r\n",
    "ext_authz with a small body": b"POST /-/ext_authz/v1/completions HTTP/1.1\r\nHost: d\r\nX-Request-Id: e4\r\nContent-Length: 2\r\n" + DEADLINE + b"\r\n{}",
    "ext_authz, chunked": b"POST /-/ext_authz/v1/completions HTTP/1.1\r\nHost: d\r\nX-Request-Id: e5\r\nTransfer-Encoding: chunked\r\n"
    + DEADLINE
    + b"\r\n2\r\n{}\r\n0\r\n\r\n",
    "ext_authz, a body over 1 KiB": b"POST /-/ext_authz/v1/completions HTTP/1.1\r\nHost: d\r\nX-Request-Id: e6\r\nContent-Length: 2000\r\n"
    + DEADLINE
    + b"\r\n"
    + b"x" * 2000,
    "ext_authz, Expect: 100-continue": b"POST /-/ext_authz/v1/completions HTTP/1.1\r\nHost: d\r\nX-Request-Id: e7\r\nExpect: 100-continue\r\nContent-Length: 2\r\n"
    + DEADLINE
    + b"\r\n{}",
    "refused, a valid refusal": b"GET /-/refused HTTP/1.1\r\nHost: d\r\nX-LLM-Health-Refusal: " + refusal(429, {"error": {"type": "x"}}) + b"\r\n\r\n",
    "refused, a status out of range": b"GET /-/refused HTTP/1.1\r\nHost: d\r\nX-LLM-Health-Refusal: " + refusal(200, {}) + b"\r\n\r\n",
    "refused, garbage": b"GET /-/refused HTTP/1.1\r\nHost: d\r\nX-LLM-Health-Refusal: %%%\r\n\r\n",
    "refused, none": b"GET /-/refused HTTP/1.1\r\nHost: d\r\n\r\n",
    "HTTP/1.0": b"GET /-/auth_request/v1/completions HTTP/1.0\r\nX-Original-Method: POST\r\nX-Request-Id: old\r\n" + DEADLINE + b"\r\n",
    "HTTP/1.0, keep-alive": b"GET /-/auth_request/v1/completions HTTP/1.0\r\nX-Original-Method: POST\r\nX-Request-Id: old-k\r\nConnection: keep-alive\r\n"
    + DEADLINE
    + b"\r\n",
    "Connection: close": b"GET /-/auth_request/v1/completions HTTP/1.1\r\nHost: d\r\nX-Original-Method: POST\r\nX-Request-Id: c1\r\nConnection: close\r\n"
    + DEADLINE
    + b"\r\n",
    "HEAD of a door": b"HEAD /-/auth_request/v1/completions HTTP/1.1\r\nHost: d\r\nX-Original-Method: POST\r\nX-Request-Id: h1\r\n" + DEADLINE + b"\r\n",
    "the health check": b"GET /-/healthy HTTP/1.1\r\nHost: d\r\n\r\n",
    "an unknown path": b"GET /nowhere HTTP/1.1\r\nHost: d\r\n\r\n",
    "a door's answer, then other paths pipelined": auth(rid=b"p1") + b"GET /-/healthy HTTP/1.1\r\nHost: d\r\n\r\n" + auth(rid=b"p2"),
}
UNREADABLE: dict[str, bytes] = {
    "HTTP/1.1 without Host": b"GET /-/auth_request/v1/completions HTTP/1.1\r\nX-Original-Method: POST\r\nX-Request-Id: n1\r\n" + DEADLINE + b"\r\n",
    "a malformed header line": b"GET /-/auth_request/v1 HTTP/1.1\r\nHost: d\r\nBad Header\r\n\r\n",
    "not HTTP": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
}
LIMITS: dict[str, tuple[bytes, int, int]] = {  # (request, aiohttp's status, the fast path's)
    "a header too long": (b"GET /-/auth_request/v1/completions HTTP/1.1\r\nX-Original-Method: POST\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 400, 431),
    "too many headers": (b"GET /-/auth_request/v1/completions HTTP/1.1\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(200)) + b"\r\n", 400, 431),
    "a request line too long": (b"GET /-/auth_request/" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 400, 414),
}
VOLATILE = {"x-queue-age-ms", "x-deadline-slack-ms"}  # figures of time: their presence is compared
TRANSPORT = {"date", "server"}  # aiohttp's own; the fast path writes neither


Answer = tuple[str, int, dict[str, Any], Any]


def parse(data: bytes) -> list[Answer]:
    """The answers in `data` (a whole connection's bytes): (HTTP version, status, headers,
    body) each, the headers in lower case and made comparable, a JSON body parsed."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        version, status = lines[0].split(" ")[0], int(lines[0].split(" ")[1])
        headers: dict[str, Any] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", 0))
        body, data = data[:length], data[length:]
        for name in TRANSPORT:
            headers.pop(name, None)
        for name in VOLATILE & headers.keys():
            headers[name] = "<ms>"
        if headers.get("x-request-id", "").startswith("gate-"):  # one made for a request without: a uuid4 each
            headers["x-request-id"] = "gate-<uuid4>"
        if "x-llm-health-record" in headers:
            headers["x-llm-health-record"] = "<token>"
        if "x-llm-health-refusal" in headers:
            carried = json.loads(base64.urlsafe_b64decode(headers["x-llm-health-refusal"]))
            carried["headers"] = {k: "<ms>" if k.lower() in VOLATILE else v for k, v in carried["headers"].items()}
            headers["x-llm-health-refusal"] = carried
        parsed: Any = body
        if headers.get("content-type", "").startswith("application/json") and body:
            parsed = json.loads(body)
        out.append((version, status, headers, parsed))
    return out


async def send(url: str, data: bytes) -> bytes:
    """`data` written on a connection of its own, half-closed after a pause; every byte
    the server wrote until it closed."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        await asyncio.sleep(0.2)  # every answer written (pipelined ones in order) before the close
        if writer.can_write_eof():
            writer.write_eof()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.fixture
async def served(own_redis_server) -> AsyncIterator[dict[str, tuple[str, Doors]]]:
    """The same configuration served both ways, on one Redis: {server: (url, doors)}."""
    assert SERVERS["fast"] is fast_doors.serve and SERVERS["aiohttp"] is not fast_doors.serve
    cfg = {"gate": {"redis": own_redis_server.url, "routes": {"chat": {"upstream": "http://127.0.0.1:1", "reject_if_retry_count_gte": 1}}}}
    out, stops = {}, []
    for name in SERVERS:
        doors = Doors(parse_gate_config(cfg))
        url, stop = await serve_doors(doors, name)
        out[name] = (url, doors)
        stops.append(stop)
    yield out
    for stop in stops:
        await stop()


async def through_both(served: dict[str, tuple[str, Doors]], data: bytes, redis: Any) -> dict[str, list[Answer]]:
    got = {}
    for name, (url, _) in served.items():
        redis.flushall()  # the same Redis for each: every request is new to it
        got[name] = parse(await send(url, data))
    return got


@pytest.fixture
def flush(own_redis_server) -> Any:
    from tests.fixtures.redis import _redis_command

    class Flush:
        def flushall(self) -> None:
            _redis_command(own_redis_server.port, "FLUSHALL")

    return Flush()


@pytest.mark.parametrize("case", list(CASES))
async def test_the_same_request_gets_the_same_answer(case, served, flush):
    got = await through_both(served, CASES[case], flush)
    assert got["fast"] == got["aiohttp"], case
    assert got["fast"], case  # an answer came


@pytest.mark.parametrize("case", list(UNREADABLE))
async def test_a_request_that_cannot_be_read_gets_the_same_status(case, served, flush):
    got = await through_both(served, UNREADABLE[case], flush)
    assert (
        [(a[1], a[2].get("content-type")) for a in got["fast"]]
        == [(a[1], a[2].get("content-type")) for a in got["aiohttp"]]
        == [(400, "text/plain; charset=utf-8")]
    ), got


@pytest.mark.parametrize("case", list(LIMITS))
async def test_a_request_past_a_limit_is_refused_by_both_nothing_decided(case, served, flush):
    data, library, fast = LIMITS[case]
    got = await through_both(served, data, flush)
    assert [a[1] for a in got["aiohttp"]] == [library] and [a[1] for a in got["fast"]] == [fast], got
    for _, doors in served.values():
        assert doors.admission.m_decisions.labels("chat", "admit_once")._value.get() == 0
