"""The real OpenAI SDK (pinned in the test extras) as teams run it, through `llm-health gate`
and through nginx + `llm-health decide`, in the field report's retry drill: a client
deadline of 3000 ms, the SDK's timeout 3.5 s, `max_retries=3`, an upstream that answers
503 after 4 s. Every deadline style the docs name, with and without an id, streaming
included: the upstream sees each request exactly once and the SDK ends on the gate's
non-retryable refusal. A closed route and a spent tenant budget never bring the SDK back
past its deadline. Fresh requests with identical bodies are never taken for retries.

The scenarios of one door run concurrently (each its own prompt, so the upstream counts
them apart): the drill's 4 s wait is paid once per door."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx2 as httpx  # the HTTP client the SDK is built on (openai 3.x)
import openai
import pytest
import redis
from aiohttp import web

from llm_health.config.gate import parse_gate_config
from llm_health.gate.app import Gate
from llm_health.gate.doors import Doors
from tests.fixtures.nginx import Nginx
from tests.integration.test_door_nginx import free_udp_port
from tests.integration.test_gate import serve

DEADLINE_MS = 3000
SDK_TIMEOUT_S = 3.5
UPSTREAM_DELAY_S = 4.0
MAX_RETRIES = 3


class SlowUpstream:
    """Answers every chat completion with a 503 after UPSTREAM_DELAY_S (unless the prompt
    asks for a quick 200), counting the copies of each prompt that reached it."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        prompt = json.loads(await request.read())["messages"][0]["content"]
        self.seen[prompt] += 1
        if prompt.startswith("quick"):
            return web.json_response(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )
        await asyncio.sleep(UPSTREAM_DELAY_S)
        return web.json_response({"error": {"message": "overloaded"}}, status=503)


class Attempts:
    """The SDK's attempts as its HTTP client sends them: time since the call began, the
    retry count it stamped, the status it got (None: its timeout)."""

    def __init__(self) -> None:
        self.by_prompt: dict[str, list[tuple[float, str, int | None]]] = {}

    def transport(self) -> httpx.AsyncHTTPTransport:
        outer = self

        class Recording(httpx.AsyncHTTPTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                prompt = json.loads(request.content)["messages"][0]["content"]
                log = outer.by_prompt.setdefault(prompt, [])
                entry = [time.monotonic(), request.headers.get("x-stainless-retry-count", "?"), None]
                log.append(entry)  # type: ignore[arg-type]
                response = await super().handle_async_request(request)
                entry[2] = response.status_code
                return response

        return Recording()

    def line(self, prompt: str, t0: float) -> str:
        return ", ".join(f"{t - t0:.2f}s retry={n} -> {s or 'timeout'}" for t, n, s in self.by_prompt.get(prompt, []))


def client(base_url: str, attempts: Attempts, **headers: str) -> openai.AsyncOpenAI:
    http = openai.DefaultAsyncHttpx2Client(transport=attempts.transport())  # the SDK's own client, its transport recorded
    return openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="sk-test-not-a-secret", max_retries=MAX_RETRIES, timeout=SDK_TIMEOUT_S, default_headers=headers, http_client=http
    )


async def ask(c: openai.AsyncOpenAI, prompt: str, headers: dict[str, str], stream: bool = False) -> tuple[str, float]:
    """The SDK's end: the error class and status it raised, and when."""
    t0 = time.monotonic()
    try:
        if stream:
            s = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], stream=True, extra_headers=headers)
            async for _ in s:
                pass
        else:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], extra_headers=headers)
        return "ok", time.monotonic() - t0
    except openai.APIStatusError as exc:
        return f"{type(exc).__name__} {exc.status_code} {exc.response.headers.get('x-llm-health-decision')}", time.monotonic() - t0
    except openai.APIError as exc:
        return type(exc).__name__, time.monotonic() - t0


def styles(tag: str) -> dict[str, dict[str, str]]:
    """The deadline styles of issue 39's table: prompt -> the headers the caller adds per call."""
    now = int(time.time() * 1000)
    return {
        f"{tag}-absolute": {"X-Request-Deadline-Ms": str(now + DEADLINE_MS)},
        f"{tag}-absolute-id": {"X-Request-Deadline-Ms": str(now + DEADLINE_MS), "X-Request-Id": f"{tag}-abs-1"},
        f"{tag}-relative": {"X-Request-Timeout-Ms": str(DEADLINE_MS)},
        f"{tag}-relative-id": {"X-Request-Timeout-Ms": str(DEADLINE_MS), "X-Request-Id": f"{tag}-rel-1"},
        f"{tag}-route-default": {},
        f"{tag}-route-default-stream": {},
        f"{tag}-relative-stream": {"X-Request-Timeout-Ms": str(DEADLINE_MS)},
    }


def gate_config(upstream: str, redis_url: str, **route: Any) -> Any:
    return parse_gate_config(
        {
            "gate": {
                "redis": redis_url,
                "routes": {"chat": {"upstream": upstream, "default_deadline_ms": DEADLINE_MS, **route}},
                "tenants": {"spent": {"token_units_per_minute": 1}},
            }
        },
        "test.yml",
    )


async def drill(base_url: str, upstream: SlowUpstream, tag: str) -> None:
    attempts = Attempts()
    c = client(base_url, attempts)
    cases = styles(tag)
    t0 = time.monotonic()
    ends = await asyncio.gather(*(ask(c, prompt, h, stream=prompt.endswith("stream")) for prompt, h in cases.items()))
    await c.close()
    report = []
    for (prompt, _), (end, took) in zip(cases.items(), ends):
        report.append(f"{prompt}: upstream copies {upstream.seen[prompt]}; SDK ended {end} after {took:.2f}s; attempts: {attempts.line(prompt, t0)}")
    print("\n".join(report))
    for (prompt, _), (end, _took) in zip(cases.items(), ends):
        assert upstream.seen[prompt] == 1, report
        assert end == "UnprocessableEntityError 422 reject_retry_late", report
        # the SDK's timeout, then one retry the gate refused as late: no third attempt
        assert [s for _, _, s in attempts.by_prompt[prompt]] == [None, 422], report


async def closed_and_spent(base_url: str, upstream: SlowUpstream, admission: Any, redis_url: str) -> None:
    """A spent tenant budget (429, Retry-After 60) and a closed route (503, Retry-After 30)
    for requests with 3 s left: the SDK never comes back past its deadline."""
    keys = admission.queue.keys
    with redis.Redis.from_url(redis_url) as r:  # the tenant's spend, this minute and the next
        minute = int(time.time() // 60)
        for m in (minute, minute + 1):
            r.set(keys.tenant("spent", m), 100, ex=180)
    attempts = Attempts()
    c = client(base_url, attempts)
    t0 = time.monotonic()
    end_budget = await ask(c, "quick-budget", {"X-Tenant": "spent"})
    route = admission.cfg.routes["chat"]
    route.policy = replace(route.policy, mode="reject_all")
    end_closed = await ask(c, "quick-closed", {})
    await c.close()
    print(f"spent budget: SDK ended {end_budget[0]} after {end_budget[1]:.2f}s; attempts: {attempts.line('quick-budget', t0)}")
    print(f"closed route: SDK ended {end_closed[0]} after {end_closed[1]:.2f}s; attempts: {attempts.line('quick-closed', t0)}")
    for prompt, (end, took), decision in (("quick-budget", end_budget, "reject_tenant_budget"), ("quick-closed", end_closed, "reject_route_closed")):
        assert took < DEADLINE_MS / 1000, (prompt, end, took)
        assert len(attempts.by_prompt[prompt]) == 1 and upstream.seen[prompt] == 0, attempts.line(prompt, t0)
        assert end == f"UnprocessableEntityError 422 {decision}", end


async def identical_fresh(base_url: str, upstream: SlowUpstream) -> None:
    attempts = Attempts()
    c = client(base_url, attempts)
    ends = [await ask(c, "quick-same", {}) for _ in range(3)]
    ends += await asyncio.gather(*(ask(c, "quick-same", {}) for _ in range(3)))
    await c.close()
    assert [e for e, _ in ends] == ["ok"] * 6 and upstream.seen["quick-same"] == 6, (ends, upstream.seen)


@contextlib.asynccontextmanager
async def serving_chat(up: Any) -> AsyncIterator[str]:
    """``up.chat`` served as an engine's /v1/chat/completions on loopback: its URL."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", up.chat)
    runner, url = await serve(app, handler_cancellation=True)
    try:
        yield url
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving_gate(cfg: Any) -> AsyncIterator[tuple[Gate, str]]:
    """`llm-health gate` on ``cfg``, served on loopback: the gate and its URL."""
    gate = Gate(cfg)
    runner, url = await serve(gate.app(), handler_cancellation=True)
    try:
        yield gate, url
    finally:
        await runner.cleanup()


@pytest.fixture
async def upstream_url():
    up = SlowUpstream()
    async with serving_chat(up) as url:
        yield up, url


async def test_the_sdk_through_the_gate(upstream_url, redis_url):
    up, uurl = upstream_url
    async with serving_gate(gate_config(uurl, redis_url)) as (gate, url):
        await drill(url, up, "gate")
        await identical_fresh(url, up)
        await closed_and_spent(url, up, gate.admission, redis_url)


async def test_the_sdk_through_nginx_and_decide(upstream_url, own_redis_server, tmp_path):
    up, uurl = upstream_url
    doors = Doors(gate_config(uurl, own_redis_server.url))
    syslog_port = free_udp_port()
    drunner, durl = await serve(doors.app(syslog=("127.0.0.1", syslog_port)))
    nginx = Nginx(tmp_path, decide_port=int(durl.rsplit(":", 1)[1]), engine_port=int(uurl.rsplit(":", 1)[1]), syslog_port=syslog_port)
    try:
        with nginx:
            await drill(nginx.url, up, "nginx")
            await identical_fresh(nginx.url, up)
            await closed_and_spent(nginx.url, up, doors.admission, own_redis_server.url)
    finally:
        await drunner.cleanup()


async def test_the_docs_sdk_example_runs_as_written(upstream_url, redis_url):
    """docs/admission.md's example, its address pointed at a gate on loopback."""
    import re

    from tests.fixtures.paths import ROOT

    doc = (ROOT / "docs" / "admission.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "OpenAI(" in b]
    up, uurl = upstream_url
    async with serving_gate(gate_config(uurl, redis_url)) as (_, url):
        code = block.replace("http://gate.internal:9119", url).replace('"hello"', '"quick-docs"')
        assert code != block, "the example no longer names http://gate.internal:9119"
        scope: dict[str, Any] = {}
        await asyncio.to_thread(exec, code, scope)
        assert scope["reply"].choices[0].message.content == "ok" and up.seen["quick-docs"] == 1
