"""The queue-age alerts in a real Prometheus on loopback (tests/fixtures/stack.py): rules
made by rules/generate.py for a 1 s scrape with a 3 s deadline (the route `chat` of
rules/config.yaml, backend gpu0, and the raw layer's vllm.queue_age_deadline), targets
serving the text we control: the exporter's llm_backend_queue_age_seconds and a vLLM
payload's waiting, running and finished counts.

Unknown (the gauge absent) and young, then old, then drained: the alerts stay silent, fire,
and resolve. The real exporter publishing the gauge is the other half of issue 38; this
test reads the series as docs/architecture.md names it."""

from __future__ import annotations

import time

from tests.fixtures.stack import render_rules, wait_until
from tests.fixtures.vllm_payload import vllm_text

RULES_FOR_1S = {
    "scrape_intervals.vllm": "1s",
    "scrape_intervals.llamacpp": "1s",
    "scrape_intervals.exporter": "1s",
    "vllm.queue_age_deadline": "3s",
    "routes.chat.deadline": "3s",
}


class Queue:
    """One engine's queue as the exporter and vLLM report it, in the phase the test sets."""

    def __init__(self) -> None:
        self.phase = "unknown"
        self.old_since = 0.0
        self.finished = 100

    def exporter(self) -> str:
        lines = ["# TYPE llm_backend_up gauge", 'llm_backend_up{backend="gpu0"} 1', "# TYPE llm_backend_queue_age_seconds gauge"]
        if self.phase == "young":
            lines.append('llm_backend_queue_age_seconds{backend="gpu0"} 0.5')
        elif self.phase == "old":
            lines.append(f'llm_backend_queue_age_seconds{{backend="gpu0"}} {time.time() - self.old_since:.3f}')
        elif self.phase == "drained":
            lines.append('llm_backend_queue_age_seconds{backend="gpu0"} 0')
        return "\n".join(lines) + "\n"

    def vllm(self) -> str:
        if self.phase == "young":
            self.finished += 20  # more leave the queue at every scrape than wait in it: young, even with scrapes missed
        waiting, running = {"unknown": (0, 0), "young": (8, 4), "old": (8, 1), "drained": (0, 9)}[self.phase]  # old: nothing leaves
        return vllm_text(running=running, waiting=waiting, steps=1000, tokens=5000, kv=0.0, finished=self.finished + 7)


def queue_alerts(prom) -> dict[str, dict]:
    return {a["labels"]["alertname"]: a for a in prom.alerts() if a["state"] == "firing" and "QueueAge" in a["labels"]["alertname"]}


def test_queue_age_alerts_fire_and_resolve_in_prometheus(tmp_path, prometheus_factory, target_factory):
    rule_files = render_rules(tmp_path / "rules", RULES_FOR_1S)
    queue = Queue()
    exporter = target_factory({"/metrics": queue.exporter})
    vllm = target_factory({"/metrics": queue.vllm})
    prom = prometheus_factory({"llm-health": [exporter.address], "vllm": [vllm.address]}, rule_files)

    def evaluated(record: str, expect: bool) -> bool:
        return bool(prom.query(record)) == expect

    # Unknown: the deadline is recorded, the route has no age, nothing fires.
    wait_until(lambda: prom.query('route:llm_deadline_seconds:config{route="chat"}'), timeout=60, what="the route's deadline recorded")
    wait_until(lambda: prom.query("engine:vllm_queue_waited:count3s"), timeout=60, what="the raw layer's count recorded")
    assert evaluated("route:llm_engine_queue_age_seconds:min", False)
    assert queue_alerts(prom) == {}

    # Young: a deep queue that moves, and a known young age: still nothing.
    queue.phase = "young"
    wait_until(lambda: evaluated("route:llm_engine_queue_age_seconds:min", True), timeout=60, what="the route's age recorded")
    wait_until(lambda: evaluated("engine:vllm_queue_waited:count3s < 0", True), timeout=60, what="the young queue's departures seen")
    assert queue_alerts(prom) == {}

    # Old: both fire, with the route's backends and the deadline in the description.
    queue.old_since, queue.phase = time.time(), "old"
    fired = wait_until(lambda: len(queue_alerts(prom)) == 2 and queue_alerts(prom), timeout=60, interval=0.5, what="both queue-age alerts firing")
    route = fired["LLMEngineQueueAgeOverDeadline"]
    assert (route["labels"]["route"], route["labels"]["backends"], route["labels"]["severity"]) == ("chat", "gpu0", "critical")
    assert "deadline of 3s" in route["annotations"]["description"], route["annotations"]
    assert fired["VLLMEngineQueueAgeOverDeadline"]["labels"]["instance"] == vllm.address

    # Drained: both resolve.
    queue.phase = "drained"
    wait_until(lambda: queue_alerts(prom) == {}, timeout=60, interval=0.5, what="both queue-age alerts resolved")
    for group in prom.rules():
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
