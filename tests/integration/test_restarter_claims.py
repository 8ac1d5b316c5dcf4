"""Claims of docs/restarts.md about the restarter, each on a restarter serving a real
loopback socket (a real `llm-health restarter` process where the claim is about the
process: its log, its listen address) against a simulated vLLM, with restart commands
that are real processes:

* the default listen address is loopback ("Quick start": `127.0.0.1:9120`);
* the token is never shown on /status, /metrics or in the log ("HTTP");
* nothing from an alert is ever put into a command, which gets exactly the configured
  argv and environment ("HTTP", "The restart command"), in a session of its own;
* a reload keeps the budgets and remembered alerts of backends that stay ("Quick start");
* `--dry-run` keeps the same books ("Budget semantics");
* a backend that does not come back ends `not_recovered` (the outcomes table).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from llm_health.config.restarter import TOKEN_ENV, Target, default_instance, load_config
from llm_health.core.restart_policy import Budget
from llm_health.core.webhook import fingerprint
from llm_health.sim import servers as sim
from llm_health.sim.servers import dead_url
from tests.fixtures.restarter import MARK, TOKEN, RestartEffect, make_config, marker_target, metrics, post_json, sample, status, wait_done
from tests.fixtures.webhooks import webhook_2447
from tests.fixtures.websec import DEADLINE, call, poll, restarter_config

# The restart command of these tests: writes what it was started with to the file argv[-1]:
# its whole argv as exec'd (/proc/self/cmdline, not Python's sys.argv), its environment,
# its pid, process group and session.
RECORD = (
    "import json, os, sys\n"
    "argv = [a.decode() for a in open('/proc/self/cmdline', 'rb').read().split(b'\\0')[:-1]]\n"
    "record = {'argv': argv, 'env': dict(os.environ), 'pid': os.getpid(), 'pgid': os.getpgid(0), 'sid': os.getsid(0)}\n"
    "json.dump(record, open(sys.argv[-1], 'w'))\n"
    "print('recorded')\n"
)
FAST = {"verify": {"interval": "200ms", "hung_after_seconds": 0.4, "probe_timeout": "500ms", "metrics_timeout": "2s"}}


async def record_a_restart(sim_server, ticker, restarter_client, tmp_path: Path, child_env: dict[str, str], edit=None) -> tuple[dict, dict, list[str]]:
    """One hung backend restarted by RECORD: (the action, what RECORD recorded, its argv).
    `edit(body)` may change the webhook body before it is posted."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    record = tmp_path / "record.json"
    argv = [sys.executable, "-c", RECORD, str(record)]
    target = Target("gpu0", s.url, default_instance(s.url), restart=tuple(argv))
    _, client = await restarter_client(make_config(target, recovery_timeout=0.5), child_env=child_env)
    body = webhook_2447(backend="gpu0")
    if edit is not None:
        edit(body)
    answer = await post_json(client, body)
    (action_id,) = [a["action"] for a in answer["alerts"] if a["decision"] == "accepted"]
    action = await wait_done(client, action_id)
    assert action["command_result"] is not None and action["command_result"]["exit_code"] == 0, action
    return action, json.loads(record.read_text()), argv


async def test_nothing_from_an_alert_is_ever_put_into_a_command(sim_server, ticker, restarter_client, tmp_path):
    """docs/restarts.md: "nothing from an alert is ever put into a command"; the command
    gets the restarter's environment without the token variable, plus LLM_HEALTH_BACKEND
    and LLM_HEALTH_BACKEND_URL."""
    pwned = tmp_path / "pwned"
    hostile = [
        f"$(touch {pwned}-1)",
        f"`touch {pwned}-2`",
        f"; touch {pwned}-3; rm -rf {pwned}-never",
        f"' ; touch {pwned}-4 ; '",
        f'" && touch {pwned}-5 && "',
        f"\ntouch {pwned}-6\n",
        f"| touch {pwned}-7 &",
        "${IFS}$LLM_HEALTH_BACKEND %s %n {backend}",
    ]

    def edit(body: dict) -> None:
        alert = body["alerts"][0]
        alert["labels"].update({f"inject{i}": text for i, text in enumerate(hostile)})
        alert["annotations"] = {"summary": hostile[0], "description": "\n".join(hostile), "evidence": hostile[2], "runbook_url": hostile[4]}
        alert["fingerprint"] = fingerprint(alert["labels"])
        # and one alert whose backend label itself is hostile: no backend of that name
        other = json.loads(json.dumps(alert))
        other["labels"]["backend"] = f"gpu0; touch {pwned}-8"
        other["fingerprint"] = fingerprint(other["labels"])
        body["alerts"].append(other)

    child_env = {"PYTHONCOERCECLOCALE": "0", "KEPT_BY_THE_TEST": "kept", TOKEN_ENV: TOKEN}
    action, record, argv = await record_a_restart(sim_server, ticker, restarter_client, tmp_path, child_env, edit)
    assert record["argv"] == argv and action["command"] == argv
    assert record["env"] == {
        "PYTHONCOERCECLOCALE": "0",
        "KEPT_BY_THE_TEST": "kept",
        "LLM_HEALTH_BACKEND": "gpu0",
        "LLM_HEALTH_BACKEND_URL": record["env"]["LLM_HEALTH_BACKEND_URL"],
    }
    assert record["env"]["LLM_HEALTH_BACKEND_URL"].startswith("http://127.0.0.1:")
    assert action["labels"]["inject0"] == hostile[0]  # the hostile alert is the one acted on
    await asyncio.sleep(0.3)  # anything started in the background by injected text would have run by now
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("pwned")) == []


async def test_the_command_runs_in_a_session_of_its_own(sim_server, ticker, restarter_client, tmp_path):
    """docs/restarts.md: the restart argv runs "without a shell, in a session of its own"."""
    _, record, _ = await record_a_restart(sim_server, ticker, restarter_client, tmp_path, {"PYTHONCOERCECLOCALE": "0"})
    assert record["sid"] == record["pid"] == record["pgid"]  # a session leader: setsid() was called
    assert record["sid"] != os.getsid(0)


async def test_the_token_is_never_shown_on_status_metrics_or_the_log(sim_server, ticker, llm_health, tmp_path):
    """docs/restarts.md: the token "is never logged, never shown on /status, and never
    passed to a restart command", on a real process at debug level; the command is `env`,
    whose output (the environment it got) is shown on /status."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    token = "claims-" + secrets.token_hex(20)
    out = tmp_path / "restart-output"
    config = {
        "restarter": {**FAST, "recovery_timeout": "1s", "recovery_interval": "100ms", "raw_alert_hold": "0s", "output_dir": str(out)},
        "backends": [{"name": "gpu0", "url": s.url, "restart": [sys.executable, "-c", "import os; [print(f'{k}={v}') for k, v in os.environ.items()]"]}],
    }
    cfg = tmp_path / "restarter.yml"
    cfg.write_text(yaml.safe_dump(config))
    proc = llm_health("restarter", "--config.file", str(cfg), "--log.level", "debug", env={TOKEN_ENV: token}).wait_ready()
    right = {"Authorization": f"Bearer {token}"}
    for wrong in ("Bearer " + token[:-1], "Bearer " + token + "x", "Basic " + token, token):
        assert (await call(proc.url + "/alerts", "POST", headers={"Authorization": wrong}, body=webhook_2447(backend="gpu0"))).status == 401
    bodies = [webhook_2447(backend="gpu0"), webhook_2447(backend="gpu0"), webhook_2447(backend="gpu9"), webhook_2447(alertname="Other")]
    answers = [(await call(proc.url + "/alerts", "POST", headers=right, body=b)).json() for b in bodies]
    assert [a["alerts"][0]["decision"] for a in answers] == ["accepted", "duplicate", "unknown_backend", "ignored"]
    action_id = answers[0]["alerts"][0]["action"]

    async def done() -> dict | None:
        st = (await call(proc.url + "/status", headers=right)).json()
        action = next(a for a in st["actions"] if a["id"] == action_id)
        return st if action["phase"] == "done" else None

    st = await poll(done, "the action done")
    (action,) = st["actions"]
    assert "LLM_HEALTH_BACKEND=gpu0" in action["command_result"]["output"], action  # the command ran and printed its environment
    status_text = (await call(proc.url + "/status", headers=right)).text
    metrics_text = (await call(proc.url + "/metrics")).text
    assert 'reason="unauthorised"} 4.0' in metrics_text
    proc.stop()
    log = proc.log.read_text(errors="replace")
    assert "gpu0: restarting:" in log and "wrong bearer token" in log  # the log was written, refusals included
    output_file = Path(action["command_result"]["output_file"]).read_text()
    for where, text in {"/status": status_text, "/metrics": metrics_text, "the log": log, "the command's output file": output_file}.items():
        assert token not in text, where


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = local.split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is in host order
            found.add((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return found


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_default_listen_address_is_loopback(tmp_path):
    """docs/restarts.md, "Quick start": `--web.listen-address` (default `127.0.0.1:9120`:
    loopback unless you say otherwise). Started without the flag, it listens there only."""
    deadline = time.monotonic() + DEADLINE
    while not _port_free(9120):  # another test's restarter may still be stopping
        assert time.monotonic() < deadline, "127.0.0.1:9120 is in use: this test needs the default port"
        time.sleep(0.2)
    cfg = restarter_config(tmp_path / "restarter.yml", ["gpu0"])
    log = tempfile.TemporaryFile()
    env = {**os.environ, TOKEN_ENV: TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "llm_health", "restarter", "--config.file", cfg], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + DEADLINE
        while not (found := _listening(proc.pid)):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise AssertionError(f"the restarter did not listen:\n{log.read().decode(errors='replace')}")
            time.sleep(0.1)
        assert found == {("127.0.0.1", 9120)}
        # 127.0.0.2 is loopback too, but not the address bound: refused
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", 9120), timeout=DEADLINE).close()
        with socket.create_connection(("127.0.0.1", 9120), timeout=DEADLINE) as s:
            s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


async def test_a_reload_keeps_the_budget_and_remembered_alerts_of_backends_that_stay(sim_server, ticker, restarter_client, tmp_path):
    """docs/restarts.md: "`POST /-/reload` or SIGHUP re-reads the file; budgets and
    remembered alerts of backends that stay are kept"."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    gpu0 = {"name": "gpu0", "url": s.url, "restart": [sys.executable, "-c", MARK, str(marker)]}
    base = {**FAST, "budget": {"max_restarts": 3, "window": "1h", "cooldown": "1h", "backoff": 2}, "recovery_interval": "100ms", "raw_alert_hold": "0s"}
    base["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "restarter.yml"
    path.write_text(yaml.safe_dump({"restarter": base, "backends": [gpu0]}))
    _, client = await restarter_client(load_config(path), config_file=path)
    effect = RestartEffect(marker, s)
    first = webhook_2447(backend="gpu0", starts_at="2024-05-01T10:00:00Z")
    try:
        (a,) = (await post_json(client, first))["alerts"]
        assert (await wait_done(client, a["action"]))["outcome"] == "recovered"
    finally:
        await effect.stop()
    # gpu0 stays (with a new restart_timeout), gpu1 comes in
    path.write_text(
        yaml.safe_dump({"restarter": base, "backends": [{**gpu0, "restart_timeout": "60s"}, {"name": "gpu1", "url": dead_url(), "restart": ["/bin/true"]}]})
    )
    resp = await client.post("/-/reload")
    assert resp.status == 200 and (await resp.json())["reloaded"] is True
    backends = {b["backend"]: b for b in (await status(client))["backends"]}
    assert sorted(backends) == ["gpu0", "gpu1"] and backends["gpu0"]["restart_timeout"] == 60  # the new file is in force
    assert (backends["gpu0"]["restarts_in_window"], backends["gpu0"]["budget"]) == (1, "cooldown")
    assert backends["gpu1"]["restarts_in_window"] == 0
    again = (await post_json(client, first))["alerts"][0]
    assert again["decision"] == "duplicate", again
    sim.hang(s)
    (later,) = (await post_json(client, webhook_2447(backend="gpu0", starts_at="2024-05-01T10:10:00Z")))["alerts"]
    action = await wait_done(client, later["action"])
    assert (action["refusal"], action["verification"]["state"]) == ("cooldown", "hung")
    assert effect.lines() == 1


@pytest.mark.parametrize(
    "budget,refusal",
    [
        (Budget(max_restarts=1, window=3600, cooldown=0.05, backoff=1), "budget_spent"),
        (Budget(max_restarts=3, window=3600, cooldown=3600, backoff=2), "cooldown"),
    ],
    ids=["budget_spent", "cooldown"],
)
async def test_dry_run_keeps_the_same_books(sim_server, ticker, restarter_client, tmp_path, budget, refusal):
    """docs/restarts.md: "A dry-run "restart" spends the budget, so the report shows exactly
    what a real run would have done, cooldowns and exhaustion included"."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "restarts"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), budget=budget), dry_run=True)
    (a,) = (await post_json(client, webhook_2447(backend="gpu0", starts_at="2024-05-01T10:00:00Z")))["alerts"]
    assert (await wait_done(client, a["action"]))["outcome"] == "dry_run"
    await asyncio.sleep(0.1)  # past the short cooldown
    (b,) = (await post_json(client, webhook_2447(backend="gpu0", starts_at="2024-05-01T10:05:00Z")))["alerts"]
    second = await wait_done(client, b["action"])
    assert (second["refusal"], second["outcome"], second["verification"]["state"]) == (refusal, None, "hung")
    (backend,) = (await status(client))["backends"]
    assert backend["restarts_in_window"] == 1
    m = await metrics(client)
    assert sample(m, "llm_restarter_refusals_total", reason=refusal) == 1
    assert sample(m, "llm_restarter_budget_exhausted", backend="gpu0") == (1 if refusal == "budget_spent" else 0)
    assert not marker.exists()  # nothing was run


async def test_a_backend_that_stays_hung_is_not_recovered(sim_server, ticker, restarter_client):
    """docs/restarts.md, the outcomes: `not_recovered`: exit 0, but the backend did not come
    back in time (`recovery_timeout`)."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    target = Target("gpu0", s.url, default_instance(s.url), restart=(sys.executable, "-c", "print('restarted nothing')"))
    _, client = await restarter_client(make_config(target, recovery_timeout=0.5))
    (a,) = (await post_json(client, webhook_2447(backend="gpu0")))["alerts"]
    action = await wait_done(client, a["action"])
    assert (action["outcome"], action["command_result"]["exit_code"], action["recovery_seconds"]) == ("not_recovered", 0, None)
    assert action["recovery_state"] not in ("idle", "busy") and "not back after 0.5s" in action["detail"]
    m = await metrics(client)
    assert sample(m, "llm_restarter_restarts_total", backend="gpu0", outcome="not_recovered") == 1
    assert sample(m, "llm_restarter_restarts_total", backend="gpu0", outcome="recovered") == 0
    assert sample(m, "llm_restarter_recovery_seconds", backend="gpu0") is None
    assert (await status(client))["backends"][0]["restarts_in_window"] == 1  # any outcome spends the budget
