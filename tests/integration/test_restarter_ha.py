"""Two restarters (real `llm-health restarter` processes) sharing a real redis-server,
behind a clustered pair of real Alertmanagers (`--cluster.listen-address` on loopback,
each delivering to both restarters), and one hang: exactly one restart. Then the
restarter that acted is killed with SIGKILL and started again: it keeps the budget.

The backend is a simulated vLLM on loopback whose hang is frozen counters with work in
flight; the restart command is a real process that appends to a marker file, which the
test applies to the simulated server (a fresh process, idle). The Alertmanager
configuration is rules/alertmanager.example.yml with the restarter receiver pointed at
both restarters.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from llm_health.config.restarter import default_instance
from llm_health.sim import servers as sim
from tests.fixtures.paths import RULES
from tests.fixtures.restarter import MARK, TOKEN, RestartEffect
from tests.fixtures.stack import free_port, start_alertmanager, wait_until
from tests.fixtures.summary import show
from tests.integration.test_restarter_evidence import evidence_of

pytestmark = pytest.mark.stack


def _get(url: str, token: str | None = None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


class Restarter:
    def __init__(self, config: Path, token_file: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            sys.executable,
            "-m",
            "llm_health",
            "restarter",
            "--config.file",
            str(config),
            "--web.listen-address",
            f"127.0.0.1:{self.port}",
            "--web.token-file",
            str(token_file),
        ]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_until(lambda: urllib.request.urlopen(self.url + "/-/healthy", timeout=2).status == 200, timeout=60, what=f"restarter on {self.port}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def status(self) -> dict:
        return _get(self.url + "/status", TOKEN)


def _am_config(restarters: list[Restarter], token_file: Path) -> str:
    am = yaml.safe_load((RULES / "alertmanager.example.yml").read_text())
    (receiver,) = [r for r in am["receivers"] if r["name"] == "restarter"]
    (hook,) = receiver["webhook_configs"]
    hooks = []
    for r in restarters:
        h = json.loads(json.dumps(hook))
        h["url"] = r.url + "/alerts"
        h["http_config"]["authorization"]["credentials_file"] = str(token_file)
        hooks.append(h)
    receiver["webhook_configs"] = hooks
    return yaml.safe_dump(am, sort_keys=False)


def _alert(server: sim.SimServer, starts_at: str, exporter: str = "exporter-a:9118") -> dict:
    return {
        "labels": {"alertname": "LLMBackendHung", "severity": "critical", "job": "llm-health", "instance": exporter, "backend": "gpu0", "state": "hung"},
        "annotations": {"summary": "hung", "evidence": evidence_of(server)},
        "startsAt": starts_at,
    }


def _duplicates_exposed(r: Restarter) -> float:
    """llm_restarter_refusals_total{reason="duplicate"} on the restarter's /metrics."""
    text = urllib.request.urlopen(r.url + "/metrics", timeout=5).read().decode()
    (value,) = re.findall(r'^llm_restarter_refusals_total\{reason="duplicate"\} (\S+)$', text, re.M)
    return float(value)


def _restarts(restarters: list[Restarter]) -> list[dict]:
    return [a for r in restarters for a in r.status()["actions"] if a["command_result"]]


async def _until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def test_two_restarters_behind_clustered_alertmanagers_restart_once_and_keep_the_budget(sim_server, ticker, tmp_path, redis_url):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    config = {
        "restarter": {
            "budget": {"max_restarts": 1, "window": "1h", "cooldown": "1m"},
            "verify": {"interval": "0.2s", "hung_after_seconds": "0.4s", "probe_timeout": "0.5s", "metrics_timeout": "2s"},
            "confirm_interval": "0.3s",
            "recovery_interval": "0.1s",
            "recovery_timeout": "20s",
            "output_dir": str(tmp_path / "outputs"),
        },
        "redis": {"url": redis_url, "lease_ttl": "5s"},
        "backends": [{"name": "gpu0", "url": s.url, "instance": default_instance(s.url), "restart": [sys.executable, "-c", MARK, str(marker)]}],
    }
    config_file = tmp_path / "restarter.yml"
    config_file.write_text(yaml.safe_dump(config))
    restarters = [Restarter(config_file, token_file, tmp_path / f"restarter-{i}.log") for i in range(2)]
    ams = []
    effect = RestartEffect(marker, s)
    try:
        for r in restarters:
            await asyncio.to_thread(r.start)
        p1, p2 = free_port(), free_port()
        text = _am_config(restarters, token_file)
        ams.append(await asyncio.to_thread(start_alertmanager, tmp_path, text, p1, (p2,)))
        ams.append(await asyncio.to_thread(start_alertmanager, tmp_path, text, p2, (p1,)))
        await _until(lambda: all(len(_get(am.url + "/api/v2/status")["cluster"]["peers"]) == 2 for am in ams), what="the Alertmanager cluster to form")

        # One hang: Prometheus sends its alert to every Alertmanager.
        first = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for am in ams:
            await asyncio.to_thread(am.post_alerts, [_alert(s, first)])
        await _until(lambda: effect.lines() == 1 and any(a["phase"] == "done" for a in _restarts(restarters)), what="a restart")
        # The second Alertmanager of the pair sends after its peer position's wait
        # (15 s) unless the first one's notification reached it: wait that out.
        await asyncio.sleep(20)
        done = _restarts(restarters)
        assert effect.lines() == 1 and len(done) == 1 and done[0]["outcome"] == "recovered", done
        # Each Alertmanager delivers to both restarters: the replica that did not act got the
        # same alert (fingerprint, startsAt) too, and refused it as a duplicate (the lease of
        # the replica acting, or the alert's done key once it had acted). It acted on nothing.
        statuses = [r.status() for r in restarters]
        (acted_i,) = [i for i, st in enumerate(statuses) if any(a["command_result"] for a in st["actions"])]
        other = statuses[1 - acted_i]
        key = (done[0]["fingerprint"], done[0]["starts_at"])
        refused = [x for st in statuses for x in st["refused"]]
        assert refused, "no delivery but the one acted on reached a restarter"
        assert all(x["reason"] == "duplicate" and (x["fingerprint"], x["startsAt"]) == key for x in refused), refused
        second = [x for x in other["refused"] if (x["fingerprint"], x["startsAt"]) == key]
        assert second, f"the second restarter never received the alert: {other['refused']}"
        assert all(x["alertname"] == "LLMBackendHung" and x["backend"] == "gpu0" for x in second), second
        assert other["actions"] == [], other["actions"]
        for r, st in zip(restarters, statuses):  # counted as well as recorded: /status, then /metrics
            assert st["refusals"]["duplicate"] == sum(1 for x in st["refused"] if x["reason"] == "duplicate"), st
            exposed = _duplicates_exposed(r)
            assert st["refusals"]["duplicate"] <= exposed <= r.status()["refusals"]["duplicate"], exposed  # a late delivery may come between
        assert _duplicates_exposed(restarters[1 - acted_i]) >= 1
        show(f"HA: one hang, {1 + len(refused)} deliveries to two restarters from two clustered Alertmanagers, 1 restart, {len(refused)} refused as duplicates")

        # The restarter that acted dies with SIGKILL mid-budget, and starts again.
        acted = next(r for r in restarters if r.status()["actions"] and r.status()["actions"][0]["command_result"])
        acted.kill()
        await asyncio.to_thread(acted.start)
        assert acted.status()["backends"][0]["restarts_in_window"] == 1  # it finds the restart it made
        # The fresh server hangs again, seen by a second exporter replica (a new alert, sent
        # at once: Alertmanager holds a repeat of the first for its group_interval). The
        # budget is one restart an hour: refused.
        sim.hang(s)
        second = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for am in ams:
            await asyncio.to_thread(am.post_alerts, [_alert(s, second, exporter="exporter-b:9118")])

        def refused_for_budget() -> bool:
            return any(x["reason"] == "budget_spent" for r in restarters for x in r.status()["refused"])

        await _until(refused_for_budget, what="the budget refusal")
        assert effect.lines() == 1
        exhausted = [r for r in restarters if any(x["reason"] == "budget_spent" for x in r.status()["refused"])]
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(exhausted[0].url + "/metrics", timeout=5).read().decode())
        assert 'llm_restarter_budget_exhausted{backend="gpu0"} 1.0' in text
    finally:
        await effect.stop()
        for am in ams:
            am.stop()
        for r in restarters:
            r.stop()
