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
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config.restarter import TOKEN_ENV, Target, default_instance
from llm_health.core.restart_policy import Budget
from llm_health.restarter.runner import OutputFiles, run_command
from llm_health.sim import servers as sim
from tests.fixtures.ci import require
from tests.fixtures.restarter import AUTH, MARK, TOKEN, RestartEffect, make_config, marker_target, metrics, post, post_json, sample, status, wait_done
from tests.fixtures.webhooks import BODY_2447, MALFORMED, webhook_1051, webhook_2447, webhook_msteams


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
    assert action["outcome"] == "timeout" and "did not exit within 0.3s: killed (SIGTERM to pid" in action["detail"]
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


async def _until(predicate, timeout: float = 20.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return predicate()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


async def test_command_that_ignores_sigterm_is_killed_but_what_it_started_is_left_alone(tmp_path):
    pids = tmp_path / "pids"
    # sh starts in milliseconds (the timeout must not pass before the child exists). The
    # command itself ignores SIGTERM, so only SIGKILL ends it; its child may be the server
    # it was asked to start, and is never signalled.
    script = f'trap "" TERM; sleep 300 & echo $$ $! > {pids}; echo waiting; wait'
    result = await run_command(["sh", "-c", script], timeout=1.0, output_file=tmp_path / "out.log", kill_grace=0.2)
    leader, child = map(int, pids.read_text().split())
    try:
        assert result.outcome == "timeout" and "waiting" in result.output
        assert "SIGTERM, then SIGKILL after 0.2s" in result.detail and leader == result.pid
        assert await _until(lambda: _gone(leader))
        assert not _gone(child)  # still running
    finally:
        _kill(child)


@pytest.mark.parametrize("detach", ["", "setsid "])
async def test_a_server_started_in_the_background_is_the_command_exiting_0(tmp_path, detach):
    """`nohup vllm serve ... &`: the command exits at once, its server keeps the command's
    stdout. The restart is that exit (not a timeout), and the server is never killed, not
    even when it writes to the output after the command is gone (no pipe, no SIGPIPE)."""
    pids = tmp_path / "pids"
    server = "sleep 0.5; echo late-line; exec sleep 300"
    script = f"{detach}nohup sh -c '{server}' & echo $! > {pids}; echo started server"
    out = tmp_path / "restart.log"
    result = await run_command(["sh", "-c", script], timeout=30.0, output_file=out, kill_grace=0.2)
    child = int(pids.read_text())
    try:
        assert (result.outcome, result.exit_code) == ("ok", 0)
        assert result.seconds < 30.0  # its own exit, not the timeout
        assert "started server" in result.output and result.output_file == str(out)
        assert await _until(lambda: "late-line" in out.read_text())
        await asyncio.sleep(0.3)
        assert not _gone(child)  # wrote after the command ended, and lives on
    finally:
        _kill(child)


def test_a_background_server_survives_on_uvloop_too(tmp_path):
    """The restarter runs on uvloop where it is installed; a pipe there was closed as soon
    as the command exited, and the server it left died of SIGPIPE at its next write."""
    require(None if importlib.util.find_spec("uvloop") else "uvloop is not installed (pip install -e '.[gate]')")
    import uvloop

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(test_a_server_started_in_the_background_is_the_command_exiting_0(tmp_path, ""))
    finally:
        loop.close()


async def test_command_output_is_bounded_and_failures_reported(tmp_path):
    loud = "import sys; sys.stdout.write('x' * 100000); sys.stdout.write('\\nunit vllm@gpu0 not found\\n'); sys.exit(5)"
    result = await run_command([sys.executable, "-c", loud], timeout=10, output_file=tmp_path / "o.log", max_output_bytes=1000)
    assert (result.outcome, result.exit_code, result.truncated, result.output_bytes) == ("failed", 5, True, 100026)
    assert len(result.output) == 1000 and result.output.endswith("unit vllm@gpu0 not found\n")
    assert (tmp_path / "o.log").stat().st_mode & 0o077 == 0  # the output file is private
    missing = await run_command(["/nonexistent/restart-vllm"], timeout=10, output_file=tmp_path / "m.log")
    assert missing.outcome == "error" and "cannot start" in missing.detail


def test_output_files_are_kept_bounded_in_number_and_size(tmp_path):
    files = OutputFiles(tmp_path / "out", keep=2, max_bytes=1000)
    made = [files.new("gpu/0 x", i) for i in range(3)]
    for p in made[1:]:
        p.write_bytes(b"x" * 10)
    assert not made[0].exists() or made[0] not in files.files  # the oldest is forgotten
    assert all("/" not in p.name and " " not in p.name for p in made)
    made[2].write_bytes(b"y" * 5000)  # a server left running writes on
    files.enforce()
    assert made[2].stat().st_size == 0 and made[1].stat().st_size == 10
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o700


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
    _, client = await restarter_client(make_config(marker_target("gpu0", s, tmp_path / "m", drain_command=("/bin/true",))))
    text = await (await client.get("/metrics")).text()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert names == {
        "llm_restarter_restarts",
        "llm_restarter_refusals",
        "llm_restarter_recovery_seconds",
        "llm_restarter_budget_exhausted",
        "llm_restarter_drains",
        "llm_restarter_unread_alerts",
        "llm_restarter_incidents",
        "llm_restarter_capture_failures",
    }
    assert 'llm_restarter_drains_total{backend="gpu0",outcome="timeout"} 0.0' in text
    import shutil

    require(None if shutil.which("promtool") else "promtool is not installed (apt-get install prometheus)")
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
