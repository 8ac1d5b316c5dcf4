"""What only `llm-health decide`'s fast path (`gate.fast_doors`) does: the connection handed to
aiohttp for every other path, requests answered in order, the limits of a request it
reads, its Redis connection (`store.fast_redis`) across a Redis restart. Every nginx and Envoy
door test runs on this server too (their fixtures take both servers, tests/fixtures/doors.py)."""

from __future__ import annotations

import asyncio

import pytest

from llm_health.config.gate import parse_gate_config
from llm_health.gate.doors import Doors
from tests.fixtures.doors import serve_doors

AUTH = b"GET /-/auth_request/v1/completions HTTP/1.1\r\nHost: d\r\nX-Original-Method: POST\r\nX-Request-Id: %s\r\n\r\n"


@pytest.fixture
async def direct(own_redis_server):
    """(host, port) of the fast path alone, and its doors."""
    cfg = parse_gate_config({"gate": {"redis": own_redis_server.url, "routes": {"chat": {"upstream": "http://127.0.0.1:1", "default_deadline_ms": 30000}}}})
    doors = Doors(cfg)
    url, stop = await serve_doors(doors, "fast")
    yield ("127.0.0.1", int(url.rsplit(":", 1)[1])), doors
    await stop()


async def exchange(addr: tuple[str, int], data: bytes, answers: int) -> list[bytes]:
    """Send ``data`` on one connection; the first ``answers`` responses (head and body)."""
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(data)
    out = []
    try:
        for _ in range(answers):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
            out.append(head + await reader.readexactly(length))
    finally:
        writer.close()
    return out


async def test_other_paths_are_handed_to_aiohttp_on_the_same_connection(direct):
    """A door's answer, then `/metrics` and `/-/healthy` on the kept connection, pipelined:
    each answered, in the order sent, the metrics counting the decision made just before."""
    addr, _ = direct
    data = AUTH % b"fast-1" + b"GET /metrics HTTP/1.1\r\nHost: d\r\n\r\n" + b"GET /-/healthy HTTP/1.1\r\nHost: d\r\n\r\n" + AUTH % b"fast-2"
    first, metrics, healthy, last = await exchange(addr, data, 4)
    assert first.startswith(b"HTTP/1.1 200 ") and b"X-Request-Id: fast-1" in first and b"X-LLM-Health-Record: " in first, first
    assert metrics.startswith(b"HTTP/1.1 200 ") and b'llm_gate_decisions_total{decision="admit_once",route="chat"} 1.0' in metrics
    assert healthy.startswith(b"HTTP/1.1 200 ")
    assert last.startswith(b"HTTP/1.1 200 ") and b"X-Request-Id: fast-2" in last, last  # aiohttp served it: the same answer


async def test_pipelined_door_requests_are_answered_in_order(direct):
    addr, _ = direct
    ids = [f"order-{i}".encode() for i in range(20)]
    answers = await exchange(addr, b"".join(AUTH % i for i in ids), len(ids))
    assert [a.split(b"X-Request-Id: ", 1)[1].split(b"\r\n", 1)[0] for a in answers] == ids


@pytest.mark.parametrize(
    "request_bytes,status",
    [
        (b"GET /-/auth_request/v1/completions HTTP/1.1\r\nX-Original-Method: POST\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"GET /-/auth_request/v1/completions HTTP/1.1\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431),
        (b"GET /-/auth_request/" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"POST /-/ext_authz/v1/completions HTTP/1.1\r\nHost: d\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000, 413),
        (b"GET /-/auth_request/v1 HTTP/1.1\r\nBad Header\r\n\r\n", 400),
    ],
    ids=["long-header", "many-headers", "long-url", "body", "malformed"],
)
async def test_a_request_past_the_limits_is_refused(direct, request_bytes, status):
    addr, doors = direct
    [answer] = await exchange(addr, request_bytes, 1)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert doors.admission.m_decisions.labels("chat", "admit_once")._value.get() == 0  # nothing decided, nothing written


async def test_connection_close_is_honoured(direct):
    addr, _ = direct
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(b"GET /-/auth_request/v1/completions HTTP/1.1\r\nHost: d\r\nX-Original-Method: POST\r\nConnection: close\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), 10)  # to EOF: the server closed it
    writer.close()
    assert data.startswith(b"HTTP/1.1 200 ") and b"Connection: close" in data


async def test_the_redis_connection_survives_a_redis_restart(direct, own_redis_server):
    """The fast Redis connection breaks when Redis restarts (its scripts gone): one request meets
    the broken connection (Redis down: the route's policy), the next connects again and
    loads the scripts (NOSCRIPT), and is admitted and recorded."""
    addr, doors = direct
    [ok] = await exchange(addr, AUTH % b"before", 1)
    assert ok.startswith(b"HTTP/1.1 200 ") and b"admit_once" in ok
    own_redis_server.kill()
    own_redis_server.start()
    answers = []
    for i in range(3):
        [a] = await exchange(addr, AUTH % f"after-{i}".encode(), 1)
        answers.append(a)
    assert b"X-LLM-Health-Decision: admit_once" in answers[-1], answers[-1]
    assert b"X-LLM-Health-Record: " in answers[-1]  # recorded: Redis answered the decision's script
    rec = await doors.admission.queue.read("default/after-2")
    assert rec is not None and rec.state == "running", rec  # admitted, its end not reported (no nginx here)


async def test_an_unreadable_request_is_answered_after_those_before_it(direct):
    addr, _ = direct
    first, bad = await exchange(addr, AUTH % b"before-bad" + b"GET /-/auth_request/v1 HTTP/1.1\r\nBad Header\r\n\r\n", 2)
    assert first.startswith(b"HTTP/1.1 200 ") and b"X-Request-Id: before-bad" in first, first
    assert bad.startswith(b"HTTP/1.1 400 ") and b"Connection: close" in bad, bad


@pytest.mark.parametrize("path", [b"/nowhere", b"/-/ext_authz/v1/completions"], ids=["handed-over", "door"])
async def test_expect_100_continue_gets_one_interim_answer_before_the_body(direct, path):
    """The client waits for `100 Continue` before it sends its body: it comes at once, once,
    on a request handed to aiohttp and on a door's own."""
    addr, _ = direct
    reader, writer = await asyncio.open_connection(*addr)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: d\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n" % path)
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # no body sent yet
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n", interim
        writer.write(b"hello")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 ") and not head.startswith(b"HTTP/1.1 100"), head
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        writer.write(AUTH % b"after-expect")  # the connection goes on: no second interim answer
        after = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert after.startswith(b"HTTP/1.1 200 ") and b"after-expect" in after, after
    finally:
        writer.close()
