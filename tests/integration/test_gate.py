"""The admission gate, real HTTP on loopback, a real redis-server, a fake upstream worker."""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config.errors import ConfigError
from llm_health.config.gate import parse_gate_config
from llm_health.gate.app import Gate
from llm_health.gate.headers import token_units
from llm_health.sim import drills
from llm_health.store.queue import AdmissionQueue
from tests.fixtures.doors import serve

SSE_CHUNKS = [f'data: {{"choices":[{{"delta":{{"content":"tok{i}"}}}}]}}\n\n'.encode() for i in range(20)] + [
    b'data: {"choices":[],"usage":{"prompt_tokens":256,"completion_tokens":20,"total_tokens":276}}\n\n',
    b"data: [DONE]\n\n",
]


class Upstream:
    def __init__(self):
        self.calls = []
        self.delay = 0.0
        self.status = 200
        self.stream_pause = 0.0
        self.cancelled = asyncio.Event()
        self.finished_streams = 0

    async def completions(self, request):
        body = await request.json()
        self.calls.append((request.headers.get("X-Request-Id"), body))
        await asyncio.sleep(self.delay)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                for chunk in SSE_CHUNKS:
                    await resp.write(chunk)
                    await asyncio.sleep(self.stream_pause)
            except (asyncio.CancelledError, ConnectionResetError):
                self.cancelled.set()
                raise
            self.finished_streams += 1
            await resp.write_eof()
            return resp
        usage = {"prompt_tokens": 256, "completion_tokens": 16, "total_tokens": 272}
        return web.json_response({"choices": [{"text": "ok"}], "usage": usage}, status=self.status)


@pytest.fixture
async def stack(redis_url, tmp_path):
    """factory(config overrides) -> (gate url, upstream, gate); everything stopped at teardown."""
    runners = []

    async def make(redis=redis_url, admission=None, routes=None, **gate_extra):
        up = Upstream()
        uapp = web.Application()
        uapp.router.add_post("/v1/completions", up.completions)
        uapp.router.add_post("/v1/chat/completions", up.completions)
        ur, uurl = await serve(uapp, handler_cancellation=True)
        runners.append(ur)
        token = tmp_path / "admin.token"
        token.write_text("admin-secret\n")
        if routes:
            routes = {n: {k: (uurl if v == "UPSTREAM" else v) for k, v in r.items()} for n, r in routes.items()}
        cfg = parse_gate_config(
            {
                "admission": admission or {"reject_if_queue_age_ms_gte": 3000, "reject_if_retry_count_gte": 1, "ignore_worker_util_when_slack_ms_lte": 0},
                "gate": {
                    "redis": redis,
                    "admin_token_file": str(token),
                    "sample_interval": "100ms",
                    "routes": routes or {"chat": {"upstream": uurl, "default_deadline_ms": 30000}},
                    **gate_extra,
                },
            },
            "test.yml",
        )
        gate = Gate(cfg)
        gr, gurl = await serve(gate.app(), handler_cancellation=True)
        runners.append(gr)
        return gurl, up, gate

    yield make
    for r in reversed(runners):
        await r.cleanup()


async def recorded(redis_url, prefix, request_id, attempts=1, timeout=10.0, tenant="default"):
    """The id's record once the gate has written its attempt (it does so just after the
    response, off the client's path). Ids are kept per tenant: `<tenant>/<id>`."""
    q = AdmissionQueue.from_url(redis_url, prefix=prefix)
    try:
        deadline = time.monotonic() + timeout
        while True:
            rec = await q.read(f"{tenant}/{request_id}")
            if (rec and rec.attempts >= attempts and rec.state == "done") or time.monotonic() > deadline:
                return rec
            await asyncio.sleep(0.01)
    finally:
        await q.aclose()


def deadline_in(ms):
    return {"X-Request-Deadline-Ms": str(int(time.time() * 1000 + ms))}


async def post(url, headers=None, body=None, path="/v1/completions"):
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body or {"model": "m", "prompt": "hi"}, headers=headers or {}) as r:
        return r.status, await r.read(), dict(r.headers)


async def test_admit_records_queue_state(stack, redis_url):
    url, up, gate = await stack()
    status, body, _headers = await post(url, {"X-Request-Id": "r1", **deadline_in(5000), "X-Tenant": "acme"})
    assert status == 200 and json.loads(body)["usage"]["total_tokens"] == 272
    assert up.calls[0][0] == "r1"
    rec = await recorded(redis_url, gate.cfg.queue_prefix, "r1", tenant="acme")
    assert (rec.route, rec.tenant, rec.attempts, rec.token_units, rec.http_status, rec.state) == ("chat", "acme", 1, 272, 200, "done")


async def test_resent_id_is_a_retry_without_headers(stack):
    url, up, _ = await stack(admission={"reject_if_queue_age_ms_gte": 3000, "reject_if_retry_count_gte": 1, "ignore_worker_util_when_slack_ms_lte": 0})
    h = {"X-Request-Id": "same", **deadline_in(300)}
    assert (await post(url, h))[0] == 200
    await asyncio.sleep(0.4)  # past its deadline now; the client sends the same id again, no retry header
    status, body, _ = await post(url, h)
    err = json.loads(body)["error"]
    assert (status, err["code"], err["retry_count"]) == (422, "reject_retry_late", 1)
    assert err["deadline_slack_ms"] < 0
    assert len(up.calls) == 1


async def test_retry_drill_rejects_the_late_retry():
    """The retry drill on the real gate, 10x faster: the first retry, sent after the
    deadline, is rejected, with the negative slack the gate measured."""
    with drills.temporary_redis() as url:
        uncapped = await drills.run_retry(url, gated=False, scale=0.1)
        gated = await drills.run_retry(url, gated=True, scale=0.1)
    assert uncapped.attempts_sent == 4 and uncapped.token_units == 4 * 272
    assert gated.first_retry_rejected and gated.worker_calls == 1 and gated.token_units == 272
    assert "REJECTS lab-1 with 422 reject_retry_late" in gated.timeline
    assert gated.rejection is not None and gated.rejection.at_ms / 0.1 > 3000
    assert gated.rejection.deadline_slack_ms is not None and gated.rejection.deadline_slack_ms < 0
    text, ok = drills.format_retry(uncapped, gated)
    assert ok and "PASS" in text


async def test_normal_worker_is_admitted_once():
    with drills.temporary_redis() as url:
        r = await drills.run_retry(url, gated=True, scale=0.5, fault=False)  # 1250 ms of work, 1500 ms deadline
    assert r.statuses == [200] and r.token_units == 272


async def test_age_beats_slack_uses_route_queue_age(stack, redis_url):
    url, up, gate = await stack()
    q = AdmissionQueue.from_url(redis_url, prefix=gate.cfg.queue_prefix)
    now = int(time.time() * 1000)
    await q.enqueue("old", "chat", "t", deadline_ms=now + 60000, enqueued_ms=now - 4000)  # waiting 4 s
    await q.aclose()
    status, body, headers = await post(url, {"X-Request-Id": "new", **deadline_in(2000)})
    err = json.loads(body)["error"]
    assert (status, err["code"]) == (422, "reject_age_beats_slack")
    assert err["queue_age_ms"] >= 4000
    status, body, headers = await post(url, {"X-Request-Id": "new2", **deadline_in(60000)})
    assert status == 503 and json.loads(body)["error"]["code"] == "reject_age_beats_slack"  # over 3000 ms, but time left
    assert int(headers["Retry-After"]) >= 1
    assert up.calls == []


@pytest.mark.parametrize(
    "headers,fragment",
    [
        ({"X-Request-Deadline-Ms": "soon"}, "X-Request-Deadline-Ms must be"),
        ({"X-Request-Deadline-Ms": "1700000000"}, "Unix time in milliseconds within a week"),
        ({"X-Request-Timeout-Ms": "-5"}, "X-Request-Timeout-Ms must be the milliseconds left, an integer from 0"),
        ({"X-Request-Timeout-Ms": "3000", "X-Retry-Count": "two"}, "X-Retry-Count must be"),
    ],
)
async def test_malformed_headers_get_400(stack, headers, fragment):
    url, up, _ = await stack()
    status, body, _ = await post(url, headers)
    assert status == 400 and fragment in json.loads(body)["error"]["message"]
    assert up.calls == []


async def test_missing_deadline_without_default_is_400(stack):
    url, _up, _ = await stack(routes={"chat": {"upstream": "UPSTREAM"}})
    status, body, _ = await post(url, {"X-Request-Id": "x"})
    assert status == 400 and "no deadline" in json.loads(body)["error"]["message"]
    # the remaining-budget form and the OpenAI SDK's retry header are accepted
    status, _, _ = await post(url, {"X-Request-Timeout-Ms": "5000", "X-Stainless-Retry-Count": "0"})
    assert status == 200


async def test_streaming_passes_through_byte_for_byte(stack, redis_url):
    url, up, gate = await stack()
    up.stream_pause = 0.01
    got = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"model": "m", "stream": True}, headers={"X-Request-Id": "s1", **deadline_in(5000)}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            first_at = None
            async for chunk in r.content.iter_any():
                first_at = first_at or time.monotonic()
                got.append(chunk)
            done_at = time.monotonic()
    assert b"".join(got) == b"".join(SSE_CHUNKS)
    assert len(got) > 1  # delivered as it came, not buffered into one body
    assert done_at > first_at
    rec = await recorded(redis_url, gate.cfg.queue_prefix, "s1")
    assert rec.token_units == 276  # from the usage chunk at the end of the stream


async def test_client_disconnect_cancels_upstream(stack):
    url, up, _ = await stack()
    up.stream_pause = 0.2
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json={"model": "m", "stream": True}, headers={"X-Request-Id": "c1", **deadline_in(20000)}) as r:
            await r.content.readany()  # first chunk, then walk away
    await asyncio.wait_for(up.cancelled.wait(), 10)
    assert up.finished_streams == 0


async def test_redis_down_fails_open_or_closed(stack, own_redis_server):
    routes = {
        "open": {"upstream": "UPSTREAM", "default_deadline_ms": 60000, "redis_down": "open"},
        "closed": {"upstream": "UPSTREAM", "default_deadline_ms": 60000, "redis_down": "closed"},
    }
    url, _up, _gate = await stack(redis=own_redis_server.url, routes=routes)
    assert (await post(url, {"X-Route": "open"}))[0] == 200
    own_redis_server.kill()
    status, _, _ = await post(url, {"X-Route": "open"})
    assert status == 200
    status, body, headers = await post(url, {"X-Route": "closed"})
    assert status == 503 and json.loads(body)["error"]["code"] == "reject_redis_down" and "Retry-After" in headers
    async with aiohttp.ClientSession() as s:
        metrics = await (await s.get(url + "/metrics")).text()
    values = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(metrics) for x in f.samples}
    assert values[("llm_gate_redis_up", ())] == 0
    assert values[("llm_gate_decisions_total", (("decision", "admit_unrecorded"), ("route", "open")))] == 1
    assert values[("llm_gate_decisions_total", (("decision", "reject_redis_down"), ("route", "closed")))] == 1
    # a late retry is still refused while failing open: the headers carry the rule
    status, body, _ = await post(url, {"X-Route": "open", "X-Retry-Count": "1", "X-Request-Timeout-Ms": "0"})
    assert status == 422
    own_redis_server.start()
    assert (await post(url, {"X-Route": "open"}))[0] == 200
    async with aiohttp.ClientSession() as s:
        metrics = await (await s.get(url + "/metrics")).text()
    assert "llm_gate_redis_up 1.0" in metrics


async def test_dead_upstream_is_502(stack):
    url, _, _ = await stack(routes={"chat": {"upstream": "http://127.0.0.1:1", "default_deadline_ms": 5000}})
    status, body, _ = await post(url, {"X-Request-Id": "d1"})
    assert status == 502 and json.loads(body)["error"]["type"] == "upstream_unavailable"


async def test_operator_controls(stack, redis_url):
    url, _up, gate = await stack()
    auth = {"Authorization": "Bearer admin-secret"}
    async with aiohttp.ClientSession() as s:
        assert (await s.post(url + "/-/routes/chat/reject_all")).status == 401
        assert (await s.post(url + "/-/routes/chat/reject_all", headers={"Authorization": "Bearer wrong"})).status == 401
        assert (await s.post(url + "/-/routes/chat/reject_all", headers=auth)).status == 200
        status, body, headers = await post(url, {"X-Request-Id": "z", "X-Request-Timeout-Ms": "90000"})
        assert status == 503 and json.loads(body)["error"]["code"] == "reject_route_closed" and headers["Retry-After"] == "30"
        assert headers["x-should-retry"] == "true"
        # 30 s left (the route's default): coming back in 30 s would be late, so not retryable
        status, body, headers = await post(url, {"X-Request-Id": "z1"})
        assert (status, json.loads(body)["error"]["code"], json.loads(body)["error"]["retryable"]) == (422, "reject_route_closed", False)
        assert "Retry-After" not in headers and headers["x-should-retry"] == "false"
        # reopen refused until queue age stayed under the deadline for two sampling intervals
        gate.cfg.routes["chat"].guard.good = 0
        r = await s.post(url + "/-/routes/chat/open", headers=auth)
        assert r.status in (200, 409)
        if r.status == 409:
            await asyncio.sleep(0.35)  # the sampler runs every 100 ms in this test
            r = await s.post(url + "/-/routes/chat/open", headers=auth)
        assert r.status == 200
        assert (await post(url, {"X-Request-Id": "z2"}))[0] == 200
        # drain: ids past their deadline leave the queue
        q = AdmissionQueue.from_url(redis_url, prefix=gate.cfg.queue_prefix)
        now = int(time.time() * 1000)
        await q.enqueue("late1", "chat", "t", deadline_ms=now - 10, enqueued_ms=now - 5000)
        await q.enqueue("fine", "chat", "t", deadline_ms=now + 60000)
        r = await s.post(url + "/-/routes/chat/drain", headers=auth)
        assert (await r.json())["drained"] == 1
        stats = await q.route_stats("chat")
        await q.aclose()
        assert stats.depth == 1


async def test_reopen_refused_while_queue_age_over_deadline(stack, redis_url):
    url, _, gate = await stack()
    q = AdmissionQueue.from_url(redis_url, prefix=gate.cfg.queue_prefix)
    now = int(time.time() * 1000)
    await q.enqueue("stuck", "chat", "t", deadline_ms=now + 600000, enqueued_ms=now - 60000)  # 60 s old, deadline 30 s
    await q.aclose()
    auth = {"Authorization": "Bearer admin-secret"}
    async with aiohttp.ClientSession() as s:
        await s.post(url + "/-/routes/chat/reject_all", headers=auth)
        await asyncio.sleep(0.35)
        r = await s.post(url + "/-/routes/chat/open", headers=auth)
        assert r.status == 409 and (await r.json())["good_intervals"] == 0
        r = await s.post(url + "/-/routes/chat/open?force=true", headers=auth)
        assert r.status == 200


async def test_tenant_budget(stack, redis_url):
    url, _, gate = await stack(tenants={"small": {"token_units_per_minute": 300}})
    h = {"X-Tenant": "small", "X-Request-Timeout-Ms": "5000"}
    assert (await post(url, {**h, "X-Request-Id": "t1"}))[0] == 200  # 272 units spent
    await recorded(redis_url, gate.cfg.queue_prefix, "t1", tenant="small")
    assert (await post(url, {**h, "X-Request-Id": "t2"}))[0] == 200  # 28 left: admitted
    await recorded(redis_url, gate.cfg.queue_prefix, "t2", tenant="small")
    status, body, headers = await post(url, {**h, "X-Request-Id": "t3", "X-Request-Timeout-Ms": "90000"})
    assert status == 429 and json.loads(body)["error"]["code"] == "reject_tenant_budget" and headers["Retry-After"] == "60"
    # 5 s left: the budget's next window (60 s) is past the deadline, so not retryable
    status, body, headers = await post(url, {**h, "X-Request-Id": "t4"})
    assert (status, json.loads(body)["error"]["code"]) == (422, "reject_tenant_budget") and "Retry-After" not in headers


def test_token_units_from_usage():
    assert token_units(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}') == 12
    assert token_units(b'data: {"usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n') == 7
    assert token_units(b"no usage here") == 0


def test_gate_config_errors():

    with pytest.raises(ConfigError, match=r"gate\.routes\.chat\.upstream"):
        parse_gate_config({"gate": {"routes": {"chat": {"upstream": "nope"}}}}, "g.yml")
    with pytest.raises(ConfigError, match=r"gate\.routes"):
        parse_gate_config({"gate": {}}, "g.yml")
    with pytest.raises(ConfigError, match=r"admission\.reject_if_queue_age_ms"):
        parse_gate_config({"admission": {"reject_if_queue_age_ms": 1}, "gate": {"routes": {"c": {"upstream": "http://x"}}}}, "g.yml")


def test_drill_commands_run_and_pass():
    """The drills as a user runs them: each prints its timeline and a PASS verdict."""
    import subprocess
    import sys

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    r = subprocess.run([sys.executable, "-m", "llm_health", "drill", "watchdog"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "verdict: PASS" in r.stdout and "FALSE restart" in r.stdout
    r = subprocess.run([sys.executable, "-m", "llm_health", "drill", "retry", "--time-scale", "0.1"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reject_retry_late" in r.stdout and "verdict: PASS" in r.stdout


async def test_retry_with_time_left_is_admitted_once(stack):
    """A resent id keeps its first deadline; while it still has slack (and the queue ahead of
    it is young) the retry is admitted, with its retry count recorded."""
    url, up, _ = await stack()
    h = {"X-Request-Id": "early-retry", **deadline_in(30000)}
    up.status = 503
    assert (await post(url, h))[0] == 503  # the worker protected itself
    up.status = 200
    status, _, _ = await post(url, {**h, "X-Retry-Count": "1"})
    assert status == 200 and len(up.calls) == 2
