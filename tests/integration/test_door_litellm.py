"""The LiteLLM door: a real LiteLLM proxy (pinned, its own venv: .ci/install-litellm.sh)
running the shipped deploy/litellm config and callback, in front of an OpenAI-compatible
engine on loopback, a real redis-server. One proxy for the module (it takes seconds to
start); each test uses its own request ids."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llm_health.store.queue import AdmissionQueue
from tests.fixtures.litellm import LiteLLM
from tests.fixtures.redis_server import RedisServer
from tests.harness.processes import free_port
from tests.integration.test_gate_records import Stalled, not_running, until

PREFIX = "litellm-door:"
AUTH: dict[str, str] = {}  # the module's proxy's master key, as a header
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
STALL_S = 6.0  # a Redis stall longer than redis-py's own retries (3 x the 1 s socket timeout)


class Engine(threading.Thread):
    """An OpenAI-compatible engine in its own thread and loop (it outlives each test's loop)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.port = free_port()
        self.seen: list[str] = []
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.delay = 0.0  # seconds before each answer, set by a test

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(request.headers.get("X-Request-Id", ""))
        await asyncio.sleep(self.delay)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "llama"}
            for i in range(3):
                await resp.write(f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {'content': f't{i}'}}]})}\n\n".encode())
            await resp.write(f"data: {json.dumps({**base, 'choices': [], 'usage': USAGE})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 1,
                "model": "llama",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": USAGE,
            }
        )

    async def other(self, request: web.Request) -> web.Response:
        self.seen.append(f"{request.method} {request.raw_path}")
        return web.json_response({})

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_route("*", "/{tail:.*}", self.other)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def litellm(tmp_path_factory) -> Iterator[tuple[str, Engine, RedisServer]]:
    tmp = tmp_path_factory.mktemp("litellm")
    engine = Engine()
    engine.start()
    engine.ready.wait(10)
    redis = RedisServer().start()
    gate = tmp / "gate.yml"
    gate.write_text(
        "admission: {reject_if_queue_age_ms_gte: 3000, reject_if_retry_count_gte: 1, ignore_worker_util_when_slack_ms_lte: 0}\n"
        f"gate:\n  redis: {redis.url}\n  queue_prefix: '{PREFIX}'\n"
        "  routes:\n    chat: {upstream: 'http://127.0.0.1:1', models: [llama], default_deadline_ms: 30000, redis_down: closed}\n"
    )
    try:
        with LiteLLM(tmp, engine_port=engine.port, gate_config=gate) as proxy:
            AUTH.update(proxy.headers)
            yield proxy.url, engine, redis
    finally:
        engine.stop()
        redis.stop()


async def chat(url: str, headers: dict[str, str], stream: bool = False) -> tuple[int, Any, Any]:
    body: dict[str, Any] = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body, headers={**AUTH, **headers}) as r:
        raw = await r.read()
        return r.status, (raw if stream else json.loads(raw)), r.headers.copy()


async def record(redis: RedisServer, request_id: str, tenant: str = "default", timeout: float = 20.0):
    q = AdmissionQueue.from_url(redis.url, prefix=PREFIX)
    try:
        deadline = time.monotonic() + timeout
        while True:
            rec = await q.read(f"{tenant}/{request_id}")
            if (rec and rec.state == "done" and rec.attempts >= 1) or time.monotonic() > deadline:
                return rec
            await asyncio.sleep(0.02)
    finally:
        await q.aclose()


def decision(body: Any, headers: Any) -> str:
    """The gate's decision, from LiteLLM's OpenAI-shaped error body and from the header: the same."""
    fields = body["error"]["provider_specific_fields"]
    assert fields["type"] == "admission_rejected" and headers["X-LLM-Health-Decision"] == fields["code"], (body, headers)
    return fields["code"]


def timeout_ms(ms: int) -> dict[str, str]:
    return {"X-Request-Timeout-Ms": str(ms)}


async def test_a_fresh_request_passes_and_its_record_has_the_usage(litellm):
    url, _, redis = litellm
    status, body, _ = await chat(url, {"X-Request-Id": "l1", **timeout_ms(30000)})
    assert status == 200 and body["choices"][0]["message"]["content"] == "ok", body
    rec = await record(redis, "l1")
    assert rec is not None and rec.state == "done" and rec.attempts == 1 and rec.http_status == 200 and rec.token_units == 10, rec


async def test_a_stream_passes_and_its_record_has_the_usage(litellm):
    url, _, redis = litellm
    status, raw, _ = await chat(url, {"X-Request-Id": "l2", **timeout_ms(30000)}, stream=True)
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    rec = await record(redis, "l2")
    assert rec is not None and rec.state == "done" and rec.http_status == 200 and rec.token_units == 10, rec


async def test_a_late_retry_is_refused_non_retryable(litellm):
    url, engine, _ = litellm
    before = len(engine.seen)
    status, body, headers = await chat(url, {"X-Request-Id": "l3", "X-Retry-Count": "1", **timeout_ms(0)})
    assert status == 422 and decision(body, headers) == "reject_retry_late", body
    assert len(engine.seen) == before


async def test_a_retry_without_an_id_keeps_its_first_copys_deadline(litellm):
    """The OpenAI SDK's way: no id, the same body and deadline header, `X-Stainless-Retry-Count`
    1 on the retry, sent after the first copy timed out at the client. The retry is matched to
    its first copy through LiteLLM's call data, so its deadline is the first copy's, past by
    now: refused, the engine not reached. (A first copy answered 200 is never matched: a
    client retries what it did not get.)"""
    url, engine, _ = litellm
    h = {"X-Request-Timeout-Ms": "1000", "X-Stainless-Retry-Count": "0"}
    body = {"model": "llama", "messages": [{"role": "user", "content": "retry-me"}]}
    engine.delay = 3.0
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(url + "/v1/chat/completions", json=body, headers={**AUTH, **h}, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    await r.read()
    finally:
        engine.delay = 0.0
    async with aiohttp.ClientSession() as s:
        before = len(engine.seen)
        await asyncio.sleep(1.2)
        async with s.post(url + "/v1/chat/completions", json=body, headers={**AUTH, **h, "X-Stainless-Retry-Count": "1"}) as r:
            status, got, headers = r.status, json.loads(await r.read()), r.headers.copy()
        # A fresh request with the same body is a new request: admitted.
        async with s.post(url + "/v1/chat/completions", json=body, headers={**AUTH, **h}) as r:
            assert r.status == 200, await r.read()
    assert status == 422 and decision(got, headers) == "reject_retry_late", got
    assert len(engine.seen) == before + 1


async def test_queue_age_beating_slack_is_refused_with_retry_after(litellm):
    url, engine, redis = litellm
    q = AdmissionQueue.from_url(redis.url, prefix=PREFIX)
    now = int(time.time() * 1000)
    await q.enqueue("default/old", "chat", "default", deadline_ms=now + 60000, enqueued_ms=now - 4000)
    before = len(engine.seen)
    try:
        status, body, headers = await chat(url, {"X-Request-Id": "l4", **timeout_ms(60000)})
    finally:
        await q.complete("default/old", 499, route="chat")
        await q.aclose()
    assert status == 503 and decision(body, headers) == "reject_age_beats_slack", body
    assert int(headers["Retry-After"]) >= 1 and len(engine.seen) == before


async def test_tenant_a_s_id_never_refuses_tenant_b(litellm):
    url, _, _ = litellm
    assert (await chat(url, {"X-Tenant": "a", "X-Request-Id": "o1", **timeout_ms(1)}))[0] == 200
    await asyncio.sleep(0.05)
    assert (await chat(url, {"X-Tenant": "a", "X-Request-Id": "o1"}))[0] == 422
    assert (await chat(url, {"X-Tenant": "b", "X-Request-Id": "o1", **timeout_ms(30000)}))[0] == 200


@pytest.mark.parametrize("method,path", [("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("POST", "/reset_prefix_cache"), ("POST", "/metrics")])
async def test_engine_admin_endpoints_never_reach_the_engine(litellm, method, path):
    url, engine, _ = litellm
    before = len(engine.seen)
    async with aiohttp.ClientSession() as s, s.request(method, url + path, headers=AUTH) as r:
        await r.read()
    assert r.status != 200 or path == "/metrics", (path, r.status)  # LiteLLM's own /metrics, if any, is LiteLLM's
    assert engine.seen[before:] == []


async def test_a_redis_stall_leaves_no_record_running_after_its_answer(litellm):
    """Redis SIGSTOPped once the engine has the call (the decision is behind it) and kept
    stopped past redis-py's own retries (1 s socket timeout): LiteLLM answers meanwhile,
    and once Redis answers again the attempt's record is finished, not left running. (The
    gate's counters of records sent again live in LiteLLM's process, out of this test's
    reach: the record may be written by a resent script or by the first copy Redis reads
    when it resumes; the script is idempotent, so either counts the attempt once.)"""
    url, engine, redis = litellm
    before = len(engine.seen)
    engine.delay = 0.5
    try:
        task = asyncio.ensure_future(chat(url, {"X-Request-Id": "l-stall", **timeout_ms(60000)}))
        await until(lambda: len(engine.seen) > before, what="the engine to get the call")
        with Stalled(redis):
            status, body, _ = await task
            assert status == 200, body  # the answer never waits for the record
            await asyncio.sleep(STALL_S)  # past redis-py's retries: the record is sent again after
    finally:
        engine.delay = 0.0
    rec = await record(redis, "l-stall", timeout=60)
    assert rec is not None and rec.state == "done" and rec.attempts == 1 and rec.http_status == 200 and rec.token_units == 10, rec


async def test_an_enqueue_run_late_by_a_stall_leaves_no_record_running(litellm):
    """Redis SIGSTOPped before the call, for longer than the hook waits: its enqueue is sent
    and times out, the route fails closed (503 `reject_redis_down`), and Redis runs the
    enqueue when it resumes, after the answer. The hook marks the id done once Redis
    answers and once more after: no record `running` (the hook's writes are in LiteLLM's
    process: the record is read until it is done, or for 15 s)."""
    url, _, redis = litellm
    warm = await asyncio.gather(*(chat(url, {"X-Request-Id": f"l-warm-{i}", **timeout_ms(60000)}) for i in range(8)))
    assert all(w[0] == 200 for w in warm)  # scripts loaded, connections open in the hook's pool
    with Stalled(redis):
        status, body, headers = await chat(url, {"X-Request-Id": "l-late", **timeout_ms(60000)})
        assert status == 503 and decision(body, headers) == "reject_redis_down", body
    recs = await not_running(redis.url, PREFIX, ["l-late"])
    print(f"record after the stall: { {i: r and r.state for i, r in recs.items()} }")
    assert all(r is None or r.state == "done" for r in recs.values()), recs


async def test_zz_redis_down_is_the_route_s_policy(litellm):  # last: it stops the module's Redis
    url, engine, redis = litellm
    before = len(engine.seen)
    redis.kill()
    status, body, headers = await chat(url, timeout_ms(30000))
    assert status == 503 and decision(body, headers) == "reject_redis_down" and "Retry-After" in headers, body
    assert len(engine.seen) == before
