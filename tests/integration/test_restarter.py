"""`llm-health restarter`: the Alertmanager webhook receiver, on loopback, against the
simulated fleet, with restart commands that are real processes.

Webhook bodies are the captured ones in tests/data/real-world/webhooks/, with their
alertname and labels rewritten to ours (tests/fixtures/webhooks.py). A restart command here is a real process
that appends a line to a marker file; the test applies its effect to the simulated server
(`server.restart(); sim.idle(server)`), as systemd would start a fresh vLLM.

The decision core (which alerts, idempotency keys, budget, cooldown, backoff) is tested
with tables and injected time in tests/unit/test_restart_policy.py; here a day with a
batch job and one real hang is replayed in simulated time with every restart request
going through that core and a re-verification.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config.restarter import TOKEN_ENV, RestarterConfig, Target, Verify, default_instance
from llm_health.core.restart_policy import Budget
from llm_health.restarter.app import Restarter
from llm_health.restarter.runner import run_command
from llm_health.sim import servers as sim
from tests.fixtures.webhooks import BODY_2447, MALFORMED, webhook_1051, webhook_2447, webhook_msteams

TOKEN = "test-token-5f2c9a0e71d4"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST_VERIFY = Verify(interval=0.2, hung_after_seconds=0.4, probe_timeout=0.5, metrics_timeout=2.0)
# Appends a line to the marker file (argv[1]) and says what it did, as systemctl would.
MARK = "import os, sys; open(sys.argv[1], 'a').write('restart\\n'); print('restarting', os.environ.get('LLM_HEALTH_BACKEND'))"


# --- helpers ------------------------------------------------------------------------------


def marker_target(name: str, server, marker: Path, **kw) -> Target:
    return Target(name, server.url, default_instance(server.url), restart=(sys.executable, "-c", MARK, str(marker)), **kw)


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
        r = Restarter(config, TOKEN, **kw)
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


# --- the receiver on loopback, against the simulated fleet ----------------------------------


async def test_hung_backend_is_restarted_once_and_comes_back(sim_server, ticker, restarter_client, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # present in the restarter's environment...
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    env_dump = tmp_path / "env.json"
    script = MARK + f"; import json; json.dump(dict(os.environ), open({str(env_dump)!r}, 'w'))"
    target = Target("gpu0", s.url, default_instance(s.url), restart=(sys.executable, "-c", script, str(marker)))
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
    assert TOKEN_ENV not in env and TOKEN not in json.dumps(env)  # ...never handed to the command
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
        (a,) = (await post_json(client, webhook_msteams(default_instance(s.url))))["alerts"]
        assert (a["alertname"], a["decision"], a["backend"]) == ("VLLMEngineHung", "accepted", "gpu0")
        action = await wait_done(client, a["action"])
    finally:
        await effect.stop()
    assert action["outcome"] == "recovered" and effect.lines() == 1


async def test_busy_backend_whose_alert_arrives_late_is_not_restarted(sim_server, ticker, restarter_client, tmp_path):
    """Busy and progressing is not hung; the re-verification sends it nothing."""
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
        answers = await asyncio.gather(post_json(client, body), post_json(client, body), post_json(client, webhook_msteams(default_instance(s.url))))
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
    target = Target("gpu0", s.url, default_instance(s.url), restart=("sleep", "60"), restart_timeout=0.3)
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
    result = await run_command(["sh", "-c", script], timeout=1.0, kill_grace=0.2)
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
    result = await run_command([sys.executable, "-c", loud], timeout=10, max_output_bytes=1000)
    assert (result.outcome, result.exit_code, result.truncated, result.output_bytes) == ("failed", 5, True, 100026)
    assert len(result.output) == 1000 and result.output.endswith("unit vllm@gpu0 not found\n")
    missing = await run_command(["/nonexistent/restart-vllm"], timeout=10)
    assert missing.outcome == "error" and "cannot start" in missing.detail


async def test_failed_restart_command_is_reported(sim_server, ticker, restarter_client):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    argv = (sys.executable, "-c", "print('Failed to restart vllm@gpu0.service: Unit not found.'); raise SystemExit(5)")
    _, client = await restarter_client(make_config(Target("gpu0", s.url, default_instance(s.url), restart=argv)))
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
        lb = Target("lb", proxy.url, default_instance(proxy.url), kind="proxy")
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
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llm_health",
        "restarter",
        "--config.file",
        str(cfg),
        "--web.listen-address",
        f"127.0.0.1:{port}",
        "--web.token-file",
        str(token_file),
        "--dry-run",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
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
    env = dict(os.environ)
    env.pop(TOKEN_ENV, None)
    out = subprocess.run(
        [sys.executable, "-m", "llm_health", "restarter", "--config.file", str(cfg)], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert out.returncode == 2 and TOKEN_ENV in out.stderr and "--web.token-file" in out.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text("backends:\n  - {name: gpu0, url: 'http://127.0.0.1:9', restart: 'systemctl restart vllm'}\n")
    out = subprocess.run(
        [sys.executable, "-m", "llm_health", "restarter", "--config.file", str(bad)],
        capture_output=True,
        text=True,
        env={**env, TOKEN_ENV: TOKEN},
        timeout=60,
        check=False,
    )
    assert out.returncode == 2 and f"{bad}: backends[0].restart" in out.stderr
