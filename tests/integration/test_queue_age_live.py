"""The real exporter (`python -m llm_health serve`) between a vLLM-style target whose counters
behave as a first-come-first-served vLLM's (waiting + running + request_success_total
constant while nothing arrives; a request taken in moves waiting -> running, one done
running -> success) and a real Prometheus with the rules made for a 1 s scrape and a 3 s
deadline (route chat -> gpu0): idle, then a burst that waits (nothing leaves the queue
while one request runs and keeps stepping, so the engine is busy, not hung): the exporter's
figure grows past 3 s and LLMEngineQueueAgeOverDeadline fires; the queue drains: it
resolves."""

from __future__ import annotations

from tests.fixtures.stack import render_rules, wait_until
from tests.fixtures.vllm_payload import vllm_text

RULES_FOR_1S = {
    "scrape_intervals.vllm": "1s",
    "scrape_intervals.llamacpp": "1s",
    "scrape_intervals.exporter": "1s",
    "vllm.queue_age_deadline": "3s",
    "routes.chat.deadline": "3s",
    # The exporter layer's groups evaluated every second too (5 s as shipped): a real
    # engine's queue stays older than 3 s for a few seconds only, and a 5 s evaluation can
    # fall on either side of that (a real-vLLM CI run missed the alert so).
    "exporter.backends_eval_interval": "1s",
}
MODELS = '{"object": "list", "data": [{"id": "Qwen/Qwen1.5-0.5B-Chat", "object": "model"}]}'


class Engine:
    def __init__(self) -> None:
        self.phase = "idle"
        self.steps = 1000

    def metrics(self) -> str:
        self.steps += 7  # one request running keeps stepping: busy, never hung
        waiting, running, success = {"idle": (0, 0, 10), "burst": (6, 1, 10), "drained": (0, 0, 17)}[self.phase]
        if self.phase == "idle":
            self.steps -= 7
        kv = 0.1 + (self.steps % 50) / 100 if running else 0
        return vllm_text(running=running, waiting=waiting, steps=self.steps, tokens=self.steps * 3, kv=kv, finished=success)


def test_exporter_queue_age_alert_fires_and_resolves_in_prometheus(exporter_factory, tmp_path, prometheus_factory, target_factory):
    engine = Engine()
    vllm = target_factory({"/metrics": engine.metrics, "/v1/models": MODELS})
    config = tmp_path / "llm-health.yml"
    config.write_text(f"global: {{interval: 1s, hung_after_seconds: 30}}\nbackends:\n  - {{name: gpu0, url: 'http://{vllm.address}', kind: vllm}}\n")
    exporter = exporter_factory(config)
    prom = prometheus_factory({"llm-health": [exporter.address]}, render_rules(tmp_path / "rules", RULES_FOR_1S))

    def route_alert() -> dict | None:
        return next((a for a in prom.alerts() if a["labels"]["alertname"] == "LLMEngineQueueAgeOverDeadline" and a["state"] == "firing"), None)

    # Idle, the exporter's 1-token probe meets this target's 404 (it serves GETs only):
    # the state is not read here, only that the exporter watches gpu0.
    wait_until(lambda: prom.query('llm_backend_up{backend="gpu0"} == 1'), timeout=60, what="gpu0 watched, in Prometheus")
    assert route_alert() is None
    engine.phase = "burst"
    wait_until(lambda: prom.query('llm_backend_queue_age_seconds{backend="gpu0"}'), timeout=60, what="the exporter's queue age of gpu0")
    alert = wait_until(route_alert, timeout=60, interval=0.5, what="LLMEngineQueueAgeOverDeadline firing on the exporter's figure")
    assert (alert["labels"]["route"], alert["labels"]["backends"]) == ("chat", "gpu0"), alert["labels"]
    states = {r["metric"]["state"] for r in prom.query('llm_backend_state{backend="gpu0"} == 1')}
    assert states == {"busy"}, states  # a queue that does not move behind a running request is busy, not hung
    engine.phase = "drained"
    wait_until(lambda: route_alert() is None, timeout=60, interval=0.5, what="LLMEngineQueueAgeOverDeadline resolved after the drain")
