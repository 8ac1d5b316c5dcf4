"""The rules and the Alertmanager config in a real stack on loopback.

Prometheus and Alertmanager from Debian's packages (tests/stack.py), fake targets that
serve exporter-style and vLLM-style text we control, and a webhook sink in place of the
pager, the ticket queue and the restart authority. The rules are a test copy made by
rules/generate.py with windows and for: clauses of seconds, so a run takes seconds.
"""

from __future__ import annotations

import itertools

from tests.fixtures.paths import REAL_LLAMACPP, REAL_METRICS, RULES
from tests.fixtures.stack import render_rules, rewrite_alertmanager_config, wait_until
from tests.fixtures.vllm_payload import vllm_text

# Short windows for a 1s scrape and evaluation interval; the order of the for: clauses
# (inhibiting alerts never slower than their targets) is kept.
FAST = {
    "scrape_intervals.vllm": "1s",
    "scrape_intervals.llamacpp": "1s",
    "scrape_intervals.exporter": "1s",
    "vllm.rate_window": "10s",
    "vllm.progress_window": "6s",
    "vllm.hung_for": "3s",
    "vllm.down_for": "5s",
    "vllm.host_down_for": "5s",
    "llamacpp.rate_window": "10s",
    "llamacpp.progress_window": "6s",
    "llamacpp.down_for": "5s",
    "exporter.backend_hung_for": "2s",
    "exporter.backend_down_for": "5s",
    "exporter.backends_all_down_for": "5s",
    "exporter.probe_window": "10s",
    "exporter.probe_failing_for": "2s",
    "exporter.probe_slow_for": "2s",
    "exporter.queue_past_deadline_for": "2s",
    "exporter.retries_after_deadline_for": "2s",
    "exporter.token_duplication_for": "2s",
    "exporter.lease_expiry_window": "10s",
    "exporter.lease_drift_for": "2s",
    "exporter.pool_exhausted_for": "2s",
    "exporter.exporter_down_for": "5s",
    "exporter.round_errors_window": "10s",
    "exporter.round_errors_for": "2s",
    "exporter.redis_down_for": "5s",
    "exporter.restart_loop_window": "1m",
}


def exporter_text(backends: dict[str, str], probe_seconds: dict[str, float]) -> str:
    """What llm-health serve exports for these backend states (docs/architecture.md)."""
    lines = ["# TYPE llm_backend_up gauge"]
    lines += [f'llm_backend_up{{backend="{b}"}} 1' for b in backends]
    lines.append("# TYPE llm_backend_state gauge")
    for backend, state in backends.items():
        for s in ("idle", "busy", "hung", "down"):
            lines.append(f'llm_backend_state{{backend="{backend}",state="{s}"}} {int(s == state)}')
    lines.append("# TYPE llm_backend_probe_duration_seconds gauge")
    lines += [f'llm_backend_probe_duration_seconds{{backend="{b}"}} {v}' for b, v in probe_seconds.items()]
    lines += ["# TYPE llm_redis_up gauge", "llm_redis_up 1", "# TYPE llm_exporter_build_info gauge", 'llm_exporter_build_info{version="test"} 1']
    return "\n".join(lines) + "\n"


def progressing_vllm():
    """Saturated and progressing: every scrape sees new steps, tokens and KV usage."""
    scrape = itertools.count(1)

    def payload() -> str:
        n = next(scrape)
        return vllm_text(running=12, waiting=3, steps=40 * n, tokens=126 * n, kv=0.5 + (n % 40) / 100)

    return payload


def firing(prom) -> dict[tuple[str, str], dict]:
    out = {}
    for alert in prom.alerts():
        if alert["state"] == "firing":
            labels = alert["labels"]
            out[(labels["alertname"], labels.get("backend") or labels.get("instance") or labels.get("host", ""))] = alert
    return out


def test_hung_backend_pages_and_reaches_restarter_busy_one_stays_quiet(tmp_path, prometheus_factory, alertmanager_factory, sink, target_factory):
    rule_files = render_rules(tmp_path / "rules", FAST)
    token = tmp_path / "restarter-token"
    token.write_text("stack-test-token\n")
    am = alertmanager_factory(rewrite_alertmanager_config((RULES / "alertmanager.example.yml").read_text(), sink.url, token))

    # Backend a is hung (the SIGSTOP picture: every value frozen, 4 running); b is busy.
    hung_vllm = target_factory({"/metrics": vllm_text(running=4, waiting=0, steps=8123, tokens=30100, kv=0.31)})
    busy_vllm = target_factory({"/metrics": progressing_vllm()})
    exporter = target_factory({"/metrics": exporter_text({"a": "hung", "b": "busy"}, {"a": 0.2, "b": 30.0})})
    prom = prometheus_factory({"vllm": [hung_vllm.address, busy_vllm.address], "llm-health": [exporter.address]}, rule_files, alertmanagers=[am.url])

    def delivered_to_restarter():
        names = {(a["labels"]["alertname"], a["labels"].get("backend") or a["labels"].get("instance")) for a in sink.alerts("/restarter")}
        return names >= {("LLMBackendHung", "a"), ("VLLMEngineHung", hung_vllm.address)} and names

    names = wait_until(delivered_to_restarter, timeout=90, interval=0.5, what="hung alerts at the restarter")
    assert names == {("LLMBackendHung", "a"), ("VLLMEngineHung", hung_vllm.address)}
    call = next(c for c in sink.received if c["path"] == "/restarter")
    assert call["headers"].get("Authorization") == "Bearer stack-test-token"
    paged = {a["labels"]["alertname"] for a in sink.alerts("/pager")}
    assert {"LLMBackendHung", "VLLMEngineHung"} <= paged

    # The busy, progressing backend raises nothing but the info alert that mutes its
    # probe alert; the probe alert is inhibited in Alertmanager, not delivered.
    now_firing = firing(prom)
    about_b = {k[0] for k in now_firing if k[1] in ("b", busy_vllm.address)}
    assert about_b == {"LLMBackendBusy", "LLMBackendProbeSlow"}, now_firing.keys()
    assert now_firing[("LLMBackendBusy", "b")]["labels"]["severity"] == "info"

    def probe_inhibited():
        for alert in am.alerts(inhibited=True):
            labels = alert["labels"]
            if labels["alertname"] == "LLMBackendProbeSlow" and labels.get("backend") == "b":
                return alert["status"]["inhibitedBy"]
        return None

    assert wait_until(probe_inhibited, timeout=30, what="LLMBackendProbeSlow inhibited")
    shown = {(a["labels"]["alertname"], a["labels"].get("backend")) for a in am.alerts(inhibited=False)}
    assert ("LLMBackendProbeSlow", "b") not in shown and ("LLMBackendHung", "a") in shown
    delivered = [a["labels"] for a in sink.alerts()]
    assert not [d for d in delivered if d.get("backend") == "b" or d.get("instance") == busy_vllm.address], delivered

    # The recording rules see the busy engine stepping and the hung one standing still.
    steps = {r["metric"]["instance"]: float(r["value"][1]) for r in prom.query("engine:vllm_steps:rate10s")}
    assert steps[busy_vllm.address] > 0 and steps[hung_vllm.address] == 0
    progress = {r["metric"]["instance"]: float(r["value"][1]) for r in prom.query("engine:vllm_progress_signals:moved6s")}
    assert progress[busy_vllm.address] > 0 and progress[hung_vllm.address] == 0

    # Every rule evaluated without error against these payloads.
    for group in prom.rules():
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


def test_committed_rules_evaluate_cleanly_on_real_payloads(tmp_path, prometheus_factory, target_factory):
    """The shipped rule files, unchanged, on the real vLLM payloads: no evaluation error
    (e.g. duplicate label sets), and the idle engines raise nothing."""
    payloads = sorted(REAL_METRICS.glob("vllm-v*.prom"))
    assert payloads, f"no payloads in {REAL_METRICS}"
    targets = [target_factory({"/metrics": p.read_text()}) for p in payloads if "PARTIAL" not in p.name]
    exporter = target_factory({"/metrics": exporter_text({"gpu0": "idle"}, {"gpu0": 0.05})})
    prom = prometheus_factory({"vllm": [t.address for t in targets], "llm-health": [exporter.address]}, sorted(RULES.glob("*.rules.yml")))

    def evaluated():
        groups = prom.rules()
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("2") and not r["lastEvaluation"].startswith("0001") for r in rules) else None

    wait_until(lambda: all(t["health"] == "up" for t in prom.targets()) and len(prom.targets()) == len(targets) + 1, timeout=30, what="every target scraped")
    rules = wait_until(evaluated, timeout=30, what="every rule evaluated")
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    running = wait_until(
        lambda: len(r := prom.query("engine:vllm_requests_running:sum")) == len(targets) and r, timeout=30, what="recording rules for every engine"
    )
    assert all(float(r["value"][1]) == 0 for r in running)
    assert [a for a in prom.alerts() if a["labels"]["alertname"].startswith("VLLMEngine")] == []


def test_llamacpp_rules_on_live_payloads(tmp_path, prometheus_factory, target_factory):
    """The llama.cpp rules in a real Prometheus, on what a live llama-server answered: the
    frozen-in-decode snapshot is hung; the same server busy (n_decode_total moving at the
    pace between busy.prom and busy-1s-later.prom) and idle are not. Every rule evaluates."""
    busy_text = (REAL_LLAMACPP / "busy.prom").read_text()
    scrape = itertools.count()

    def busy() -> str:
        return busy_text.replace("llamacpp:n_decode_total 179\n", f"llamacpp:n_decode_total {179 + 67 * next(scrape)}\n")

    assert busy() != busy()
    targets = {
        "frozen": target_factory({"/metrics": (REAL_LLAMACPP / "frozen-in-decode.prom").read_text()}),
        "busy": target_factory({"/metrics": busy}),
        "idle": target_factory({"/metrics": (REAL_LLAMACPP / "idle.prom").read_text()}),
    }
    prom = prometheus_factory({"llamacpp": [t.address for t in targets.values()]}, render_rules(tmp_path / "rules", FAST))
    frozen = targets["frozen"].address
    hung = wait_until(
        lambda: [a for a in prom.alerts() if a["state"] == "firing" and a["labels"]["alertname"] == "LlamaCppServerHung"], timeout=60, what="LlamaCppServerHung"
    )
    assert [a["labels"]["instance"] for a in hung] == [frozen]
    assert hung[0]["labels"]["severity"] == "critical" and hung[0]["labels"]["host"] == "127.0.0.1"
    decodes = {r["metric"]["instance"]: float(r["value"][1]) for r in prom.query("instance:llamacpp_decodes:rate10s")}
    assert decodes[targets["busy"].address] > 0 and decodes[frozen] == 0 and decodes[targets["idle"].address] == 0
    for group in prom.rules():
        for rule in group["rules"]:
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


def test_real_exporter_hung_backend_reaches_restarter(exporter_factory, tmp_path, prometheus_factory, alertmanager_factory, sink, target_factory):
    """The same fixtures with the real exporter (`python -m llm_health serve`) between the
    fake vLLM servers and Prometheus: a frozen engine with work in flight is reported hung
    by the exporter, LLMBackendHung reaches the restarter; the progressing one stays busy."""
    models = '{"object": "list", "data": [{"id": "Qwen/Qwen1.5-0.5B-Chat", "object": "model"}]}'
    frozen = target_factory({"/metrics": vllm_text(running=4, waiting=0, steps=8123, tokens=30100, kv=0.31), "/v1/models": models})
    moving = target_factory({"/metrics": progressing_vllm(), "/v1/models": models})
    config = tmp_path / "llm-health.yml"
    config.write_text(
        "global: {interval: 1s, hung_after_seconds: 3}\n"
        "backends:\n"
        f"  - {{name: frozen, url: 'http://{frozen.address}', kind: vllm}}\n"
        f"  - {{name: moving, url: 'http://{moving.address}', kind: vllm}}\n"
    )
    exporter = exporter_factory(config)
    token = tmp_path / "token"
    token.write_text("t\n")
    am = alertmanager_factory(rewrite_alertmanager_config((RULES / "alertmanager.example.yml").read_text(), sink.url, token))
    prom = prometheus_factory({"llm-health": [exporter.address]}, render_rules(tmp_path / "rules", FAST), alertmanagers=[am.url])
    wait_until(
        lambda: {a["labels"].get("backend") for a in sink.alerts("/restarter")} >= {"frozen"},
        timeout=90,
        interval=0.5,
        what="LLMBackendHung from the real exporter at the restarter",
    )
    assert {a["labels"]["alertname"] for a in sink.alerts("/restarter")} == {"LLMBackendHung"}
    states = {r["metric"]["backend"]: r["metric"]["state"] for r in prom.query("llm_backend_state == 1")}
    assert states == {"frozen": "hung", "moving": "busy"}
    assert not [a for a in sink.alerts() if a["labels"].get("backend") == "moving"]
