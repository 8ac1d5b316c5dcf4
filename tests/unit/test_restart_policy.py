"""The restarter's decision core with tables and injected time: the webhook body, which
alerts are acted on, idempotency keys, budget, cooldown, backoff; and its configuration."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llm_health.config import restarter as rs_config
from llm_health.config.errors import ConfigError
from llm_health.config.restarter import Target
from llm_health.core import restart_policy
from llm_health.core.restart_policy import ACTED_ON, Budget, Policy, RestartRecord, budget_verdict
from llm_health.core.webhook import MAX_ALERTS, Alert, Malformed, fingerprint, parse_webhook
from tests.fixtures.webhooks import BODY_1051, BODY_2447, BODY_MSTEAMS, MALFORMED

# --- the webhook body (pure) ----------------------------------------------------------------


def test_real_bodies_parse_and_fingerprint_matches_alertmanager():
    hook = parse_webhook(BODY_2447.read_bytes())
    (alert,) = hook.alerts
    # Our fingerprint of the labels is the one Alertmanager 0.21 sent with them.
    assert alert.fingerprint == "8a07086b74f3ba78" == fingerprint(alert.labels)
    assert (alert.status, alert.starts_at, hook.truncated_alerts) == ("firing", "2021-01-07T08:38:00.032813093Z", 0)

    mixed = parse_webhook(BODY_1051.read_text())
    assert [a.status for a in mixed.alerts] == ["firing", "resolved"]
    assert all(len(a.fingerprint) == 16 for a in mixed.alerts)  # computed: the body has none

    (teams,) = parse_webhook(BODY_MSTEAMS.read_bytes()).alerts
    assert (teams.status, teams.starts_at) == ("firing", "2018-03-07T06:33:21.873077559-05:00")  # the group's status


@pytest.mark.parametrize("why,body", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_bodies(why, body):
    with pytest.raises(Malformed):
        parse_webhook(body)


def _alerts_body(alerts: list) -> str:
    return json.dumps({"version": "4", "status": "firing", "receiver": "restarter", "alerts": alerts})


def _one(alertname: str, n: int, **labels: str) -> dict:
    return {"labels": {"alertname": alertname, "n": str(n), **labels}, "startsAt": "2026-12-01T00:00:00Z", "status": "firing"}


def test_a_notification_past_max_alerts_reads_the_watched_alerts_wherever_they_are():
    """More than MAX_ALERTS alerts is no refusal: the watched ones are read (the hung one at
    the very end included), the others left unread, unvalidated (a broken one among them too)."""
    others = [_one("KubePodCrashLooping", i) for i in range(MAX_ALERTS + 200)] + [{"labels": "not an object"}, 7]
    body = _alerts_body([others[0], _one("LLMBackendHung", 1, backend="gpu1"), *others[1:], _one("VLLMEngineHung", 2, instance="h:8000")])
    hook = parse_webhook(body, ACTED_ON)
    assert [(a.alertname, a.labels.get("backend") or a.labels.get("instance")) for a in hook.alerts] == [
        ("LLMBackendHung", "gpu1"),
        ("VLLMEngineHung", "h:8000"),
    ]
    assert (hook.total, hook.unread, hook.unread_watched) == (len(others) + 2, len(others), 0)
    # At the bound, the body is read whole and validated whole, as before.
    at = [_one("KubePodCrashLooping", i) for i in range(MAX_ALERTS - 1)] + [_one("LLMBackendHung", 1, backend="gpu1")]
    assert (len(parse_webhook(_alerts_body(at), ACTED_ON).alerts), parse_webhook(_alerts_body(at), ACTED_ON).unread) == (MAX_ALERTS, 0)
    with pytest.raises(Malformed, match=r"alerts\[0\]: expected an object"):
        parse_webhook(_alerts_body([7, *at[1:]]), ACTED_ON)
    # A watched alert that is malformed still refuses the body, past the bound too.
    bad = {"labels": {"alertname": "LLMBackendHung"}, "status": "firing"}  # no startsAt
    with pytest.raises(Malformed, match=r"alerts\[1\]\.startsAt"):
        parse_webhook(_alerts_body([others[0], bad, *others[1:]]), ACTED_ON)


def test_more_watched_alerts_than_max_alerts_reads_the_first_ones():
    hung = [_one("LLMBackendHung", i, backend=f"gpu{i}") for i in range(MAX_ALERTS + 5)]
    hook = parse_webhook(_alerts_body(hung), ACTED_ON)
    assert len(hook.alerts) == MAX_ALERTS and hook.alerts[-1].labels["backend"] == f"gpu{MAX_ALERTS - 1}"
    assert (hook.unread, hook.unread_watched) == (5, 5)
    # Without `watched`, every alert is watched: the first MAX_ALERTS are read.
    assert len(parse_webhook(_alerts_body(hung)).alerts) == MAX_ALERTS


# --- the decision core (pure, injected time) ------------------------------------------------

B = Budget(max_restarts=3, window=3600, cooldown=300, backoff=2)


@pytest.mark.parametrize(
    "restarts,now,expected",
    [
        ([], 0, (None, 0.0)),
        ([(100, 110)], 200, ("cooldown", 210.0)),  # cooldown from the end of the last restart
        ([(100, 110)], 410, (None, 0.0)),
        ([(0, 500)], 600, ("cooldown", 200.0)),  # a long restart does not use up its own cooldown
        ([(0, None)], 100, ("cooldown", 200.0)),  # still running: from its start
        ([(0, 10), (400, 410)], 900, ("cooldown", 110.0)),  # second restart in the window: 300 * 2
        ([(0, 10), (400, 410)], 1010, (None, 0.0)),
        ([(0, 10), (400, 410), (1100, 1110)], 2400, ("budget_spent", 1200.0)),  # 3 in the hour: until the first ages out
        ([(0, 10), (400, 410), (1100, 1110)], 3600, (None, 0.0)),  # the first aged out; the last is long past its 600 s
        ([(3000, 3010), (3300, 3310), (3500, 3510)], 3600, ("budget_spent", 3000.0)),
        ([(0, 10), (3000, 3010), (3300, 3310)], 3599, ("budget_spent", 1.0)),
        ([(0, 10), (3000, 3010), (3300, 3310)], 3605, ("cooldown", 305.0)),  # room again, but 300 * 2 after 3310
        ([(0, 10), (3000, 3010), (3300, 3310)], 3910, (None, 0.0)),
        ([(-7200, -7190)], 0, (None, 0.0)),  # outside the window: forgotten, no cooldown either
    ],
)
def test_budget_verdict(restarts, now, expected):
    records = [RestartRecord(s, e) for s, e in restarts]
    refusal, wait = budget_verdict(B, records, now)
    assert (refusal, round(wait, 6)) == expected


def _alert(alertname="LLMBackendHung", status="firing", starts="2024-01-01T00:00:00Z", **labels) -> Alert:
    labels = {"alertname": alertname, **labels}
    return Alert(alertname, status, labels, starts, fingerprint(labels))


TARGETS = [
    Target("gpu0", "http://10.0.0.5:8000", "10.0.0.5:8000", restart=("true",)),
    Target("gpu1", "http://10.0.0.6:8000", "10.0.0.6:8000", restart=("true",)),
    Target("lb", "http://10.0.0.9:8000", "10.0.0.9:8000", kind="proxy"),
]


@pytest.mark.parametrize(
    "alert,decision,backend",
    [
        (_alert(backend="gpu0"), "accepted", "gpu0"),
        (_alert("VLLMEngineHung", instance="10.0.0.6:8000", engine="0"), "accepted", "gpu1"),
        (_alert(backend="gpu0", status="resolved"), "resolved", None),
        (_alert(backend="nope"), "unknown_backend", None),
        (_alert(instance="10.0.0.5:8000"), "unknown_backend", None),  # LLMBackendHung's instance is the exporter's
        (_alert("VLLMEngineHung", instance="10.9.9.9:8000"), "unknown_backend", None),
        (_alert(backend="lb"), "proxy", "lb"),
        (_alert("VLLMEngineHung", instance="10.0.0.9:8000"), "proxy", "lb"),
        (_alert("LLMBackendDown", backend="gpu0"), "ignored", None),
        (_alert("DemoAlert", server="ni3"), "ignored", None),
    ],
)
def test_which_alerts_are_acted_on(alert, decision, backend):
    adm = Policy(TARGETS, B).admit(alert, now=0)
    assert (adm.decision, adm.backend) == (decision, backend)


def test_idempotency_keys_and_one_action_per_backend():
    p = Policy(TARGETS, B)
    a = _alert(backend="gpu0")
    engine0 = _alert("VLLMEngineHung", instance="10.0.0.5:8000", engine="0")
    assert p.admit(a, 0).decision == "accepted"
    assert p.admit(a, 1).decision == "duplicate"  # the same delivery again, while acting
    assert p.admit(engine0, 1).decision == "duplicate"  # another alert for the same hang
    assert p.admit(_alert(backend="gpu1"), 1).decision == "accepted"  # other backends are independent
    assert p.claim("gpu0", 2) == (None, 0.0)
    p.finish("gpu0", a.key, restarted=True, now=100)
    assert p.admit(a, 200).decision == "duplicate"  # acted on: never again for this (fingerprint, startsAt)
    refired = replace(a, starts_at="2024-01-01T01:00:00Z")
    assert p.admit(refired, 200).decision == "accepted"  # a new firing of the same alert is new
    p.finish("gpu0", refired.key, restarted=False, now=201)  # e.g. not hung on re-verification
    assert p.admit(refired, 500).decision == "accepted"  # refused keys are judged again on repeat
    p.finish("gpu0", refired.key, restarted=False, now=501)
    assert p.admit(a, 100 + restart_policy.KEY_TTL + 1).decision == "accepted"  # remembered for KEY_TTL only


def test_budget_exhaustion_latches_until_the_window_has_room():
    p = Policy(TARGETS, Budget(max_restarts=2, window=3600, cooldown=60, backoff=1))
    for i, start in enumerate((0, 100)):
        assert p.claim("gpu0", start) == (None, 0.0)
        p.finish("gpu0", ("fp", str(i)), True, start + 10)
    assert not p.exhausted("gpu0", 200)  # spent, but no hang has been refused for it yet
    assert p.claim("gpu0", 200) == ("budget_spent", 3400.0)
    assert p.exhausted("gpu0", 200) and p.exhausted("gpu0", 3599)
    assert not p.exhausted("gpu1", 200)
    assert not p.exhausted("gpu0", 3600)  # the first restart aged out of the window
    assert p.claim("gpu0", 3600) == (None, 0.0)


def test_many_keys_are_bounded():
    p = Policy(TARGETS, B, max_keys=50)
    for i in range(200):
        a = _alert(backend="gpu1", starts=str(i))
        assert p.admit(a, i).decision == "accepted"
        p.finish("gpu1", a.key, True, i)
    p.admit(_alert(backend="gpu1", starts="x"), 300)
    assert len(p.done) <= 51


# --- configuration --------------------------------------------------------------------------

MINIMAL_CONFIG = """
restarter:
  budget: {max_restarts: 3, window: 1h, cooldown: 5m, backoff: 2}
  verify: {interval: 10s, hung_after_seconds: 20, probe_timeout: 5s}
  recovery_timeout: 10m
backends:
  - name: gpu0                 # matches the alert's `backend` label (LLMBackendHung)
    url: http://10.0.0.5:8000
    instance: 10.0.0.5:8000    # optional: matches `instance` on VLLMEngineHung (default: host:port of url)
    restart: [systemctl, restart, vllm@gpu0]
    restart_timeout: 120s
  - name: gpu1
    url: http://gpu1.internal/v1
    restart: [docker, restart, vllm-b]
    drain_command: [/usr/local/bin/lb-drain, gpu1, 30]
    api_key_env: RESTARTER_TEST_KEY
  - {name: lb, url: "http://10.0.0.9:8000", kind: proxy}
"""


def test_config_from_the_issue(tmp_path, monkeypatch):
    monkeypatch.setenv("RESTARTER_TEST_KEY", "k-123")
    f = tmp_path / "restarter.yml"
    f.write_text(MINIMAL_CONFIG)
    cfg = rs_config.load_config(f)
    assert cfg.budget == Budget(3, 3600, 300, 2.0)
    assert (cfg.verify.interval, cfg.verify.hung_after_seconds, cfg.verify.probe_timeout, cfg.recovery_timeout) == (10, 20, 5, 600)
    gpu0, gpu1, lb = cfg.targets
    assert (gpu0.restart, gpu0.restart_timeout, gpu0.instance) == (("systemctl", "restart", "vllm@gpu0"), 120, "10.0.0.5:8000")
    assert (gpu1.instance, gpu1.api_key, gpu1.restart_timeout) == ("gpu1.internal:80", "k-123", 120)
    assert "k-123" not in repr(cfg)
    assert (lb.kind, lb.restart) == ("proxy", ())
    assert (gpu0.drain_command, gpu1.drain_command, gpu1.drain_timeout) == ((), ("/usr/local/bin/lb-drain", "gpu1", "30"), 5.0)
    # what this file leaves out, at its defaults: the quick confirmation, the hold, memory state
    assert (cfg.confirm_interval, cfg.raw_alert_hold, cfg.recovery_interval, cfg.redis, cfg.output_dir) == (1.0, 45.0, 1.0, None, None)


def test_config_shared_state_and_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("RESTARTER_TEST_KEY", "k-123")
    f = tmp_path / "restarter.yml"
    f.write_text(
        MINIMAL_CONFIG.replace("  recovery_timeout: 10m\n", "  recovery_timeout: 10m\n  raw_alert_hold: 0s\n  output_dir: /var/lib/x\n")
        + "redis: {url: 'redis://:hunter2@10.0.0.7:6379/2', key_prefix: 'r:', lease_ttl: 10s}\n"
    )
    cfg = rs_config.load_config(f)
    assert (cfg.raw_alert_hold, cfg.output_dir) == (0.0, "/var/lib/x")
    assert cfg.redis is not None and (cfg.redis.url, cfg.redis.key_prefix, cfg.redis.lease_ttl) == ("redis://:hunter2@10.0.0.7:6379/2", "r:", 10.0)
    assert "hunter2" not in repr(cfg)  # the URL may carry a password


@pytest.mark.parametrize(
    "edit,key,problem",
    [
        (("[systemctl, restart, vllm@gpu0]", '"systemctl restart vllm@gpu0"'), "backends[0].restart", "without a shell"),
        (("    restart: [systemctl, restart, vllm@gpu0]\n", ""), "backends[0].restart", "missing"),
        (("restart: [systemctl, restart, vllm@gpu0]", "restart: []"), "backends[0].restart", "non-empty list"),
        (("restart: [systemctl, restart, vllm@gpu0]", "restart: true"), "backends[0].restart", "expected a non-empty list"),  # write /bin/true
        (("window: 1h", "window: soon"), "restarter.budget.window", "duration"),
        (("backoff: 2", "backoff: 0.5"), "restarter.budget.backoff", ">= 1"),
        (("max_restarts: 3", "max_restarts: 0"), "restarter.budget.max_restarts", "positive integer"),
        (("recovery_timeout: 10m", "recovery_timeout: 10m\n  retries: 3"), "restarter.retries", "unknown key"),
        (("restart_timeout: 120s", "restart_timeout: 120s\n    shell: true"), "backends[0].shell", "unknown key"),
        (("instance: 10.0.0.5:8000", "instance: gpu1.internal:80"), "backends[1].instance", "could not tell them apart"),
        (("kind: proxy}", "kind: proxy, restart: [/bin/true]}"), "backends[2].restart", "never restarted"),
        (("kind: proxy}", "kind: proxy, drain_command: [/bin/true]}"), "backends[2].drain_command", "never restarted"),
        (("drain_command: [/usr/local/bin/lb-drain, gpu1, 30]", 'drain_command: "lb-drain gpu1"'), "backends[1].drain_command", "without a shell"),
        (("drain_command: [/usr/local/bin/lb-drain, gpu1, 30]", "drain_command: [lb-drain, '']"), "backends[1].drain_command[1]", "non-empty string"),
        (
            ("drain_command: [/usr/local/bin/lb-drain, gpu1, 30]", "drain_command: [lb-drain]\n    drain_timeout: 2m"),
            "backends[1].drain_timeout",
            "at most 60s",
        ),
        (("restart_timeout: 120s", "restart_timeout: 120s\n    drain_timeout: 3s"), "backends[0].drain_timeout", "no drain_command"),
        (("api_key_env: RESTARTER_TEST_KEY", "api_key_env: RESTARTER_TEST_UNSET_VAR"), "backends[1].api_key_env", "not set"),
        (("recovery_timeout: 10m", "recovery_timeout: 10m\n  confirm_interval: 0s"), "restarter.confirm_interval", "greater than"),
        (("recovery_timeout: 10m", "recovery_timeout: 10m\nredis: {url: http://x}"), "redis.url", "redis://"),
        (("recovery_timeout: 10m", "recovery_timeout: 10m\nredis: {url: redis://x, ttl: 5}"), "redis.ttl", "unknown key"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path, monkeypatch, edit, key, problem):
    monkeypatch.setenv("RESTARTER_TEST_KEY", "k-123")
    monkeypatch.delenv("RESTARTER_TEST_UNSET_VAR", raising=False)
    old, new = edit
    assert old in MINIMAL_CONFIG
    f = tmp_path / "bad.yml"
    f.write_text(MINIMAL_CONFIG.replace(old, new, 1))
    with pytest.raises(ConfigError) as exc:
        rs_config.load_config(f)
    assert (exc.value.where, exc.value.key) == (str(f), key)
    assert problem in exc.value.problem
