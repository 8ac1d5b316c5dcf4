"""The gate's documented claims (docs/admission.md, docs/limits.md "The gate's request
headers"), each on a real gate in this process, a real redis-server and a fake upstream
on loopback: what the answer, the Redis record (read through the store API) and the
gate's /metrics show."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families
from redis import asyncio as aioredis

from llm_health.config.gate import parse_gate_config
from llm_health.gate.app import Gate
from llm_health.store.queue import AdmissionQueue, QueueRecord

DAY_MS = 86400 * 1000
WEEK_MS = 7 * DAY_MS
SSE = [b'data: {"choices":[{"delta":{"content":"t"}}]}\n\n'] * 10 + [b"data: [DONE]\n\n"]


class Upstream:
    """A fake OpenAI-compatible worker: answers `status` with `usage.total_tokens` of
    `tokens`; `hold` never answers; a `stream` body gets SSE chunks `pause` apart."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, dict[str, Any]]] = []
        self.status = 200
        self.tokens = 272
        self.hold = False
        self.pause = 0.2

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((request.headers.get("X-Request-Id"), body))
        if self.hold:
            await asyncio.Event().wait()  # until the gate closes the connection
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in SSE:
                await resp.write(chunk)
                await asyncio.sleep(self.pause)
            await resp.write_eof()
            return resp
        usage = {"prompt_tokens": 1, "completion_tokens": self.tokens - 1, "total_tokens": self.tokens}
        return web.json_response({"choices": [{"text": "ok"}], "usage": usage}, status=self.status)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


class Stack:
    def __init__(self, url: str, up: Upstream, gate: Gate, redis_url: str):
        self.url, self.up, self.gate, self.redis_url = url, up, gate, redis_url

    async def post(self, headers: dict[str, str] | None = None, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any], CIMultiDict[str]]:
        async with aiohttp.ClientSession() as s, s.post(self.url + "/v1/completions", json=body or {"model": "m", "prompt": "hi"}, headers=headers or {}) as r:
            return r.status, json.loads(await r.read()), CIMultiDict(r.headers)

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/metrics") as r:
            text = await r.text()
        return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text) for x in f.samples}

    async def record(self, request_id: str, until: Callable[[QueueRecord], bool] = lambda r: r.state == "done", timeout: float = 15.0) -> QueueRecord | None:
        """The id's record (tenant `default`) once `until` holds, or as it is at the deadline."""
        q = AdmissionQueue.from_url(self.redis_url, prefix=self.gate.cfg.queue_prefix)
        try:
            deadline = time.monotonic() + timeout
            while True:
                rec = await q.read(f"default/{request_id}")
                if (rec is not None and until(rec)) or time.monotonic() > deadline:
                    return rec
                await asyncio.sleep(0.02)
        finally:
            await q.aclose()

    async def record_keys(self) -> list[str]:
        r = aioredis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            return sorted(await r.keys(self.gate.cfg.queue_prefix + "req:*"))
        finally:
            await r.aclose()


@pytest.fixture
async def stack(redis_url):
    """factory(routes=..., **gate keys) -> Stack; every server stopped at teardown."""
    runners: list[web.AppRunner] = []

    async def make(routes: dict[str, dict[str, Any]] | None = None, redis: str = redis_url, **gate_extra: Any) -> Stack:
        up = Upstream()
        uapp = web.Application()
        uapp.router.add_post("/v1/completions", up.completions)
        ur, uurl = await _serve(uapp)
        runners.append(ur)
        routes = routes or {"chat": {"default_deadline_ms": 30000}}
        cfg = parse_gate_config(
            {
                "admission": {"reject_if_queue_age_ms_gte": 3000, "reject_if_retry_count_gte": 1, "ignore_worker_util_when_slack_ms_lte": 0},
                "gate": {"redis": redis, "sample_interval": "100ms", "routes": {n: {"upstream": uurl, **r} for n, r in routes.items()}, **gate_extra},
            },
            "test.yml",
        )
        gate = Gate(cfg)
        gr, gurl = await _serve(gate.app())
        runners.append(gr)
        return Stack(gurl, up, gate, redis)

    yield make
    for r in reversed(runners):
        await r.cleanup()


def label(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


async def test_upstream_429_and_503_are_counted_apart(stack):
    """admission.md: 429 and 503 counted apart in llm_gate_upstream_responses_total{route,code}."""
    s = await stack()
    for i, code in enumerate([429, 503, 503]):
        s.up.status = code
        assert (await s.post({"X-Request-Id": f"u{i}"}))[0] == code
    m = await s.metrics()
    assert m[label("llm_gate_upstream_responses_total", route="chat", code="429")] == 1
    assert m[label("llm_gate_upstream_responses_total", route="chat", code="503")] == 2


@pytest.mark.parametrize("when", ["before-the-answer", "mid-stream"])
async def test_client_disconnect_is_recorded_as_499(stack, when):
    """admission.md: a client that disconnects mid-request: the attempt is recorded with status 499."""
    s = await stack()
    s.up.hold = when == "before-the-answer"
    host, port = s.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "m", "stream": True}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gate\r\nX-Request-Id: gone-1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    if s.up.hold:
        deadline = time.monotonic() + 15
        while not s.up.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert s.up.calls, "the request never reached the upstream"
    else:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
        assert head.startswith(b"HTTP/1.1 200") and b"data:" in await asyncio.wait_for(reader.read(4096), 15)
    writer.close()  # walk away
    rec = await s.record("gone-1", until=lambda r: r.state == "done")
    assert rec is not None and (rec.state, rec.http_status, rec.attempts) == ("done", 499, 1), rec
    assert (await s.metrics())[label("llm_gate_upstream_responses_total", route="chat", code="499")] == 1


@pytest.mark.parametrize(
    "headers,model,route",
    [
        ({"X-Route": "c"}, "model-b", "c"),  # X-Route wins over the body's model
        ({}, "model-b", "b"),
        ({}, "model-c", "c"),
        ({}, "unknown", "first"),
        ({}, None, "first"),
    ],
)
async def test_route_choice(stack, headers, model, route):
    """admission.md: `X-Route`; else the route listing the body's `model`; else the first route."""
    routes = {
        "first": {"default_deadline_ms": 30000},
        "b": {"default_deadline_ms": 30000, "models": ["model-b"]},
        "c": {"default_deadline_ms": 30000, "models": ["model-c"]},
    }
    s = await stack(routes=routes)
    body = {"prompt": "hi"} if model is None else {"model": model, "prompt": "hi"}
    assert (await s.post({"X-Request-Id": "r1", **headers}, body))[0] == 200
    rec = await s.record("r1")
    assert rec is not None and rec.route == route


@pytest.mark.parametrize(
    "headers,what,expected",
    [
        ({"Idempotency-Key": "k-1"}, "id", "k-1"),
        ({"X-Request-Id": "x-1", "Idempotency-Key": "k-1"}, "id", "x-1"),
        ({"X-Retry-Count": "3"}, "retries", 3),
        ({"X-Stainless-Retry-Count": "4"}, "retries", 4),
        ({"X-Retry-Attempt": "5"}, "retries", 5),
        ({"X-Retry-Count": "3", "X-Stainless-Retry-Count": "4", "X-Retry-Attempt": "5"}, "retries", 3),
        ({"X-Stainless-Retry-Count": "4", "X-Retry-Attempt": "5"}, "retries", 4),
        ({"X-Envoy-Expected-Rq-Timeout-Ms": "45000"}, "budget", 45000),
        ({"X-Request-Timeout-Ms": "50000", "X-Envoy-Expected-Rq-Timeout-Ms": "45000"}, "budget", 45000),  # the smallest deadline
        ({"X-Request-Timeout-Ms": "40000", "X-Envoy-Expected-Rq-Timeout-Ms": "45000"}, "budget", 40000),
        ({"x-llm-d-inference-ttl": "1m5s"}, "budget", 65000),  # llm-d's router's per-request TTL
        ({"X-Request-Timeout-Ms": "50000", "x-llm-d-inference-ttl": "20s"}, "budget", 20000),
        ({}, "budget", 30000),  # the route's default_deadline_ms
    ],
)
async def test_header_aliases_first_present_wins(stack, headers, what, expected):
    """admission.md "Headers": every alias is read, and the first one present wins; of the
    deadlines, the smallest."""
    s = await stack()
    if what != "id":
        headers = {"X-Request-Id": "h-1", **headers}
    status, _, answer = await s.post(headers)
    assert status == 200
    request_id = answer["X-Request-Id"]
    rec = await s.record(request_id, until=lambda r: r.attempts >= 1)
    assert rec is not None, request_id
    got = {"id": s.up.calls[0][0], "retries": rec.retry_count, "budget": rec.deadline_ms - rec.enqueued_ms}[what]
    assert got == expected and request_id == s.up.calls[0][0]


async def test_requests_without_an_id_or_a_retry_count_are_never_retries(stack):
    """admission.md: without an id, a request that says no retry count gets a fresh id and
    is never seen as a retry, even with the body of another (a retry without an id says its
    count, and is matched to its first copy: tests/integration/test_retry_match.py)."""
    s = await stack()
    answers = [await s.post(body={"model": "m", "prompt": "same"}) for _ in range(2)]
    assert [a[0] for a in answers] == [200, 200]
    ids = [a[2]["X-Request-Id"] for a in answers]
    assert ids[0] != ids[1] and [c[0] for c in s.up.calls] == ids
    for request_id in ids:
        rec = await s.record(request_id, until=lambda r: r.attempts >= 1)
        assert rec is not None and (rec.retry_count, rec.attempts) == (0, 1), rec
    m = await s.metrics()
    assert m[label("llm_gate_decisions_total", route="chat", decision="admit_once")] == 2


REJECTION_KEYS = {"type", "code", "message", "retryable", "request_id", "route", "queue_age_ms", "deadline_slack_ms", "retry_count"}


async def test_rejection_body_has_the_documented_keys(stack, own_redis_server):
    """admission.md: every rejection has the JSON body
    {"error": {type, code, message, retryable, request_id, route, queue_age_ms, deadline_slack_ms, retry_count}}."""
    routes = {"open": {"default_deadline_ms": 30000, "redis_down": "open"}, "closed": {"default_deadline_ms": 30000, "redis_down": "closed"}}
    s = await stack(routes=routes, redis=own_redis_server.url)
    late = {"X-Request-Timeout-Ms": "0"}
    bodies = [(await s.post({"X-Route": "open", "X-Request-Id": "late-1", **late}))[1]]  # recorded: reject_age_beats_slack
    own_redis_server.kill()
    bodies.append((await s.post({"X-Route": "closed", "X-Request-Id": "down-1"}))[1])  # reject_redis_down
    bodies.append((await s.post({"X-Route": "open", "X-Request-Id": "down-2", "X-Retry-Count": "1", **late}))[1])  # failing open, late retry
    assert [b["error"]["code"] for b in bodies] == ["reject_age_beats_slack", "reject_redis_down", "reject_retry_late"]
    for body in bodies:
        assert set(body) == {"error"} and set(body["error"]) == REJECTION_KEYS, body
        assert body["error"]["type"] == "admission_rejected"


async def test_token_units_counter(stack):
    """admission.md: llm_gate_token_units_total{route} adds the upstream's usage.total_tokens."""
    s = await stack()
    s.up.tokens = 1234
    assert (await s.post({"X-Request-Id": "t-1"}))[0] == 200
    m = await s.metrics()
    assert m[label("llm_gate_token_units_total", route="chat")] == 1234


# (header, the value at the bound, the value one past it), given the gate's clock (Unix ms).
BOUNDS: list[tuple[str, Callable[[int], str], Callable[[int], str]]] = [
    ("X-Request-Timeout-Ms", lambda t: "604800000", lambda t: "604800001"),
    ("X-Envoy-Expected-Rq-Timeout-Ms", lambda t: "604800000", lambda t: "604800001"),
    ("X-Retry-Count", lambda t: "1000", lambda t: "1001"),
    ("X-Stainless-Retry-Count", lambda t: "1000", lambda t: "1001"),
    ("X-Retry-Attempt", lambda t: "1000", lambda t: "1001"),
    ("X-Request-Id", lambda t: "i" * 256, lambda t: "i" * 257),
    ("Idempotency-Key", lambda t: "k" * 256, lambda t: "k" * 257),
    ("X-Request-Id", lambda t: "printable-~!", lambda t: "a\tb"),  # a tab: other control characters never reach the gate (aiohttp's parser answers 400)
    ("X-Request-Id", lambda t: "printable-~!", lambda t: "caf\u00e9"),  # not ASCII
    ("X-Request-Deadline-Ms", lambda t: str(t - DAY_MS), lambda t: str(t - DAY_MS - 1)),
    ("X-Request-Deadline-Ms", lambda t: str(t + WEEK_MS), lambda t: str(t + WEEK_MS + 1)),
]


@pytest.mark.parametrize("header,at,past", BOUNDS, ids=[f"{h}-{i}" for i, (h, _, _) in enumerate(BOUNDS)])
async def test_header_bounds(stack, monkeypatch, header, at, past):
    """limits.md: accepted at the bound, a 400 naming the header one past it, before
    anything is written to Redis. The gate's clock is held still, so the bounds are exact."""
    now = int(time.time() * 1000)
    monkeypatch.setattr("llm_health.gate.decision.now_ms", lambda: now)
    s = await stack()
    ids = {"refused": {"X-Request-Id": "refused-1"}, "accepted": {"X-Request-Id": "accepted-1"}}
    if header in ("X-Request-Id", "Idempotency-Key"):
        ids = {"refused": {}, "accepted": {}}
    status, body, _ = await s.post({**ids["refused"], header: past(now)})
    assert status == 400 and header in body["error"]["message"], body
    status, body, answer = await s.post({**ids["accepted"], header: at(now)})
    assert status != 400, body
    accepted = answer["X-Request-Id"]
    assert await s.record(accepted) is not None
    keys = await s.record_keys()
    assert keys == [f"{s.gate.cfg.queue_prefix}req:default/{accepted}"], keys
    assert s.up.calls == [] or [c[0] for c in s.up.calls] == [accepted]


async def test_a_refused_script_is_a_500_and_redis_stays_up(stack, redis_url, caplog):
    """limits.md: a Redis error caused by a request (a refused script) is answered with a
    500 and logged; only an unreachable Redis counts as down (that half:
    tests/integration/test_gate.py::test_redis_down_fails_open_or_closed)."""
    s = await stack(routes={"chat": {"default_deadline_ms": 30000, "redis_down": "closed"}})
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        await r.set(s.gate.queue.keys.record("default/poisoned"), "a string, not a hash")  # the enqueue script's HINCRBY fails
    finally:
        await r.aclose()
    with caplog.at_level(logging.ERROR, logger="llm_health.gate"):
        status, body, _ = await s.post({"X-Request-Id": "poisoned"})
    assert status == 500 and body["error"]["type"] == "internal", body
    assert any("redis refused the request record for route chat" in rec.getMessage() and "WRONGTYPE" in rec.getMessage() for rec in caplog.records)
    m = await s.metrics()
    assert m[label("llm_gate_redis_up")] == 1
    assert s.up.calls == []
    assert (await s.post({"X-Request-Id": "fine"}))[0] == 200  # not failing closed: Redis is up
