"""The age-first policy reading the queue where it really is, end to end on a REAL vLLM (the
shared server, `--max-num-seqs 4`, throttled as the live tests are): `llm-health serve`
derives the engine's queue age and publishes it to a real redis-server; `llm-health gate`
and nginx + `llm-health decide` (the shipped files) each have a route `chat` with a 3 s
deadline whose `backends:` name that vLLM; a real Prometheus scrapes the exporter with the
rules made for a 1 s scrape and that deadline.

A throttled burst builds a queue older than the deadline: a fresh request through either
door is refused (`reject_age_beats_slack`, 422: it cannot be served in time, so not
retryable) and never reaches vLLM (a recorder sits between the doors and vLLM), and
`LLMEngineQueueAgeOverDeadline` fires. Once the queue drains, requests through both doors
are admitted and answered again, and the alert resolves."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from typing import Any

import aiohttp
import pytest
import redis
from aiohttp import web

from llm_health.config.gate import parse_gate_config
from llm_health.gate.app import Gate
from llm_health.gate.doors import Doors
from llm_health.store.keys import QueueKeys
from tests.fixtures.exporter_status import one_backend_config
from tests.fixtures.nginx import Nginx
from tests.fixtures.stack import http_json, render_rules, wait_until
from tests.harness import vllm as harness
from tests.integration.realvllm.test_queue_age_real import PERIOD_MS, RUN_MS, burst
from tests.integration.test_door_nginx import free_udp_port
from tests.integration.test_gate import serve
from tests.integration.test_queue_age_live import RULES_FOR_1S

pytestmark = pytest.mark.realvllm

DEADLINE_MS = 3000
ALERT = "LLMEngineQueueAgeOverDeadline"


class Recorder:
    """Between the doors and vLLM: counts the prompts that reach the engine, forwards the rest."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.seen: Counter[str] = Counter()

    async def forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            self.seen[str(json.loads(body).get("prompt"))] += 1
        except ValueError:
            pass
        async with (
            aiohttp.ClientSession() as s,
            s.request(request.method, self.engine + request.raw_path, data=body, headers={"Content-Type": "application/json"}) as up,
        ):
            return web.Response(status=up.status, body=await up.read(), content_type="application/json")


async def ask(url: str, prompt: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    body = {"model": harness.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        return r.status, json.loads(await r.read()), dict(r.headers)


async def test_the_doors_refuse_on_the_engines_real_queue_and_the_alert_fires(
    exporter_factory, idle_vllm_server, own_redis_server, prometheus_factory, tmp_path
):
    srv = idle_vllm_server
    # The exporter first, up before anything else takes a port: the backend named as the
    # shipped rules' route `chat` names it.
    cfg = one_backend_config(tmp_path / "llm-health.yml", srv.url, interval="0.5s", redis_url=own_redis_server.url)
    exporter = exporter_factory(cfg)
    port = exporter.port
    key = QueueKeys().engine_age("gpu0")
    threads: list[threading.Thread] = []
    runners: list[web.AppRunner] = []
    try:
        await asyncio.to_thread(wait_until, lambda: http_json(f"http://127.0.0.1:{port}/status"), 60, 0.25, "the exporter up")
        recorder = Recorder(srv.url)
        rapp = web.Application()
        rapp.router.add_route("*", "/{tail:.*}", recorder.forward)
        rrunner, rurl = await serve(rapp)
        runners.append(rrunner)
        gate_cfg = {"gate": {"redis": own_redis_server.url, "routes": {"chat": {"upstream": rurl, "default_deadline_ms": DEADLINE_MS, "backends": ["gpu0"]}}}}
        gate = Gate(parse_gate_config(gate_cfg, "gate.yml"))
        grunner, gurl = await serve(gate.app(), handler_cancellation=True)
        runners.append(grunner)
        doors = Doors(parse_gate_config(gate_cfg, "gate.yml"))
        syslog_port = free_udp_port()
        drunner, durl = await serve(doors.app(syslog=("127.0.0.1", syslog_port)))
        runners.append(drunner)
        nginx = Nginx(tmp_path, decide_port=int(durl.rsplit(":", 1)[1]), engine_port=int(rurl.rsplit(":", 1)[1]), syslog_port=syslog_port)
        with nginx:
            prom = prometheus_factory({"llm-health": [f"127.0.0.1:{port}"]}, render_rules(tmp_path / "rules", RULES_FOR_1S))

            def age_ms() -> int | None:
                with redis.Redis.from_url(own_redis_server.url) as r:
                    value = r.get(key)
                return None if value is None else int(value)

            def firing() -> bool:
                return any(a["labels"]["alertname"] == ALERT and a["state"] == "firing" for a in prom.alerts())

            await asyncio.to_thread(wait_until, lambda: age_ms() == 0, 60, 0.25, "the idle engine's queue age in Redis, 0 and known")
            assert not firing()
            with srv.throttle(run_ms=RUN_MS, period_ms=PERIOD_MS):
                # 4 waves of 4 places, 48 tokens each: the last wave waits three waves.
                _reqs, threads = burst(srv.url, 16, 48, stagger=0.1)
                old = await asyncio.to_thread(
                    wait_until, lambda: (a := age_ms()) is not None and a >= DEADLINE_MS + 500 and a, 120, 0.1, "a queue older than the deadline"
                )
                refused = {}
                for door, url in (("gate", gurl), ("nginx", nginx.url)):
                    status, body, headers = await ask(url, f"late-{door}")
                    refused[door] = (status, body["error"]["code"], headers.get("x-should-retry"))
                    assert int(headers["x-queue-age-ms"]) >= DEADLINE_MS, (door, headers)
                print(f"engine queue age {old} ms in Redis; refused: {refused}")
                assert refused == dict.fromkeys(("gate", "nginx"), (422, "reject_age_beats_slack", "false")), refused
                assert recorder.seen["late-gate"] == 0 and recorder.seen["late-nginx"] == 0, recorder.seen
                await asyncio.to_thread(wait_until, firing, 60, 0.5, f"{ALERT} firing in Prometheus")
            # The engine at full speed again: the queue drains.
            for t in threads:
                await asyncio.to_thread(t.join, 300)
            await asyncio.to_thread(wait_until, lambda: age_ms() == 0, 120, 0.25, "the drained queue's age, 0")
            for door, url in (("gate", gurl), ("nginx", nginx.url)):
                status, body, headers = await ask(url, f"fresh-{door}")
                assert (status, headers.get("X-LLM-Health-Decision")) == (200, "admit_once"), (door, body)
                assert recorder.seen[f"fresh-{door}"] == 1, recorder.seen
            await asyncio.to_thread(wait_until, lambda: not firing(), 60, 0.5, f"{ALERT} resolved after the drain")
    finally:
        for t in threads:
            t.join(timeout=60)
        for runner in reversed(runners):
            await runner.cleanup()
