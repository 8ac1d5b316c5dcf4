"""Issue 48: identical bodies from two callers sharing one API key, each with its own
deadline, through the official `openai` SDK (pinned; its default retries, a per-attempt
timeout equal to the deadline), through the gate, nginx + `llm-health decide`, nginx
deciding itself (its Lua module, deploy/nginx/nginx-lua.conf), the
LiteLLM hook (the pinned LiteLLM proxy running deploy/litellm, its one master key shared
by both callers), and the Envoy ext_authz door (Envoy's documented filter behaviour, as
test_door_envoy drives it, here in front of the SDK as an HTTP server).

- the issue's scenario ("slow"): route default deadline 3 s, the upstream takes 4 s; A at
  t=0, B at t=2 s; each SDK times out at its deadline and retries. Every retry is sent
  after its own caller's deadline: each is refused (422, not retryable) and never reaches
  the upstream (2 copies there, never 3), and each record counts its own retry only.
- a quick refusal ("shed", deadline 8 s): A's copy is at the upstream (3 s), B's is shed
  at once (503, `retry-after-ms`), and B's SDK retries well within B's deadline: it is
  admitted, never refused because of A, and booked on B's record (B's attempts and tokens,
  A's its own) where the door reports an attempt's end (the gate and the LiteLLM hook;
  nginx, which sees no response body and so counts no tokens). Envoy's ext_authz
  reports no end: there the match is first in, first out alone and B's retry is booked on
  A's older record (docs/admission.md says so), still admitted.

No assertion on a wall-clock time: the orders are made by events (B starts once A's copy
is at the upstream), and the margins (seconds) only ever grow under load."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from aiohttp import web

from llm_health.config.gate import parse_gate_config
from llm_health.gate.doors import Doors
from llm_health.store.connection import text
from llm_health.store.queue import AdmissionQueue, QueueRecord
from tests.fixtures.doors import serve
from tests.fixtures.litellm import LiteLLM, installed
from tests.fixtures.nginx import Nginx, NginxLua
from tests.integration.test_door_envoy import EnvoyExtAuthz
from tests.integration.test_door_nginx import free_udp_port
from tests.integration.test_openai_sdk import Attempts, serving_chat, serving_gate

DEADLINE_MS = 3000  # the route's default: the scenario
SLOW_S = 4.0
SHED_DEADLINE_MS = 8000
SHED_FIRST_S = 3.0
KEY = "sk-shared-not-a-secret"
USAGE_A, USAGE_B = 10, 20


class Upstream:
    """Counts the copies of each prompt that reach it and the retry counts they carry.
    "slow": answered after SLOW_S. "shed": the first copy after SHED_FIRST_S (USAGE_A
    tokens), the second shed at once (503, retry-after-ms 1500), later ones at once
    (USAGE_B tokens)."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.retries: list[str] = []
        self.first_in = {"slow": asyncio.Event(), "shed": asyncio.Event()}

    async def chat(self, request: web.Request) -> web.Response:
        prompt = json.loads(await request.read())["messages"][0]["content"]
        self.seen[prompt] += 1
        self.retries.append(request.headers.get("x-stainless-retry-count", "?"))
        n = self.seen[prompt]
        self.first_in[prompt].set()
        if prompt == "slow":
            await asyncio.sleep(SLOW_S)
            return answer(USAGE_A)
        if n == 1:
            await asyncio.sleep(SHED_FIRST_S)
            return answer(USAGE_A)
        if n == 2:
            return web.json_response({"error": {"message": "queue full"}}, status=503, headers={"retry-after-ms": "1500"})
        return answer(USAGE_B)


def answer(units: int) -> web.Response:
    usage = {"prompt_tokens": units - 1, "completion_tokens": 1, "total_tokens": units}
    body = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "usage": usage}
    body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]
    return web.json_response(body)


def sdk(base_url: str, attempts: Attempts, timeout_s: float, key: str = KEY) -> openai.AsyncOpenAI:
    """A caller as teams run one: the SDK's default retries, a per-attempt timeout = the deadline."""
    http = openai.DefaultAsyncHttpx2Client(transport=attempts.transport())
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, timeout=timeout_s, http_client=http)


async def ask(c: openai.AsyncOpenAI, prompt: str, headers: dict[str, str], model: str = "m") -> str:
    try:
        await c.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], extra_headers=headers)
        return "ok"
    except openai.APIStatusError as exc:
        return f"{exc.status_code} {exc.response.headers.get('x-llm-health-decision')}"
    except openai.APIError as exc:
        return type(exc).__name__
    finally:
        await c.close()


async def two_callers(
    url: str, up: Upstream, prompt: str, headers: dict[str, str], timeout_s: float, b_after_s: float, key: str = KEY, model: str = "m"
) -> tuple[list[str], list[Attempts]]:
    """A, then B once A's copy is at the upstream (and b_after_s after A began)."""
    logs = [Attempts(), Attempts()]
    a = asyncio.ensure_future(ask(sdk(url, logs[0], timeout_s, key), prompt, headers, model))
    await asyncio.gather(up.first_in[prompt].wait(), asyncio.sleep(b_after_s))
    b = asyncio.ensure_future(ask(sdk(url, logs[1], timeout_s, key), prompt, headers, model))
    return list(await asyncio.gather(a, b)), logs


async def records(redis_url: str, prefix: str, tenant: str, n: int, settled: Any) -> list[QueueRecord]:
    """The tenant's records once `settled` holds for n of them (the doors write an attempt's
    end just after the answer), oldest first."""
    q = AdmissionQueue.from_url(redis_url, prefix=prefix)
    try:
        for _ in range(1000):
            found = await tenant_records(q, tenant)
            if len(found) >= n and all(settled(r) for r in found):
                break
            await asyncio.sleep(0.02)
        return found
    finally:
        await q.aclose()


async def tenant_records(q: AdmissionQueue, tenant: str) -> list[QueueRecord]:
    """Every record of the tenant, oldest first."""
    keys = [text(k) for k in await q.redis.keys(q.keys.record(f"{tenant}/*"))]
    found = [r for k in keys if (r := await q.read(k[len(q.keys.record("")) :])) is not None]
    return sorted(found, key=lambda r: r.enqueued_ms)


async def door_view(redis_url: str, prefix: str, tenant: str) -> str:
    """The tenant's records as the door wrote them, for a failure's report: when the door
    first saw each request and the deadline it took, on the attempts' clock (monotonic
    seconds, `Attempts.line`), so a door that saw a request late (a proxy in front held
    it) can be told from a retry matched to the wrong record."""
    shift = time.monotonic() - time.time()
    q = AdmissionQueue.from_url(redis_url, prefix=prefix)
    try:
        found = await tenant_records(q, tenant)
        return "; ".join(
            f"{r.request_id} seen {r.enqueued_ms / 1000 + shift:.2f}s deadline {r.deadline_ms / 1000 + shift:.2f}s retries {r.retry_count} attempts {r.attempts} {r.state}"
            for r in found
        )
    finally:
        await q.aclose()


def statuses(log: Attempts, prompt: str) -> list[int | None]:
    return [s for _, _, s in log.by_prompt[prompt]]


async def scenario(
    url: str,
    up: Upstream,
    redis_url: str,
    prefix: str,
    ends_reported: bool,
    tokens: bool,
    key: str = KEY,
    model: str = "m",
    forwards_sdk_headers: bool = True,
    finishes_abandoned: bool = False,
) -> None:
    """``ends_reported``: the door learns an attempt's end (the gate, nginx's access log, the
    LiteLLM hook); ``tokens``: and the answer's usage (the gate, the LiteLLM hook; nginx
    sees no response body); ``forwards_sdk_headers``: the SDK's headers reach the upstream
    (LiteLLM makes its own call); ``finishes_abandoned``: a call whose client timed out
    still runs to its answer (LiteLLM's, non-streaming), and that answer's tokens are booked
    on its own caller's record."""
    # The scenario: every retry after its own caller's deadline.
    ends, logs = await two_callers(url, up, "slow", {"X-Tenant": "slow"}, DEADLINE_MS / 1000, 2.0, key, model)
    report = f"slow: ends {ends}; upstream {dict(up.seen)}; A {logs[0].line('slow', 0)}; B {logs[1].line('slow', 0)}"
    if ends != ["422 reject_retry_late"] * 2:
        report += f"; the door's records: {await door_view(redis_url, prefix, 'slow')}"
    assert ends == ["422 reject_retry_late"] * 2, report
    assert [statuses(log, "slow") for log in logs] == [[None, 422]] * 2, report  # a timeout, then the refused retry
    assert up.seen["slow"] == 2, report  # no retry reached the upstream
    recs = await records(redis_url, prefix, "slow", 2, lambda r: r.state == "done" and r.attempts >= 1)
    spent = USAGE_A if finishes_abandoned else 0
    assert [(r.retry_count, r.attempts, r.token_units) for r in recs] == [(1, 1, spent)] * 2, (report, recs)  # one retry each, no third record

    # A quick refusal: B's retry within B's deadline, while A's copy is still at the upstream.
    headers = {"X-Tenant": "shed", "X-Request-Timeout-Ms": str(SHED_DEADLINE_MS)}
    ends, logs = await two_callers(url, up, "shed", headers, SHED_DEADLINE_MS / 1000, 0.0, key, model)
    report = f"shed: ends {ends}; upstream {dict(up.seen)}; A {logs[0].line('shed', 0)}; B {logs[1].line('shed', 0)}"
    assert ends == ["ok", "ok"], report  # never refused because of the other caller
    assert [statuses(log, "shed") for log in logs] == [[200], [503, 200]], report
    assert up.seen["shed"] == 3, report
    recs = await records(redis_url, prefix, "shed", 2, lambda r: r.state == "done" and r.attempts >= 1)
    got = [(r.retry_count, r.attempts, r.token_units) for r in recs]
    if ends_reported:
        want = [(0, 1, USAGE_A if tokens else 0), (1, 2, USAGE_B if tokens else 0)]
        assert got == want, (report, recs)  # each its own retries and tokens; the 503 spent none
    else:
        assert got == [(1, 2, 0), (0, 1, 0)], (report, recs)  # Envoy: no end, no tokens; first in, first out
    if forwards_sdk_headers:
        assert set(up.retries) == {"0", "1"} and up.retries.count("1") == 1, up.retries  # the one retry that reached it: B's


def config(upstream: str, redis_url: str) -> Any:
    route = {"upstream": upstream, "default_deadline_ms": DEADLINE_MS}
    return parse_gate_config({"gate": {"redis": redis_url, "routes": {"chat": route}}}, "test.yml")


@pytest.fixture
async def upstream():
    up = Upstream()
    async with serving_chat(up) as url:
        yield up, url


async def test_through_the_gate(upstream, redis_url):
    up, uurl = upstream
    async with serving_gate(config(uurl, redis_url)) as (gate, url):
        await scenario(url, up, redis_url, gate.cfg.queue_prefix, ends_reported=True, tokens=True)


async def test_through_nginx_and_decide(upstream, own_redis_server, tmp_path):
    up, uurl = upstream
    doors = Doors(config(uurl, own_redis_server.url))
    syslog_port = free_udp_port()
    drunner, durl = await serve(doors.app(syslog=("127.0.0.1", syslog_port)))
    nginx = Nginx(tmp_path, decide_port=int(durl.rsplit(":", 1)[1]), engine_port=int(uurl.rsplit(":", 1)[1]), syslog_port=syslog_port)
    try:
        with nginx:
            await scenario(nginx.url, up, own_redis_server.url, doors.admission.cfg.queue_prefix, ends_reported=True, tokens=False)
    finally:
        await drunner.cleanup()


async def test_through_nginx_lua(upstream, own_redis_server, tmp_path):
    """The decision inside nginx (deploy/nginx/nginx-lua.conf): it hashes the body, and reads
    the answer's usage, so each record gets its own retries and tokens."""
    up, uurl = upstream
    path = tmp_path / "gate.yml"
    path.write_text(yaml.safe_dump({"gate": {"redis": own_redis_server.url, "routes": {"chat": {"upstream": uurl, "default_deadline_ms": DEADLINE_MS}}}}))
    with NginxLua(tmp_path, gate_file=path, engine_port=int(uurl.rsplit(":", 1)[1])) as nginx:
        await scenario(nginx.url, up, own_redis_server.url, config(uurl, own_redis_server.url).queue_prefix, ends_reported=True, tokens=True)


async def test_through_envoy_ext_authz(upstream, own_redis_server):
    """Envoy's ext_authz filter as test_door_envoy reads it from deploy/envoy/envoy.yaml,
    serving the SDK: the check (allowed headers, headers_to_add, no body), then the request
    with its body to the engine, or the refusal to the client."""
    up, uurl = upstream
    doors = Doors(config(uurl, own_redis_server.url))
    drunner, durl = await serve(doors.app())
    ext = EnvoyExtAuthz(durl, uurl)
    session = aiohttp.ClientSession(auto_decompress=False)

    async def front(request: web.Request) -> web.Response:
        body = await request.read()
        check = {k: v for k, v in request.headers.items() if k.lower() in ext.allowed}
        check.update(ext.to_add)
        check["Content-Length"] = "0"
        async with session.request(request.method, ext.authz_url + ext.prefix + request.raw_path, headers=check) as r:
            status, reply, authz = r.status, await r.read(), r.headers.copy()
        if status != 200:
            return web.Response(status=status, body=reply, headers={k: v for k, v in authz.items() if k.lower() in ext.client})
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        headers.update({k: v for k, v in authz.items() if k.lower() in ext.upstream})
        async with session.request(request.method, ext.engine_url + request.raw_path, headers=headers, data=body) as r:
            out = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", "retry-after-ms")}
            out.update({k: v for k, v in authz.items() if k.lower() in ext.client_ok})
            return web.Response(status=r.status, body=await r.read(), headers=out)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", front)
    frunner, furl = await serve(app, handler_cancellation=True)
    try:
        await scenario(furl, up, own_redis_server.url, doors.admission.cfg.queue_prefix, ends_reported=False, tokens=False)
    finally:
        await frunner.cleanup()
        await session.close()
        await drunner.cleanup()


@pytest.mark.skipif(not installed(), reason="the pinned LiteLLM: .ci/install-litellm.sh")
async def test_through_the_litellm_hook(upstream, own_redis_server, tmp_path):
    """The shipped deploy/litellm config and callback in the pinned LiteLLM proxy, in front
    of the upstream; both callers use the proxy's one master key (LiteLLM hands the hook
    its hash, never the key), the route chosen by the model."""
    up, uurl = upstream
    gate = tmp_path / "gate.yml"
    route = f"{{upstream: 'http://127.0.0.1:1', models: [llama], default_deadline_ms: {DEADLINE_MS}}}"
    gate.write_text(f"gate:\n  redis: {own_redis_server.url}\n  queue_prefix: 'shared-key:'\n  routes:\n    chat: {route}\n")
    with LiteLLM(tmp_path, engine_port=int(uurl.rsplit(":", 1)[1]), gate_config=gate) as proxy:
        await scenario(
            proxy.url,
            up,
            own_redis_server.url,
            "shared-key:",
            ends_reported=True,
            tokens=True,
            key=proxy.master_key,
            model="llama",
            forwards_sdk_headers=False,
            finishes_abandoned=True,
        )
