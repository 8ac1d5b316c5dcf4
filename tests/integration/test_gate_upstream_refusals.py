"""An engine that sheds load (vLLM's --max-num-queued-reqs and SGLang's --max-queued-requests
answer 503, Dynamo 529) refused the work: the attempt is recorded with no token units,
whatever its body reported, and counted in `llm_gate_upstream_refusals_total{route,code}`;
tokens of an answer that ended after its request's deadline are counted in
`llm_gate_late_token_units_total{route}`. Through the gate (a real upstream on loopback,
a real redis-server), through `llm-health decide`'s nginx door (the attempt's end as
nginx's access log reports it) and through nginx's Lua door (a real nginx, its end written
from its log phase)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config.gate import parse_gate_config
from llm_health.gate.app import Gate
from llm_health.gate.doors import RECORD_HEADER, Doors
from llm_health.store.queue import AdmissionQueue
from tests.fixtures.doors import serve
from tests.fixtures.nginx import NginxLua

USAGE = {"prompt_tokens": 200, "completion_tokens": 72, "total_tokens": 272}


class Shedding:
    """Answers with the status the prompt names ("503", "529", "200"), a usage object in
    every body; a "late" prompt is answered 200 only once its X-Request-Deadline-Ms passed."""

    async def chat(self, request: web.Request) -> web.Response:
        prompt = (await request.json())["messages"][0]["content"]
        if prompt == "late":
            deadline_s = int(request.headers["X-Request-Deadline-Ms"]) / 1000
            while time.time() < deadline_s + 0.2:  # no wall-clock bound: only ever later
                await asyncio.sleep(0.05)
        status = 200 if prompt in ("late", "ok") else int(prompt)
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}], "usage": USAGE}
        if status != 200:
            body = {"error": {"message": "engine queue full"}, "usage": USAGE}
        return web.json_response(body, status=status)


def config(upstream: str, redis_url: str) -> Any:
    return parse_gate_config(
        {
            "admission": {"reject_if_queue_age_ms_gte": 600_000, "reject_if_retry_count_gte": 5, "ignore_worker_util_when_slack_ms_lte": 0},
            "gate": {"redis": redis_url, "routes": {"chat": {"upstream": upstream, "default_deadline_ms": 30_000}}},
        },
        "test.yml",
    )


@pytest.fixture
async def upstream():
    app = web.Application()
    app.router.add_post("/v1/chat/completions", Shedding().chat)
    runner, url = await serve(app, handler_cancellation=True)
    yield url
    await runner.cleanup()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text) for x in f.samples}


async def done(redis_url: str, queue_id: str) -> Any:
    q = AdmissionQueue.from_url(redis_url)
    try:
        for _ in range(500):
            rec = await q.read(queue_id)
            if rec is not None and rec.state == "done" and rec.attempts >= 1:
                return rec
            await asyncio.sleep(0.02)
        return await q.read(queue_id)
    finally:
        await q.aclose()


async def test_an_engine_s_503_and_529_are_refusals_with_no_tokens_and_late_answers_count(upstream, redis_url):
    gate = Gate(config(upstream, redis_url))
    runner, url = await serve(gate.app(), handler_cancellation=True)
    try:
        ids: dict[str, str] = {}
        async with aiohttp.ClientSession() as s:
            for prompt in ("503", "529", "ok", "late"):
                headers = {"X-Request-Id": f"shed-{prompt}"}
                if prompt == "late":
                    headers["X-Request-Deadline-Ms"] = str(int(time.time() * 1000) + 3000)
                body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
                async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == (200 if prompt in ("ok", "late") else int(prompt)), await r.text()
                    ids[prompt] = r.headers["X-Request-Id"]
            records = {p: await done(redis_url, f"default/{i}") for p, i in ids.items()}
            async with s.get(url + "/metrics") as r:
                m = samples(await r.text())
        for code in ("503", "529"):
            rec = records[code]
            assert (rec.http_status, rec.token_units, rec.attempts) == (int(code), 0, 1), rec
            assert m[("llm_gate_upstream_refusals_total", (("code", code), ("route", "chat")))] == 1
            assert m[("llm_gate_upstream_responses_total", (("code", code), ("route", "chat")))] == 1
        assert records["ok"].token_units == records["late"].token_units == 272
        assert m[("llm_gate_token_units_total", (("route", "chat"),))] == 2 * 272  # the refusals' bodies count nothing
        assert m[("llm_gate_late_token_units_total", (("route", "chat"),))] == 272  # the late answer's, not the on-time one's
    finally:
        await runner.cleanup()


async def test_the_nginx_door_counts_an_engine_s_529_as_a_refusal(redis_url):
    doors = Doors(config("http://127.0.0.1:1", redis_url))
    try:
        status, headers, _ = await doors.auth_request("/-/auth_request/v1/chat/completions", {"X-Original-Method": "POST", "X-Request-Id": "ng-529"})
        assert status == 200
        line = json.dumps({"record": headers[RECORD_HEADER], "status": 529, "upstream_status": "529"})
        assert doors.report(f"<190>nginx: {line}".encode()) == "recorded"
        rec = await done(redis_url, "default/ng-529")
        assert (rec.http_status, rec.token_units) == (529, 0)
        m = samples(generate_latest(doors.admission.registry).decode())
        assert m[("llm_gate_upstream_refusals_total", (("code", "529"), ("route", "chat")))] == 1
        assert m[("llm_gate_upstream_refusals_total", (("code", "503"), ("route", "chat")))] == 0
    finally:
        await doors.admission.stop()


async def test_the_lua_door_records_an_engine_s_503_and_529_as_refusals_with_no_tokens(upstream, redis_url, tmp_path):
    """The same engine behind nginx's Lua door: each refusal's body reports usage, its
    record counts none; the 200's counts what its body says."""
    path = tmp_path / "gate.yml"
    path.write_text(yaml.safe_dump({"gate": {"redis": redis_url, "routes": {"chat": {"upstream": upstream, "default_deadline_ms": 30_000}}}}))
    (tmp_path / "nginx").mkdir()
    with NginxLua(tmp_path / "nginx", gate_file=path, engine_port=int(upstream.rsplit(":", 1)[1])) as nginx:
        async with aiohttp.ClientSession() as s:
            for prompt in ("503", "529", "ok"):
                body = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
                async with s.post(nginx.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": f"lua-{prompt}"}) as r:
                    assert r.status == (200 if prompt == "ok" else int(prompt)), await r.text()
        records = {p: await done(redis_url, f"default/lua-{p}") for p in ("503", "529", "ok")}
    for code in ("503", "529"):
        assert (records[code].http_status, records[code].token_units, records[code].attempts) == (int(code), 0, 1), records[code]
    assert (records["ok"].http_status, records["ok"].token_units) == (200, 272), records["ok"]
