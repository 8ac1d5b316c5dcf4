"""`llm-health restarter`: the Alertmanager webhook receiver, on loopback, against the
simulated fleet, with restart commands that are real processes.

Webhook bodies are the real ones in ../shared/real-world/other/ (read in place), with
their alertname and labels rewritten to ours. A restart command here is a real process
that appends a line to a marker file; the test applies its effect to the simulated server
(`server.restart(); sim.idle(server)`), as systemd would start a fresh vLLM.

The decision core (which alerts, idempotency keys, budget, cooldown, backoff) is tested
with tables and injected time; report 1's day is replayed in simulated time with every
restart request going through that core and a re-verification.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from llm_health import restarter as rs
from llm_health import sim
from llm_health.errors import ConfigError
from llm_health.restarter import Alert, Budget, Policy, RestarterConfig, RestartRecord, Target, Verify, budget_verdict
from tests.conftest import ROOT, SHARED

WEBHOOKS = SHARED / "other"
BODY_2447 = WEBHOOKS / "alertmanager-0.21.0-webhook-body-firing-issue2447.json"
BODY_1051 = WEBHOOKS / "alertmanager-webhook-mixed-firing-resolved-issue1051.json"
BODY_MSTEAMS = WEBHOOKS / "alertmanager-webhook-prometheus-msteams-testdata-prom_post_request.json"

TOKEN = "test-token-5f2c9a0e71d4"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST_VERIFY = Verify(interval=0.2, hung_after_seconds=0.4, probe_timeout=0.5, metrics_timeout=2.0)
# Appends a line to the marker file (argv[1]) and says what it did, as systemctl would.
MARK = "import os, sys; open(sys.argv[1], 'a').write('restart\\n'); print('restarting', os.environ.get('LLM_HEALTH_BACKEND'))"


# --- helpers ------------------------------------------------------------------------------


def webhook_2447(alertname="LLMBackendHung", starts_at=None, **labels) -> dict:
    """The captured Alertmanager 0.21 body, relabelled as one of our alerts."""
    data = json.loads(BODY_2447.read_text())
    new = {"alertname": alertname, "severity": "critical", **labels}
    alert = data["alerts"][0]
    alert["labels"] = new
    alert["fingerprint"] = rs.fingerprint(new)
    if starts_at:
        alert["startsAt"] = starts_at
    data.update(receiver="restarter", groupLabels={"alertname": alertname}, commonLabels=new)
    return data


def webhook_msteams(instance: str) -> dict:
    """The prometheus-msteams fixture (no per-alert status, ns startsAt with an offset) as VLLMEngineHung."""
    data = json.loads(BODY_MSTEAMS.read_text())
    alert = data["alerts"][0]
    alert["labels"] = {"alertname": "VLLMEngineHung", "instance": instance, "job": "vllm", "model_name": "sim-model", "engine": "0", "severity": "critical"}
    data["groupLabels"] = {"alertname": "VLLMEngineHung"}
    data["commonLabels"] = alert["labels"]
    return data


def webhook_1051(backend: str) -> dict:
    """The 2017 body: group firing, one firing and one resolved alert, no fingerprints."""
    data = json.loads(BODY_1051.read_text())
    for alert in data["alerts"]:
        alert["labels"] = {"alertname": "LLMBackendHung", "backend": backend, "severity": "critical", "status": alert["status"]}
    return data


def marker_target(name: str, server, marker: Path, **kw) -> Target:
    return Target(name, server.url, rs.default_instance(server.url), restart=(sys.executable, "-c", MARK, str(marker)), **kw)


def make_config(*targets: Target, **kw) -> RestarterConfig:
    kw.setdefault("verify", FAST_VERIFY)
    kw.setdefault("recovery_interval", 0.1)
    kw.setdefault("recovery_timeout", 10.0)
    kw.setdefault("kill_grace", 0.5)
    return RestarterConfig(targets=tuple(targets), **kw)


@pytest.fixture
async def restarter_client():
    """Factory: a Restarter app served on 127.0.0.1 with a real TCP socket, and its client."""
    made = []

    async def make(config: RestarterConfig, **kw):
        r = rs.Restarter(config, TOKEN, **kw)
        client = TestClient(TestServer(r.app(), host="127.0.0.1"))
        await client.start_server()
        made.append(client)
        return r, client

    yield make
    for c in made:
        await c.close()


class RestartEffect:
    """Applies each restart the marker file records to a simulated server."""

    def __init__(self, marker: Path, server: sim.SimServer):
        self.marker, self.server, self.applied = marker, server, 0
        self.task = asyncio.create_task(self._run())

    def lines(self) -> int:
        return len(self.marker.read_text().splitlines()) if self.marker.exists() else 0

    async def _run(self):
        while True:
            while self.applied < self.lines():
                self.applied += 1
                self.server.restart()
                sim.idle(self.server)
            await asyncio.sleep(0.02)

    async def stop(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def post(client, body, headers=AUTH):
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    return await client.post("/alerts", data=data, headers={**headers, "Content-Type": "application/json"})


async def post_json(client, body) -> dict:
    resp = await post(client, body)
    assert resp.status in (200, 202), await resp.text()
    return await resp.json()


async def status(client) -> dict:
    resp = await client.get("/status", headers=AUTH)
    assert resp.status == 200
    return await resp.json()


async def wait_done(client, action_id: int, timeout: float = 30.0) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        action = next(a for a in (await status(client))["actions"] if a["id"] == action_id)
        if action["phase"] == "done":
            return action
        if loop.time() > deadline:
            raise AssertionError(f"action {action_id} did not finish: {action}")
        await asyncio.sleep(0.05)


async def metrics(client) -> dict:
    resp = await client.get("/metrics")
    assert resp.status == 200
    out = {}
    for family in text_string_to_metric_families(await resp.text()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict, name: str, **labels) -> float | None:
    return m.get((name, tuple(sorted(labels.items()))))


# --- the webhook body (pure) ----------------------------------------------------------------


def test_real_bodies_parse_and_fingerprint_matches_alertmanager():
    hook = rs.parse_webhook(BODY_2447.read_bytes())
    (alert,) = hook.alerts
    # Our fingerprint of the labels is the one Alertmanager 0.21 sent with them.
    assert alert.fingerprint == "8a07086b74f3ba78" == rs.fingerprint(alert.labels)
    assert (alert.status, alert.starts_at, hook.truncated_alerts) == ("firing", "2021-01-07T08:38:00.032813093Z", 0)

    mixed = rs.parse_webhook(BODY_1051.read_text())
    assert [a.status for a in mixed.alerts] == ["firing", "resolved"]
    assert all(len(a.fingerprint) == 16 for a in mixed.alerts)  # computed: the body has none

    (teams,) = rs.parse_webhook(BODY_MSTEAMS.read_bytes()).alerts
    assert (teams.status, teams.starts_at) == ("firing", "2018-03-07T06:33:21.873077559-05:00")  # the group's status


def _with(path: Path, **changes) -> str:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    return json.dumps(data)


def _alert_without(key: str) -> str:
    data = json.loads(BODY_2447.read_text())
    del data["alerts"][0][key]
    return json.dumps(data)


MALFORMED = [
    ("not json", b"alertname=LLMBackendHung"),
    ("a list", b"[]"),
    ("version 3", _with(BODY_2447, version="3")),
    ("no version", _with(BODY_2447, version=None)),
    ("no alerts", _with(BODY_2447, alerts=None)),
    ("alerts not a list", _with(BODY_2447, alerts={"a": 1})),
    ("empty alerts", _with(BODY_2447, alerts=[])),
    ("alert without labels", _alert_without("labels")),
    ("alert without startsAt", _alert_without("startsAt")),
    ("bad group status", _with(BODY_2447, status="pending")),
    ("not utf-8", b"\xff\xfe{"),
]


@pytest.mark.parametrize("why,body", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_bodies(why, body):
    with pytest.raises(rs.Malformed):
        rs.parse_webhook(body)


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
    return Alert(alertname, status, labels, starts, rs.fingerprint(labels))


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
    assert p.admit(a, 100 + rs.KEY_TTL + 1).decision == "accepted"  # remembered for KEY_TTL only


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

ISSUE_CONFIG = """
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
    api_key_env: RESTARTER_TEST_KEY
  - {name: lb, url: "http://10.0.0.9:8000", kind: proxy}
"""


def test_config_from_the_issue(tmp_path, monkeypatch):
    monkeypatch.setenv("RESTARTER_TEST_KEY", "k-123")
    f = tmp_path / "restarter.yml"
    f.write_text(ISSUE_CONFIG)
    cfg = rs.load_config(f)
    assert cfg.budget == Budget(3, 3600, 300, 2.0)
    assert (cfg.verify.interval, cfg.verify.hung_after_seconds, cfg.verify.probe_timeout, cfg.recovery_timeout) == (10, 20, 5, 600)
    gpu0, gpu1, lb = cfg.targets
    assert (gpu0.restart, gpu0.restart_timeout, gpu0.instance) == (("systemctl", "restart", "vllm@gpu0"), 120, "10.0.0.5:8000")
    assert (gpu1.instance, gpu1.api_key, gpu1.restart_timeout) == ("gpu1.internal:80", "k-123", 120)
    assert "k-123" not in repr(cfg)
    assert (lb.kind, lb.restart) == ("proxy", ())


@pytest.mark.parametrize(
    "edit,key,problem",
    [
        (("[systemctl, restart, vllm@gpu0]", '"systemctl restart vllm@gpu0"'), "backends[0].restart", "without a shell"),
        (("    restart: [systemctl, restart, vllm@gpu0]\n", ""), "backends[0].restart", "missing"),
        (("restart: [systemctl, restart, vllm@gpu0]", "restart: []"), "backends[0].restart", "non-empty list"),
        (("window: 1h", "window: soon"), "restarter.budget.window", "duration"),
        (("backoff: 2", "backoff: 0.5"), "restarter.budget.backoff", ">= 1"),
        (("max_restarts: 3", "max_restarts: 0"), "restarter.budget.max_restarts", "positive integer"),
        (("recovery_timeout: 10m", "recovery_timeout: 10m\n  retries: 3"), "restarter.retries", "unknown key"),
        (("restart_timeout: 120s", "restart_timeout: 120s\n    shell: true"), "backends[0].shell", "unknown key"),
        (("instance: 10.0.0.5:8000", "instance: gpu1.internal:80"), "backends[1].instance", "could not tell them apart"),
        (("kind: proxy}", "kind: proxy, restart: [/bin/true]}"), "backends[2].restart", "never restarted"),
        (("api_key_env: RESTARTER_TEST_KEY", "api_key_env: RESTARTER_TEST_UNSET_VAR"), "backends[1].api_key_env", "not set"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path, monkeypatch, edit, key, problem):
    monkeypatch.setenv("RESTARTER_TEST_KEY", "k-123")
    monkeypatch.delenv("RESTARTER_TEST_UNSET_VAR", raising=False)
    old, new = edit
    assert old in ISSUE_CONFIG
    f = tmp_path / "bad.yml"
    f.write_text(ISSUE_CONFIG.replace(old, new, 1))
    with pytest.raises(ConfigError) as exc:
        rs.load_config(f)
    assert (exc.value.where, exc.value.key) == (str(f), key)
    assert problem in exc.value.problem


# --- the receiver on loopback, against the simulated fleet ----------------------------------


async def test_hung_backend_is_restarted_once_and_comes_back(sim_server, ticker, restarter_client, tmp_path, monkeypatch):
    monkeypatch.setenv(rs.TOKEN_ENV, TOKEN)  # present in the restarter's environment...
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    env_dump = tmp_path / "env.json"
    script = MARK + f"; import json; json.dump(dict(os.environ), open({str(env_dump)!r}, 'w'))"
    target = Target("gpu0", s.url, rs.default_instance(s.url), restart=(sys.executable, "-c", script, str(marker)))
    _, client = await restarter_client(make_config(target))
    effect = RestartEffect(marker, s)
    try:
        answer = await post(client, webhook_2447(backend="gpu0"))
        assert answer.status == 202  # accepted at once; the work goes on in the background
        (a,) = (await answer.json())["alerts"]
        assert (a["decision"], a["backend"]) == ("accepted", "gpu0")
        action = await wait_done(client, a["action"])
    finally:
        await effect.stop()
    assert action["verification"]["state"] == "hung"
    assert (action["outcome"], action["recovery_state"], action["restart_seen"]) == ("recovered", "idle", True)
    assert action["command_result"]["exit_code"] == 0 and "restarting gpu0" in action["command_result"]["output"]
    assert effect.lines() == 1
    env = json.loads(env_dump.read_text())
    assert rs.TOKEN_ENV not in env and TOKEN not in json.dumps(env)  # ...never handed to the command
    assert (env["LLM_HEALTH_BACKEND"], env["LLM_HEALTH_BACKEND_URL"]) == ("gpu0", s.url)
    m = await metrics(client)
    assert sample(m, "llm_restarter_restarts_total", backend="gpu0", outcome="recovered") == 1
    assert sample(m, "llm_restarter_recovery_seconds", backend="gpu0") == action["recovery_seconds"] > 0
    assert sample(m, "llm_restarter_budget_exhausted", backend="gpu0") == 0
    assert s.completions_while_busy() == []  # nothing was sent to the engine while work was in flight


async def test_vllm_engine_hung_is_matched_on_instance(sim_server, ticker, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker)))
    effect = RestartEffect(marker, s)
    try:
        (a,) = (await post_json(client, webhook_msteams(rs.default_instance(s.url))))["alerts"]
        assert (a["alertname"], a["decision"], a["backend"]) == ("VLLMEngineHung", "accepted", "gpu0")
        action = await wait_done(client, a["action"])
    finally:
        await effect.stop()
    assert action["outcome"] == "recovered" and effect.lines() == 1


async def test_busy_backend_whose_alert_arrives_late_is_not_restarted(sim_server, ticker, restarter_client, tmp_path):
    """Report 1: busy and progressing is not hung; the re-verification sends it nothing."""
    s = await sim_server(scenario="saturated")
    ticker.append(s)
    marker = tmp_path / "restarts"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker)))
    answer = await post_json(client, webhook_1051("gpu0"))  # one firing, one resolved
    firing, resolved = answer["alerts"]
    assert (firing["decision"], resolved["decision"]) == ("accepted", "resolved")
    action = await wait_done(client, firing["action"])
    assert (action["refusal"], action["outcome"], action["verification"]["state"]) == ("not_hung", None, "busy")
    assert action["verification"]["probes_sent"] == 0
    assert not marker.exists()
    assert s.received == [] and s.completions_while_busy() == []
    m = await metrics(client)
    assert sample(m, "llm_restarter_refusals_total", reason="not_hung") == 1
    assert sample(m, "llm_restarter_refusals_total", reason="resolved") == 1
    assert sample(m, "llm_restarter_restarts_total", backend="gpu0", outcome="recovered") == 0


async def test_duplicates_do_not_restart_twice(sim_server, ticker, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker)))
    body = webhook_2447(backend="gpu0")
    effect = RestartEffect(marker, s)
    try:
        # The same delivery twice at once (a partition), and the raw-layer alert for the same hang.
        answers = await asyncio.gather(post_json(client, body), post_json(client, body), post_json(client, webhook_msteams(rs.default_instance(s.url))))
        decisions = [x["alerts"][0]["decision"] for x in answers]
        assert sorted(decisions) == ["accepted", "duplicate", "duplicate"]
        (action_id,) = [x["alerts"][0]["action"] for x in answers if x["alerts"][0]["decision"] == "accepted"]
        action = await wait_done(client, action_id)
        assert action["outcome"] == "recovered"
        # Alertmanager repeats the notification later: still the same alert.
        again = await post_json(client, body)
        assert again["alerts"][0]["decision"] == "duplicate" and again["accepted"] == 0
    finally:
        await effect.stop()
    assert effect.lines() == 1
    assert len((await status(client))["actions"]) == 1
    m = await metrics(client)
    assert sample(m, "llm_restarter_refusals_total", reason="duplicate") == 3
    assert sample(m, "llm_restarter_restarts_total", backend="gpu0", outcome="recovered") == 1


async def test_budget_stops_a_restart_loop(sim_server, ticker, restarter_client, tmp_path):
    """A backend that hangs again after every restart: two restarts, then the restarter stops and says so."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    budget = Budget(max_restarts=2, window=3600, cooldown=0.05, backoff=1)
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), budget=budget))
    effect = RestartEffect(marker, s)
    outcomes = []
    try:
        for i in range(4):
            (a,) = (await post_json(client, webhook_2447(backend="gpu0", starts_at=f"2024-05-01T10:0{i}:00Z")))["alerts"]
            assert a["decision"] == "accepted"
            action = await wait_done(client, a["action"])
            outcomes.append(action["outcome"] or action["refusal"])
            await asyncio.sleep(0.1)  # past the cooldown
            sim.hang(s)  # and it hangs again
    finally:
        await effect.stop()
    assert outcomes == ["recovered", "recovered", "budget_spent", "budget_spent"]
    assert effect.lines() == 2
    m = await metrics(client)
    assert sample(m, "llm_restarter_budget_exhausted", backend="gpu0") == 1
    assert sample(m, "llm_restarter_refusals_total", reason="budget_spent") == 2
    assert sample(m, "llm_restarter_restarts_total", backend="gpu0", outcome="recovered") == 2
    (backend,) = (await status(client))["backends"]
    assert (backend["budget"], backend["budget_exhausted"], backend["restarts_in_window"]) == ("budget_spent", True, 2)


async def test_cooldown_after_a_restart(sim_server, ticker, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), budget=Budget(3, 3600, 3600, 2)))
    effect = RestartEffect(marker, s)
    try:
        first = (await post_json(client, webhook_2447(backend="gpu0", starts_at="2024-05-01T10:00:00Z")))["alerts"][0]
        assert (await wait_done(client, first["action"]))["outcome"] == "recovered"
        sim.hang(s)
        second = (await post_json(client, webhook_2447(backend="gpu0", starts_at="2024-05-01T10:05:00Z")))["alerts"][0]
        action = await wait_done(client, second["action"])
    finally:
        await effect.stop()
    assert (action["refusal"], action["verification"]["state"]) == ("cooldown", "hung")
    assert effect.lines() == 1
    m = await metrics(client)
    assert sample(m, "llm_restarter_refusals_total", reason="cooldown") == 1
    assert sample(m, "llm_restarter_budget_exhausted", backend="gpu0") == 0


async def test_bad_tokens_and_malformed_bodies_change_nothing(sim_server, restarter_client, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    s = await sim_server(scenario="hung")
    marker = tmp_path / "restarts"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker)))
    good = webhook_2447(backend="gpu0")
    bad_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
        {"Authorization": TOKEN},
    ]
    for headers in bad_headers:
        resp = await post(client, good, headers=headers)
        assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await client.get("/status")).status == 401
    assert (await client.get("/status", headers={"Authorization": "Bearer nope"})).status == 401
    for _, body in MALFORMED:
        resp = await post(client, body)
        assert resp.status == 400, body
    st = await status(client)
    assert st["actions"] == [] and st["refused"] == []
    assert not marker.exists() and s.metrics_reads == 0  # nothing acted on, not even a read
    m = await metrics(client)  # /metrics needs no token: counters only
    assert sample(m, "llm_restarter_refusals_total", reason="unauthorised") == len(bad_headers) + 2
    assert sample(m, "llm_restarter_refusals_total", reason="malformed") == len(MALFORMED)
    assert TOKEN not in caplog.text


async def test_hanging_restart_command_is_killed_at_its_timeout(sim_server, ticker, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    target = Target("gpu0", s.url, rs.default_instance(s.url), restart=("sleep", "60"), restart_timeout=0.3)
    _, client = await restarter_client(make_config(target))
    (a,) = (await post_json(client, webhook_2447(backend="gpu0")))["alerts"]
    action = await wait_done(client, a["action"])
    assert action["outcome"] == "timeout" and "killed after 0.3s (SIGTERM to process group" in action["detail"]
    pid = action["command_result"]["pid"]
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped
    m = await metrics(client)
    assert sample(m, "llm_restarter_restarts_total", backend="gpu0", outcome="timeout") == 1


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] == "Z"  # killed; waiting for its new parent to reap it


async def test_whole_process_group_is_killed_even_if_it_ignores_sigterm(tmp_path):
    pids = tmp_path / "pids"
    # sh starts in milliseconds (the timeout must not pass before the child exists); an
    # ignored SIGTERM is inherited by the child too, so only SIGKILL ends either.
    script = f'trap "" TERM; sleep 60 & echo $$ $! > {pids}; echo waiting; wait'
    result = await rs.run_command(["sh", "-c", script], timeout=1.0, kill_grace=0.2)
    assert result.outcome == "timeout" and "waiting" in result.output
    assert "SIGKILL after 0.2s" in result.detail
    leader, child = map(int, pids.read_text().split())
    assert leader == result.pid
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not (_gone(leader) and _gone(child)) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert _gone(leader) and _gone(child)


async def test_command_output_is_bounded_and_failures_reported():
    loud = "import sys; sys.stdout.write('x' * 100000); sys.stdout.write('\\nunit vllm@gpu0 not found\\n'); sys.exit(5)"
    result = await rs.run_command([sys.executable, "-c", loud], timeout=10, max_output_bytes=1000)
    assert (result.outcome, result.exit_code, result.truncated, result.output_bytes) == ("failed", 5, True, 100026)
    assert len(result.output) == 1000 and result.output.endswith("unit vllm@gpu0 not found\n")
    missing = await rs.run_command(["/nonexistent/restart-vllm"], timeout=10)
    assert missing.outcome == "error" and "cannot start" in missing.detail


async def test_failed_restart_command_is_reported(sim_server, ticker, restarter_client):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    argv = (sys.executable, "-c", "print('Failed to restart vllm@gpu0.service: Unit not found.'); raise SystemExit(5)")
    _, client = await restarter_client(make_config(Target("gpu0", s.url, rs.default_instance(s.url), restart=argv)))
    (a,) = (await post_json(client, webhook_2447(backend="gpu0")))["alerts"]
    action = await wait_done(client, a["action"])
    assert (action["outcome"], action["command_result"]["exit_code"]) == ("failed", 5)
    assert "Unit not found" in action["command_result"]["output"]
    assert sample(await metrics(client), "llm_restarter_restarts_total", backend="gpu0", outcome="failed") == 1


async def test_dry_run_runs_nothing(sim_server, ticker, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker)), dry_run=True)
    answer = await post_json(client, webhook_2447(backend="gpu0"))
    assert answer["dry_run"] is True
    action = await wait_done(client, answer["alerts"][0]["action"])
    assert (action["outcome"], action["verification"]["state"], action["command_result"]) == ("dry_run", "hung", None)
    assert "would run" in action["detail"] and str(marker) in action["detail"]
    await asyncio.sleep(0.2)
    assert not marker.exists() and s.engines[0].mode == "hung"
    assert sample(await metrics(client), "llm_restarter_restarts_total", backend="gpu0", outcome="dry_run") == 1


async def test_proxy_unknown_and_other_alerts(sim_server, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    proxy = sim.SimProxy("lb", [s])
    await proxy.start()
    try:
        marker = tmp_path / "restarts"
        lb = Target("lb", proxy.url, rs.default_instance(proxy.url), kind="proxy")
        _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), lb))
        cases = {
            "proxy": webhook_2447(backend="lb"),
            "unknown_backend": webhook_2447(backend="gpu9"),
        }
        for reason, body in cases.items():
            answer = await post_json(client, body)
            assert answer["alerts"][0]["decision"] == reason and answer["accepted"] == 0
        unknown_instance = await post_json(client, webhook_msteams("10.255.0.1:8000"))
        assert unknown_instance["alerts"][0]["decision"] == "unknown_backend"
        demo = await post(client, BODY_2447.read_bytes())  # the captured DemoAlert as it was sent
        assert demo.status == 200 and (await demo.json())["alerts"][0]["decision"] == "ignored"
        m = await metrics(client)
        assert sample(m, "llm_restarter_refusals_total", reason="proxy") == 1
        assert sample(m, "llm_restarter_refusals_total", reason="unknown_backend") == 2
        assert not any(k[0] == "llm_restarter_budget_exhausted" and ("backend", "lb") in k[1] for k in m)
        assert proxy.metrics_reads == proxy.models_reads == 0 and s.metrics_reads == 0 and not marker.exists()
    finally:
        await proxy.stop()


async def test_metrics_pass_promtool(restarter_client, sim_server, tmp_path):
    s = await sim_server(scenario="idle")
    _, client = await restarter_client(make_config(marker_target("gpu0", s, tmp_path / "m")))
    text = await (await client.get("/metrics")).text()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert names == {"llm_restarter_restarts", "llm_restarter_refusals", "llm_restarter_recovery_seconds", "llm_restarter_budget_exhausted"}
    import shutil

    if shutil.which("promtool"):
        out = await asyncio.to_thread(subprocess.run, ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stdout + out.stderr


# --- the command ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_cli_restarter_dry_run_end_to_end(sim_server, tmp_path):
    """`llm-health restarter` as a process: loopback, token file, dry run; the token never printed."""
    s = await sim_server(scenario="hung")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    cfg = tmp_path / "restarter.yml"
    cfg.write_text(
        "restarter:\n"
        "  verify: {interval: 200ms, hung_after_seconds: 0.4, probe_timeout: 1s, metrics_timeout: 2s}\n"
        "backends:\n"
        f"  - {{name: gpu0, url: '{s.url}', restart: [systemctl, restart, vllm@gpu0]}}\n"
    )
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "exporter")}
    env.pop(rs.TOKEN_ENV, None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llm_health", "restarter", "--config.file", str(cfg), "--web.listen-address", f"127.0.0.1:{port}",
        "--web.token-file", str(token_file), "--dry-run", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(base + "/-/healthy") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
            async with session.post(base + "/alerts", json=webhook_2447(backend="gpu0"), headers={"Authorization": "Bearer nope"}) as resp:
                assert resp.status == 401
            async with session.post(base + "/alerts", json=webhook_2447(backend="gpu0"), headers=AUTH) as resp:
                assert resp.status == 202
                action_id = (await resp.json())["alerts"][0]["action"]
            for _ in range(300):
                async with session.get(base + "/status", headers=AUTH) as resp:
                    action = next(a for a in (await resp.json())["actions"] if a["id"] == action_id)
                if action["phase"] == "done":
                    break
                await asyncio.sleep(0.05)
            assert (action["outcome"], action["verification"]["state"]) == ("dry_run", "hung")
            assert "systemctl" in action["detail"]
    finally:
        proc.terminate()
        output = (await proc.communicate())[0].decode()
    assert "DRY RUN" in output and "would run" in output
    assert TOKEN not in output


def test_cli_restarter_refuses_to_start_without_a_token(tmp_path):
    cfg = tmp_path / "restarter.yml"
    cfg.write_text("backends:\n  - {name: gpu0, url: 'http://127.0.0.1:9', restart: [/bin/true]}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "exporter")}
    env.pop(rs.TOKEN_ENV, None)
    out = subprocess.run(
        [sys.executable, "-m", "llm_health", "restarter", "--config.file", str(cfg)], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert out.returncode == 2 and rs.TOKEN_ENV in out.stderr and "--web.token-file" in out.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text("backends:\n  - {name: gpu0, url: 'http://127.0.0.1:9', restart: 'systemctl restart vllm'}\n")
    out = subprocess.run(
        [sys.executable, "-m", "llm_health", "restarter", "--config.file", str(bad)], capture_output=True, text=True, env={**env, rs.TOKEN_ENV: TOKEN}, timeout=60, check=False
    )
    assert out.returncode == 2 and f"{bad}: backends[0].restart" in out.stderr


# --- report 1's day, every restart request through the restarter ---------------------------


def replay_through_restarter(plan, with_cascade: bool = True, tick: float = 1.0) -> dict:
    """Report 1's day in simulated time. The naive watchdog, the 500-counting one and the
    exporter's LLMBackendHung alert (for: 1m, each notification delivered twice, repeated
    every 5 minutes) no longer restart anything: each sends its restart request to the
    restarter's decision core (`Policy`), which re-verifies against the server with the
    same rounds as `llm-health check` (health.decide on the server's payloads, simulated
    time) and restarts only a server still `hung`, within the budget."""
    from llm_health import engines
    from llm_health import replay as rp
    from llm_health.cli import _final  # the rule that ends a `check`
    from llm_health.health import Observation, Settings, after_probe, decide

    day = rp.DAY
    server = rp._Server(plan)
    target = Target("day", "http://day.invalid:8000", "day.invalid:8000", restart=("systemctl", "restart", "vllm@day"))
    verify = Verify(interval=plan.check_interval, hung_after_seconds=plan.hung_after_seconds)
    policy = Policy([target], Budget())
    rounds = max(3, math.ceil(verify.hung_after_seconds / verify.interval) + 1)
    check_settings = Settings(hung_after_seconds=verify.hung_after_seconds, probe_interval=0.0)
    exporter_settings = Settings(hung_after_seconds=plan.hung_after_seconds, probe_interval=plan.probe_interval)

    restarts: list[tuple[float, str, bool]] = []
    decisions: Counter = Counter()
    requests: Counter = Counter()
    probes = {"sent": 0, "to_busy": 0}
    verifying: list[dict] = []
    recovering: list[dict] = []
    cascade_seen = cascade_restarts = 0

    def request(t: float, by: str, starts_at: str, fp_labels: dict) -> None:
        requests[by] += 1
        labels = {"alertname": "LLMBackendHung", "backend": "day", **fp_labels}
        alert = Alert("LLMBackendHung", "firing", labels, starts_at, rs.fingerprint(labels))
        adm = policy.admit(alert, t)
        decisions[adm.decision] += 1
        if adm.decision == "accepted":
            verifying.append({"key": alert.key, "by": by, "memory": None, "reads": 0, "next": t})

    def read(memory, t, settings):
        up = t >= server.up_at
        if not up:
            obs = Observation(now=t, metrics_error="connection refused", metrics_refused=True, models_ok=False, models_error="connection refused")
        else:
            obs = Observation(now=t, reading=engines.read(server.sim.payload()))
        v = decide(memory, obs, settings)
        if v.probe_wanted:  # only ever wanted for an idle engine
            probes["sent"] += 1
            probes["to_busy"] += server.busy
            v = after_probe(v, up and not server.hung, t, settings)
        return v

    naive_failures, naive_pending = 0, None
    exporter_memory, exporter_next, hung_since, next_delivery = None, 0.0, None, 0.0
    t = 0.0
    while t < day:
        server.step(t, tick)
        up = t >= server.up_at

        # The naive watchdog (report 1): a real request every 5 minutes, 45 s timeout, 5 failures.
        if naive_pending is None and t % plan.naive_period < tick:
            ok = up and not server.busy and not server.hung
            naive_pending = t + (0.5 if ok else plan.naive_timeout)
            naive_failures = 0 if ok else naive_failures + 1
        if naive_pending is not None and t >= naive_pending:
            naive_pending = None
            if naive_failures >= plan.naive_failures:
                naive_failures = 0
                request(t, "naive watchdog", f"naive-{t:.0f}", {"source": "naive"})

        # The 500-counting watchdog: restart requests after enough failed requests.
        if with_cascade and t % plan.cascade_period < tick and t > 0:
            if cascade_seen >= max(1, plan.cascade_threshold - cascade_restarts):
                cascade_restarts += 1
                request(t, "500-counting watchdog", f"cascade-{t:.0f}", {"source": "cascade"})
            cascade_seen = 0

        # The exporter's continuous rounds and LLMBackendHung (for: 1m), delivered at least once.
        if up and t >= exporter_next:
            v = read(exporter_memory, t, exporter_settings)
            exporter_memory, exporter_next = v.memory, t + plan.check_interval
            hung_since = (hung_since if hung_since is not None else t) if v.state == "hung" else None
        if hung_since is not None and t - hung_since >= 60 and t >= next_delivery:
            for _ in range(2):  # a duplicate, as during a partition
                request(t, "LLMBackendHung", f"exporter-{hung_since:.0f}", {"source": "exporter"})
            next_delivery = t + 300  # repeat_interval of the restarter route
        if hung_since is None:
            next_delivery = 0.0

        # The restarter: re-verification rounds, then the budget, then the restart.
        for job in list(verifying):
            if t < job["next"]:
                continue
            v = read(job["memory"], t, check_settings)
            job.update(memory=v.memory, reads=job["reads"] + 1, next=t + verify.interval)
            if not (_final(v.state) or job["reads"] >= rounds):
                continue
            verifying.remove(job)
            if v.state != "hung":
                decisions["not_hung"] += 1
                policy.finish("day", job["key"], False, t)
                continue
            refusal, _ = policy.claim("day", t)
            if refusal:
                decisions[refusal] += 1
                policy.finish("day", job["key"], False, t)
                continue
            hung = server.hung
            failed = server.restart(t)
            cascade_seen += failed
            restarts.append((t, job["by"], hung))
            recovering.append(job)
        for job in list(recovering):
            if t >= server.up_at and not server.busy:
                recovering.remove(job)
                policy.finish("day", job["key"], True, t)
        t += tick

    return {
        "false_restarts": sum(1 for _, _, hung in restarts if not hung),
        "true_restarts": sum(1 for _, _, hung in restarts if hung),
        "restarts": restarts,
        "decisions": decisions,
        "requests": requests,
        "probes": probes,
    }


def test_report1_day_through_the_restarter_has_no_false_restart():
    from llm_health.replay import DayPlan, replay

    plan = DayPlan()
    naive_alone = replay(plan, ("naive", "cascade"))
    assert naive_alone.false_restarts >= 3  # what the same watchdogs did on their own

    out = replay_through_restarter(plan)
    assert (out["false_restarts"], out["true_restarts"]) == (0, 1), out["restarts"]
    assert out["requests"]["naive watchdog"] >= 3  # the naive watchdog still asked, every time...
    assert out["decisions"]["not_hung"] >= 3  # ...and the re-verification found the server busy
    assert out["decisions"]["duplicate"] >= 1  # the second copy of each notification did nothing
    assert out["probes"]["to_busy"] == 0  # no request ever went to a server with work in flight
    (when, _, hung) = out["restarts"][0]
    assert hung and plan.hang_at < when <= plan.hang_at + 3 * 60
