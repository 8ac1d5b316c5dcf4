"""The exporter's `/-/live?backend=NAME` (a kubelet's livenessProbe) and
`/-/ready?backend=NAME` (its readinessProbe, a load balancer's health check) against a
REAL vLLM: both 200 while the server is busy (throttled, requests in flight), both 503
once the exporter has proved it hung (EngineCore stopped with requests in flight), while
vLLM's own `/health` still answers 200; and never a request sent to vLLM because of the
calls: a recording proxy in front of vLLM counts what the exporter sends, and a burst of
calls adds nothing beyond the exporter's own rounds.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import yaml

from tests.fixtures.stack import wait_until
from tests.harness import vllm as harness

pytestmark = pytest.mark.realvllm

INTERVAL = 1.0


def live(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_live_endpoint_on_a_real_vllm(exporter_factory, idle_vllm_server, tmp_path):
    srv = idle_vllm_server
    cfg = tmp_path / "llm-health.yml"
    with harness.LeastConnProxy([srv.url]) as proxy:
        cfg.write_text(yaml.safe_dump({"global": {"interval": f"{INTERVAL}s", "hung_after_seconds": 3}, "backends": [{"name": "cpu0", "url": proxy.url}]}))
        base = exporter_factory(cfg).url
        url = base + "/-/live?backend=cpu0"
        ready = base + "/-/ready?backend=cpu0"
        load = None
        try:
            wait_until(lambda: live(base + "/-/healthy") == 200, timeout=60, what="the exporter")

            def state() -> str:
                with urllib.request.urlopen(base + "/status", timeout=5) as resp:
                    return json.loads(resp.read())["backends"][0]["state"]

            wait_until(lambda: state() == "idle", timeout=60, what="idle")
            assert live(url) == 200 and live(base + "/-/live?backend=nope") == 404
            assert live(ready) == 200 and live(base + "/-/ready?backend=nope") == 404

            # Busy: throttled engine, four requests in flight.
            with srv.throttle(run_ms=20, period_ms=500) as throttle:
                load = srv.load(4, 1000, "Hello")
                srv.wait_for(lambda c: c["num_requests_running"] == 4 and (c["generation_tokens_total"] or 0) > 0, timeout=120)
                wait_until(lambda: state() == "busy", timeout=60, what="busy")
                posts = proxy.count("POST")  # the probes of the idle engine, before the load
                busy = [live(u) for _ in range(20) for u in (url, ready)]
                assert busy == [200] * 40
                assert proxy.count("POST") == posts  # nothing is sent to an engine with work in flight
                throttle.freeze()  # then stop it where it is, mid-batch
            srv.cont_engine("worker")

            wait_until(lambda: state() == "hung", timeout=120, what="hung")
            reads = proxy.count("GET", "/metrics")
            started = time.monotonic()
            hung = [live(u) for _ in range(50) for u in (url, ready)]
            elapsed = time.monotonic() - started
            assert hung == [503] * 100
            assert live(srv.url + "/health") == 200  # vLLM's own health check sees nothing wrong
            # Answered from memory: 100 calls cost no read beyond the exporter's rounds.
            assert proxy.count("GET", "/metrics") - reads <= elapsed / INTERVAL + 2
            assert proxy.count("POST") == posts
            srv.cont_engine("both")
            wait_until(lambda: live(url) == 200 and live(ready) == 200, timeout=120, what="200 again once the engine moves")
        finally:
            srv.cont_engine("both")
            if load is not None:
                load.wait(180)
