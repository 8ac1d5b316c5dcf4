"""The Alertmanager configuration: valid, routes by severity, sends only the hung alerts
to the restart authority, and inhibits in an order Prometheus can deliver."""

from __future__ import annotations

import re
import time

import pytest
import yaml

from llm_health.core.webhook import MAX_ALERTS
from tests.fixtures.paths import ROOT, RULES
from tests.fixtures.stack import AMTOOL, rewrite_alertmanager_config, run_tool, wait_until

EXAMPLE = RULES / "alertmanager.example.yml"
COMPOSE = ROOT / "compose" / "alertmanager.yml"
CONFIGS = [EXAMPLE, COMPOSE]
RESTARTER_ALERTS = {"LLMBackendHung", "VLLMEngineHung"}
SEVERITY_RECEIVER = {"critical": "pager", "warning": "ticket", "info": "blackhole"}

needs_amtool = pytest.mark.skipif(not AMTOOL, reason="amtool is not installed (apt-get install prometheus-alertmanager)")


def rule_alerts() -> dict[str, dict]:
    out = {}
    for path in sorted(RULES.glob("*.rules.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    out[rule["alert"]] = rule
    return out


def seconds(duration: str | None) -> float:
    if not duration:
        return 0.0
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    total = 0.0
    for value, unit in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration):
        total += int(value) * units[unit]
    return total


_MATCHER = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"(.*)"\s*$')


def matches(matchers: list[str], labels: dict) -> bool:
    """Alertmanager matcher semantics (anchored regexes; a missing label is "")."""
    for matcher in matchers:
        m = _MATCHER.match(matcher)
        assert m, f"cannot parse matcher {matcher!r}"
        name, op, value = m.groups()
        have = labels.get(name, "")
        ok = {"=": have == value, "!=": have != value, "=~": re.fullmatch(value, have) is not None, "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def static_labels(name: str, rule: dict) -> dict:
    return {"alertname": name, **rule.get("labels", {})}


@needs_amtool
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_amtool_check_config(path):
    result = run_tool(AMTOOL, "check-config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_and_example_are_the_same_config():
    assert yaml.safe_load(EXAMPLE.read_text()) == yaml.safe_load(COMPOSE.read_text())


@needs_amtool
@pytest.mark.parametrize("name", sorted(rule_alerts()))
def test_every_alert_routes_by_severity(name):
    rule = rule_alerts()[name]
    severity = rule["labels"]["severity"]
    expected = [SEVERITY_RECEIVER[severity]]
    if name in RESTARTER_ALERTS:
        expected.insert(0, "restarter")
    labels = [f"{k}={v}" for k, v in static_labels(name, rule).items()] + ["backend=gpu0", "instance=h:9118"]
    result = run_tool(AMTOOL, "config", "routes", "test", f"--config.file={EXAMPLE}", f"--verify.receivers={','.join(expected)}", *labels)
    assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"


def test_only_the_hung_alerts_reach_the_restarter():
    config = yaml.safe_load(EXAMPLE.read_text())
    routes = [r for r in config["route"]["routes"] if r["receiver"] == "restarter"]
    assert len(routes) == 1 and routes[0].get("continue") is True, "the restarter route must let pages through"
    reaching = {name for name, rule in rule_alerts().items() if matches(routes[0]["matchers"], static_labels(name, rule))}
    assert reaching == RESTARTER_ALERTS


def test_restarter_receiver_is_authenticated_and_points_at_compose_service():
    receivers = {r["name"]: r for r in yaml.safe_load(COMPOSE.read_text())["receivers"]}
    (hook,) = receivers["restarter"]["webhook_configs"]
    assert hook["url"] == "http://restarter:9120/alerts"
    auth = hook["http_config"]["authorization"]
    assert auth["credentials_file"].startswith("/") and "credentials" not in auth
    assert hook.get("send_resolved") is False  # a resolved hang needs no restart


def test_every_webhook_bounds_its_notifications_at_what_the_restarter_reads():
    """max_alerts on every webhook (Alertmanager's default, 0, sends a group whole), never
    above the alerts the restarter reads of one notification; and the restarter's route
    makes each notification one alert (grouped by every label), so the bound cannot cut
    a hang off there."""
    config = yaml.safe_load(EXAMPLE.read_text())
    hooks = {r["name"]: r["webhook_configs"] for r in config["receivers"] if "webhook_configs" in r}
    assert set(hooks) == {"pager", "ticket", "restarter"}
    assert all(0 < h.get("max_alerts", 0) <= MAX_ALERTS for hs in hooks.values() for h in hs), hooks
    (route,) = [r for r in config["route"]["routes"] if r["receiver"] == "restarter"]
    assert route["group_by"] == ["..."]


def test_inhibit_rules_match_real_alerts_and_source_fires_first():
    """Prometheus sends only firing alerts: an inhibiting alert with a longer for: than
    its target would start muting only after the target had already been sent."""
    config = yaml.safe_load(EXAMPLE.read_text())
    alerts = rule_alerts()
    assert config["inhibit_rules"]
    for inhibit in config["inhibit_rules"]:
        sources = [n for n, r in alerts.items() if matches(inhibit["source_matchers"], static_labels(n, r))]
        targets = [n for n, r in alerts.items() if matches(inhibit["target_matchers"], static_labels(n, r))]
        assert sources and targets, f"inhibit rule matches no alert: {inhibit}"
        assert not set(sources) & set(targets), inhibit
        assert inhibit.get("equal"), f"inhibit rule without equal: would mute every backend: {inhibit}"
        for s in sources:
            for t in targets:
                assert seconds(alerts[s].get("for")) <= seconds(alerts[t].get("for")), (
                    f"{s} (for {alerts[s].get('for', '0s')}) inhibits {t} (for {alerts[t].get('for', '0s')})"
                )


def test_the_three_inhibitions_the_issue_asks_for():
    config = yaml.safe_load(EXAMPLE.read_text())
    pairs = set()
    alerts = rule_alerts()
    for inhibit in config["inhibit_rules"]:
        for s, sr in alerts.items():
            for t, tr in alerts.items():
                if matches(inhibit["source_matchers"], static_labels(s, sr)) and matches(inhibit["target_matchers"], static_labels(t, tr)):
                    pairs.add((s, t))
    # busy and healthy mutes probe alerts, and users' latency alerts by name
    assert ("LLMBackendBusy", "LLMBackendProbeSlow") in pairs and ("LLMBackendBusy", "LLMBackendProbeFailing") in pairs
    busy = next(i for i in config["inhibit_rules"] if "LLMBackendBusy" in str(i["source_matchers"]))
    assert matches(busy["target_matchers"], {"alertname": "ChatLatencyHigh"})
    assert not matches(busy["target_matchers"], {"alertname": "LLMBackendHung"})
    # a GPU that reports a fault keeps the restarter off the backend; its own page is not muted
    assert ("LLMBackendGPUFault", "LLMBackendHung") in pairs
    # and the raw layer's hang on that GPU, which the restarter would otherwise act on
    # itself once the LLMBackendHung it holds the raw alert for never comes
    assert ("VLLMGPUFault", "VLLMEngineHung") in pairs
    assert {p for p in pairs if p[1] in ("LLMBackendHung", "VLLMEngineHung")} == {
        ("LLMBackendGPUFault", "LLMBackendHung"),
        ("VLLMGPUFault", "VLLMEngineHung"),
    }
    assert not {p for p in pairs if p[1] in ("LLMBackendHungGPUFault", "VLLMEngineHungGPUFault")}
    # the whole host down mutes per-backend alerts
    assert ("VLLMHostDown", "VLLMEngineDown") in pairs
    # (an exporter that sees every backend down is left out of LLMBackendDown in the rules:
    # rules/tests/llm-health.test.yml; no inhibition can match it once replicas are aggregated)
    assert not {p for p in pairs if p[0] == "LLMBackendsAllDown"}
    # A hung alert needs a target that answers, so it never fires beside these: muting it
    # would only ever be a risk (an inhibition that outlived a host's recovery).
    assert ("VLLMHostDown", "VLLMEngineHung") not in pairs and ("LLMBackendsAllDown", "LLMBackendHung") not in pairs
    # A llama-server whose loop is stuck outside a decode fails its scrapes: LlamaCppServerDown
    # is then a hang, and VLLMHostDown (which counts vLLM targets only) must not mute it.
    assert not {p for p in pairs if p[1].startswith("LlamaCpp")}


# --- the shipped config in a real Alertmanager -----------------------------------------


def test_live_inhibition_and_delivery(alertmanager_factory, sink, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    am = alertmanager_factory(rewrite_alertmanager_config(EXAMPLE.read_text(), sink.url, token))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    am.post_alerts(
        [
            {"labels": {"alertname": "LLMBackendBusy", "severity": "info", "backend": "gpu0", "job": "llm-health", "instance": "e:9118"}, "startsAt": now},
            {
                "labels": {"alertname": "LLMBackendProbeSlow", "severity": "warning", "backend": "gpu0", "job": "llm-health", "instance": "e:9118"},
                "startsAt": now,
            },
            {
                "labels": {"alertname": "LLMBackendProbeSlow", "severity": "warning", "backend": "gpu1", "job": "llm-health", "instance": "e:9118"},
                "startsAt": now,
            },
            {"labels": {"alertname": "VLLMHostDown", "severity": "critical", "host": "gpu-a"}, "startsAt": now},
            {"labels": {"alertname": "VLLMEngineDown", "severity": "critical", "host": "gpu-a", "instance": "gpu-a:8000", "job": "vllm"}, "startsAt": now},
            {
                "labels": {
                    "alertname": "LLMBackendHung",
                    "severity": "critical",
                    "backend": "gpu2",
                    "state": "hung",
                    "job": "llm-health",
                    "instance": "e:9118",
                },
                "startsAt": now,
            },
        ]
    )

    def inhibited_state():
        state = {}
        for alert in am.alerts(inhibited=True):
            key = (alert["labels"]["alertname"], alert["labels"].get("backend") or alert["labels"].get("host"))
            state[key] = bool(alert["status"]["inhibitedBy"])
        return state if len(state) == 6 and state[("LLMBackendProbeSlow", "gpu0")] and state[("VLLMEngineDown", "gpu-a")] else None

    state = wait_until(inhibited_state, timeout=30, what="inhibition in Alertmanager")
    assert state[("LLMBackendProbeSlow", "gpu1")] is False  # gpu1 is not busy
    assert state[("LLMBackendHung", "gpu2")] is False
    shown = {(a["labels"]["alertname"], a["labels"].get("backend")) for a in am.alerts(inhibited=False)}
    assert ("LLMBackendProbeSlow", "gpu0") not in shown and ("VLLMEngineDown", None) not in shown
    assert ("LLMBackendProbeSlow", "gpu1") in shown

    wait_until(lambda: sink.alerts("/restarter") and sink.alerts("/ticket") and sink.alerts("/pager"), timeout=30, what="deliveries to the sink")
    restarted = sink.alerts("/restarter")
    assert {a["labels"]["alertname"] for a in restarted} == {"LLMBackendHung"}
    call = next(c for c in sink.received if c["path"] == "/restarter")
    assert call["headers"].get("Authorization") == "Bearer s3cret"
    assert call["body"]["version"] == "4"
    ticketed = {(a["labels"]["alertname"], a["labels"].get("backend")) for a in sink.alerts("/ticket")}
    assert ("LLMBackendProbeSlow", "gpu1") in ticketed and ("LLMBackendProbeSlow", "gpu0") not in ticketed
    paged = {a["labels"]["alertname"] for a in sink.alerts("/pager")}
    assert "VLLMEngineDown" not in paged and "LLMBackendBusy" not in paged


def test_live_gpu_fault_keeps_the_restarter_off(alertmanager_factory, sink, tmp_path):
    """LLMBackendGPUFault (info) mutes LLMBackendHung of its backend only: the restarter gets
    the other backend's hang, the pager the GPU-fault hang (docs/runbook.md, LLMBackendHungGPUFault)."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    am = alertmanager_factory(rewrite_alertmanager_config(EXAMPLE.read_text(), sink.url, token))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    exporter = {"job": "llm-health", "instance": "e:9118"}
    am.post_alerts(
        [
            {"labels": {"alertname": "LLMBackendGPUFault", "severity": "info", "backend": "gpu3", **exporter}, "startsAt": now},
            {"labels": {"alertname": "LLMBackendHung", "severity": "critical", "backend": "gpu3", "state": "hung", **exporter}, "startsAt": now},
            {"labels": {"alertname": "LLMBackendHung", "severity": "critical", "backend": "gpu4", "state": "hung", **exporter}, "startsAt": now},
            {
                "labels": {"alertname": "LLMBackendHungGPUFault", "severity": "critical", "backend": "gpu3", "state": "hung", "cause": "gpu_fault", **exporter},
                "startsAt": now,
            },
        ]
    )

    def inhibited_state():
        state = {(a["labels"]["alertname"], a["labels"]["backend"]): bool(a["status"]["inhibitedBy"]) for a in am.alerts(inhibited=True)}
        return state if len(state) == 4 and state[("LLMBackendHung", "gpu3")] else None

    state = wait_until(inhibited_state, timeout=30, what="inhibition in Alertmanager")
    assert not state[("LLMBackendHung", "gpu4")] and not state[("LLMBackendHungGPUFault", "gpu3")]
    wait_until(lambda: sink.alerts("/restarter") and sink.alerts("/pager"), timeout=30, what="deliveries to the sink")
    time.sleep(1.0)
    assert {(a["labels"]["alertname"], a["labels"]["backend"]) for a in sink.alerts("/restarter")} == {("LLMBackendHung", "gpu4")}
    paged = {(a["labels"]["alertname"], a["labels"]["backend"]) for a in sink.alerts("/pager")}
    assert ("LLMBackendHungGPUFault", "gpu3") in paged and ("LLMBackendHung", "gpu3") not in paged


def test_live_gpu_fault_keeps_the_restarter_off_the_raw_layer(alertmanager_factory, sink, tmp_path):
    """VLLMGPUFault (info) mutes VLLMEngineHung of its vLLM target only (equal job, instance):
    the restarter gets the other target's raw hang, the pager VLLMEngineHungGPUFault
    (docs/runbook.md, VLLMGPUFault)."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    am = alertmanager_factory(rewrite_alertmanager_config(EXAMPLE.read_text(), sink.url, token))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    faulted = {"job": "vllm", "instance": "10.2.1.5:8000", "host": "10.2.1.5", "model_name": "m", "engine": "0"}
    healthy = {"job": "vllm", "instance": "10.2.1.6:8000", "host": "10.2.1.6", "model_name": "m", "engine": "0"}
    pod = {"namespace": "default", "pod": "cuda-75454ffb9f-8ljq7"}
    am.post_alerts(
        [
            {"labels": {"alertname": "VLLMGPUFault", "severity": "info", "job": "vllm", "instance": "10.2.1.5:8000", **pod}, "startsAt": now},
            {"labels": {"alertname": "VLLMEngineHung", "severity": "critical", **faulted}, "startsAt": now},
            {"labels": {"alertname": "VLLMEngineHung", "severity": "critical", **healthy}, "startsAt": now},
            {"labels": {"alertname": "VLLMEngineHungGPUFault", "severity": "critical", **faulted}, "startsAt": now},
        ]
    )

    def inhibited_state():
        state = {(a["labels"]["alertname"], a["labels"]["instance"]): bool(a["status"]["inhibitedBy"]) for a in am.alerts(inhibited=True)}
        return state if len(state) == 4 and state[("VLLMEngineHung", "10.2.1.5:8000")] else None

    state = wait_until(inhibited_state, timeout=30, what="inhibition in Alertmanager")
    assert not state[("VLLMEngineHung", "10.2.1.6:8000")] and not state[("VLLMEngineHungGPUFault", "10.2.1.5:8000")]
    wait_until(lambda: sink.alerts("/restarter") and sink.alerts("/pager"), timeout=30, what="deliveries to the sink")
    # Both pages, which Alertmanager sends as separate notifications (their own groups), in
    # either order: a CI run read the pager after the first one only.
    wanted = {("VLLMEngineHungGPUFault", "10.2.1.5:8000"), ("VLLMEngineHung", "10.2.1.6:8000")}
    wait_until(
        lambda: wanted <= {(a["labels"]["alertname"], a["labels"]["instance"]) for a in sink.alerts("/pager")},
        timeout=30,
        what="the GPU-fault page and the healthy target's hang page",
    )
    assert {(a["labels"]["alertname"], a["labels"]["instance"]) for a in sink.alerts("/restarter")} == {("VLLMEngineHung", "10.2.1.6:8000")}
    paged = {(a["labels"]["alertname"], a["labels"]["instance"]) for a in sink.alerts("/pager")}
    assert ("VLLMEngineHung", "10.2.1.5:8000") not in paged and ("VLLMEngineHung", "10.2.1.6:8000") in paged
