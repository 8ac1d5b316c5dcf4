"""The whole picture on loopback: the simulated fleet, a real Redis holding leases and the
admission queue, the gate with traffic, the exporter, and a real Prometheus loading the
shipped rules. Every Grafana panel query must return data, and the raw and exporter hung
alerts must fire for the hung backend only.

Prometheus runs as a process; the fleet, the gate and the exporter run on this test's
event loop, so Prometheus is queried from a thread (never blocking the loop it scrapes).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from llm_health.config.exporter import Backend, Config, Timing
from llm_health.config.gate import parse_gate_config
from llm_health.config.redis import parse_redis_config
from llm_health.exporter.app import Exporter
from llm_health.gate.app import Gate
from llm_health.sim import servers as sim
from llm_health.store.leases import LeaseClient
from llm_health.store.queue import AdmissionQueue
from llm_health.store.records import Pool
from tests.fixtures.paths import ROOT
from tests.fixtures.stack import render_rules
from tests.integration.test_stack import FAST


async def _serve(app):
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def panel_queries() -> list[tuple[str, str, str]]:
    """The dashboards' queries, rendered from the same config overrides as the rules here."""
    overrides = [arg for key, value in FAST.items() for arg in ("--set", f"{key}={value}")]
    out = subprocess.run([sys.executable, str(ROOT / "grafana" / "generate.py"), "--queries", *overrides], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "grafana_foundation_sdk" in out.stderr:
        pytest.skip("grafana-foundation-sdk not installed (pip install -r grafana/requirements.txt)")
    assert out.returncode == 0, out.stderr
    return [(board, q["panel"], q["expr"]) for board, qs in json.loads(out.stdout).items() for q in qs]


async def test_every_panel_has_data_and_only_the_hung_backend_alerts(tmp_path, redis_url, prometheus_factory, sim_server, ticker):
    queries = panel_queries()
    # --- the fleet ------------------------------------------------------------------
    idle = await sim_server("idle", scenario="idle")
    busy = await sim_server("busy", scenario="saturated")
    hung = await sim_server("hung", scenario="hung")
    restarting = await sim_server("restarting", scenario="batch")
    ticker.extend([busy, hung, restarting])
    dead = sim.dead_url()
    broken = await sim_server("broken", scenario="idle")  # answers /metrics with an HTML error page
    broken.metrics_mode = "html"
    # The shipped rules' example route `chat` sends to `gpu0` (rules/config.yaml): an idle
    # engine, its queue age a known 0, for the engine-queue-age panel.
    gpu0 = await sim_server("gpu0", scenario="idle")

    # --- Redis: leases (drift both ways, an expiry, a release, a waiter) -----------------
    leases = LeaseClient.from_url(redis_url, fallback_interval_s=0.5)
    await leases.check_notifications()
    on_idle = await leases.claim("g0", "job-on-idle", ttl_ms=600_000)  # lease on a backend that is idle
    held = await leases.claim("g2", "job-long", ttl_ms=600_000)
    short = await leases.claim("g3", "crashed-holder", ttl_ms=1500)  # its holder "dies": it expires
    released = await leases.claim("h0", "job-done", ttl_ms=600_000)
    assert on_idle and held and short and released
    waiter = asyncio.create_task(leases.wait_for_gpu(Pool("h100", ["h0", "h1"]), "waiting-job", timeout=120))
    blocker = await leases.claim("h1", "job-h1", ttl_ms=600_000)
    assert blocker is not None

    # --- the gate, with traffic: admitted, a late retry rejected, tokens per id -----------
    async def worker(request):
        await request.read()
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 256, "completion_tokens": 16, "total_tokens": 272}})

    wapp = web.Application()
    wapp.router.add_post("/v1/completions", worker)
    wrunner, waddr = await _serve(wapp)
    gate = Gate(parse_gate_config({"gate": {"redis": redis_url, "routes": {"chat": {"upstream": f"http://{waddr}", "default_deadline_ms": 30000}}}}, "<test>"))
    grunner, gaddr = await _serve(gate.app())

    # --- the exporter, with its Redis view --------------------------------------------
    timing = Timing(interval=1.0, hung_after_seconds=2.0, probe_interval=60, probe_timeout=1.0, metrics_timeout=2.0, models_timeout=2.0)
    backends = [Backend(n, s.url, "vllm", timing) for n, s in (("idle", idle), ("busy", busy), ("hung", hung), ("restarting", restarting))]
    backends.append(Backend("dead", dead, "vllm", timing))
    backends.append(Backend("broken", broken.url, "vllm", timing))  # round errors: /metrics unusable
    backends.append(Backend("gpu0", gpu0.url, "vllm", timing))
    redis_cfg = {
        "url": redis_url,
        "pools": [
            {"name": "a100", "gpus": ["g0", "g1", "g2", "g3"], "backends": {"g0": "idle", "g1": "busy"}},
            {"name": "h100", "gpus": ["h0", "h1"]},
        ],
        "routes": ["chat"],
    }
    exporter = Exporter(Config(timing=timing, backends=tuple(backends), redis=parse_redis_config(redis_cfg, "<test>"), source="<test>"))
    erunner, eaddr = await _serve(exporter.app())

    prom = prometheus_factory(
        {"llm-health": [eaddr], "llm-health-gate": [gaddr], "vllm": [s.url.removeprefix("http://") for s in (idle, busy, hung, restarting)]},
        render_rules(tmp_path / "rules", FAST),
    )

    async def query(expr):
        return await asyncio.to_thread(prom.query, expr)

    try:
        async with aiohttp.ClientSession() as http:

            async def send(rid, headers=None):
                async with http.post(f"http://{gaddr}/v1/completions", json={"model": "m"}, headers={"X-Request-Id": rid, **(headers or {})}) as r:
                    return r.status

            assert await send("ok-1") == 200
            assert await send("late-1", {"X-Request-Timeout-Ms": "200"}) == 200
            await asyncio.sleep(0.3)
            assert await send("late-1", {"X-Request-Timeout-Ms": "200", "X-Retry-Count": "1"}) == 422
        queue = AdmissionQueue.from_url(redis_url)
        now = int(time.time() * 1000)
        await queue.enqueue("stuck-1", "chat", "acme", deadline_ms=now - 1000, enqueued_ms=now - 40000)  # 40 s old, past its deadline
        await queue.enqueue("stuck-1", "chat", "acme", deadline_ms=now - 1000)  # resent: a queued retry
        await queue.enqueue("dup-1", "chat", "acme", deadline_ms=now + 600000)
        for _ in range(4):  # one id, four attempts' tokens: duplicated
            await queue.record_attempt("dup-1", token_units=272, http_status=503)
        await queue.aclose()
        await leases.release(released)  # a `del` release (h0 is then taken by the waiter)

        restarted_at = time.monotonic()
        deadline = time.monotonic() + 90
        empty = queries
        while time.monotonic() < deadline:
            if restarting.running and time.monotonic() - restarted_at > 8:
                restarting.restart()
                sim.batch_job(restarting)
                restarted_at = time.monotonic()
            empty = [(b, p, e) for b, p, e in queries if not await query(e)]
            if not empty:
                break
            await asyncio.sleep(1.0)
        assert not empty, "panels without data:\n" + "\n".join(f"  {b} / {p}: {e}" for b, p, e in empty)

        # the alerts: hung only for the hung backend, from both layers
        def firing():
            alerts = prom.alerts()
            return {(a["labels"]["alertname"], a["labels"].get("backend") or a["labels"].get("instance")) for a in alerts if a["state"] == "firing"}

        deadline = time.monotonic() + 60
        fired = set()
        while time.monotonic() < deadline:
            fired = await asyncio.to_thread(firing)
            if ("LLMBackendHung", "hung") in fired and ("VLLMEngineHung", hung.url.removeprefix("http://")) in fired:
                break
            await asyncio.sleep(1.0)
        assert ("LLMBackendHung", "hung") in fired and ("VLLMEngineHung", hung.url.removeprefix("http://")) in fired, fired
        hung_alerts = {x for x in fired if x[0] in ("LLMBackendHung", "VLLMEngineHung")}
        assert hung_alerts == {("LLMBackendHung", "hung"), ("VLLMEngineHung", hung.url.removeprefix("http://"))}
        states = {r["metric"]["backend"]: r["metric"]["state"] for r in await query("llm_backend_state == 1")}
        assert states["busy"] == "busy" and states["idle"] == "idle" and states["dead"] == "down" and states["broken"] == "no_metrics"
        drift = {r["metric"]["kind"]: float(r["value"][1]) for r in await query('llm_gpu_lease_drift{pool="a100"}')}
        assert drift == {"lease_on_idle_backend": 1.0, "busy_without_lease": 1.0}
        assert busy.received == [] and hung.received == []
        # the exporter's output, Redis view included, and the gate's pass promtool's lint
        async with aiohttp.ClientSession() as http:
            for addr, must in ((eaddr, "llm_gpu_lease_drift"), (gaddr, "llm_gate_decisions_total")):
                text = await (await http.get(f"http://{addr}/metrics")).text()
                assert must in text
                lint = await asyncio.to_thread(subprocess.run, ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
                assert lint.returncode == 0, (addr, lint.stdout.decode() + lint.stderr.decode())
    finally:
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await leases.aclose()
        for r in (erunner, grunner, wrunner):
            await r.cleanup()
