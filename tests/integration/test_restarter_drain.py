"""The drain before a restart (restarter.drain): the restarter's `/-/ready?backend=NAME`
and the target's `drain_command`, on loopback against simulated servers, with drain and
restart commands that are real processes (Python scripts run as argv, no shell).

* a hung backend: `/-/ready` turns 503 once the hang is re-verified and stays so through
  the drain, the restart and the recovery; the drain runs first and the restart after it;
  both are in the action record;
* a drain that fails, outlives its `drain_timeout` (and ignores SIGTERM) or cannot start
  is recorded as such, and the restart still happens;
* a busy backend whose alert arrives is re-verified busy: never drained, `/-/ready`
  never 503.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from llm_health.config.restarter import Target, default_instance
from tests.fixtures.restarter import MARK, RestartEffect, make_config, metrics, post_json, sample, status, wait_done
from tests.fixtures.webhooks import webhook_2447

# Appends "drain <backend>" to argv[1], then waits until argv[2] exists (the test's hand on it).
DRAIN = (
    "import os, sys, time; open(sys.argv[1], 'a').write('drain ' + os.environ['LLM_HEALTH_BACKEND'] + '\\n'); "
    "print('drained', os.environ['LLM_HEALTH_BACKEND'], flush=True)\n"
    "while len(sys.argv) > 2 and not os.path.exists(sys.argv[2]): time.sleep(0.02)"
)
FAILS = "import sys; open(sys.argv[1], 'a').write('drain\\n'); print('lb said no', flush=True); sys.exit(3)"
STUCK = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open(sys.argv[1], 'a').write('drain\\n'); time.sleep(3600)"


def target(server, marker: Path, drain: tuple[str, ...], drain_timeout: float = 5.0) -> Target:
    return Target(
        "gpu0",
        server.url,
        default_instance(server.url),
        restart=(sys.executable, "-c", MARK, str(marker)),
        drain_command=drain,
        drain_timeout=drain_timeout,
    )


async def ready(client, backend: str = "gpu0") -> tuple[int, str]:
    resp = await client.get("/-/ready", params={"backend": backend})
    return resp.status, await resp.text()


async def test_drain_runs_first_and_ready_is_503_until_the_backend_is_back(sim_server, ticker, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker, drained, release = tmp_path / "restarts", tmp_path / "drains", tmp_path / "release"
    _, client = await restarter_client(make_config(target(s, marker, (sys.executable, "-c", DRAIN, str(drained), str(release)))))
    assert await ready(client) == (200, "gpu0: ready: no restart under way\n")
    effect = RestartEffect(marker, s)
    try:
        (a,) = (await post_json(client, webhook_2447(backend="gpu0")))["alerts"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not drained.exists():  # the drain has started: re-verified hung
            assert loop.time() < deadline, "the drain never ran"
            await asyncio.sleep(0.02)
        code, text = await ready(client)
        assert (code, text) == (503, f"gpu0: not ready: action {a['action']} is restarting it (draining)\n")
        st = await status(client)
        assert st["backends"][0]["ready"] is False and st["actions"][0]["phase"] == "draining"
        assert drained.read_text() == "drain gpu0\n" and not marker.exists()  # nothing restarted while the drain runs
        release.touch()
        phases = set()
        while True:
            code, _ = await ready(client)  # first: 200 only once the action is done
            action = next(x for x in (await status(client))["actions"] if x["id"] == a["action"])
            phases.add((action["phase"], code))
            if action["phase"] == "done":
                break
            assert code == 503 and loop.time() < deadline, (code, action)
            await asyncio.sleep(0.01)
    finally:
        await effect.stop()
    assert {p for p, _ in phases} & {"restarting", "recovering"}, phases  # polled through the restart, 503 all along
    assert (drained.read_text(), marker.read_text()) == ("drain gpu0\n", "restart\n")
    assert action["outcome"] == "recovered", action
    d = action["drain_result"]
    assert (d["outcome"], d["exit_code"], d["output"]) == ("ok", 0, "drained gpu0\n") and Path(d["output_file"]).name.startswith("drain-gpu0-")
    assert action["drain_command"][0] == sys.executable and action["drain_started_at"] <= action["command_started_at"]
    assert Path(d["output_file"]).stat().st_mode & 0o777 == 0o600
    assert await ready(client) == (200, "gpu0: ready: no restart under way\n")
    m = await metrics(client)
    assert sample(m, "llm_restarter_drains_total", backend="gpu0", outcome="ok") == 1
    assert sample(m, "llm_restarter_drains_total", backend="gpu0", outcome="failed") == 0


@pytest.mark.parametrize(
    "script,drain_timeout,outcome,detail",
    [
        (FAILS, 5.0, "failed", "exited 3"),
        (STUCK, 0.3, "timeout", "did not exit within 0.3s: killed (SIGTERM, then SIGKILL after 0.5s"),
        (None, 5.0, "error", "cannot start '/nonexistent/lb-drain'"),
    ],
    ids=["fails", "outlives its timeout", "cannot start"],
)
async def test_a_broken_drain_is_recorded_and_the_restart_still_happens(sim_server, ticker, restarter_client, tmp_path, script, drain_timeout, outcome, detail):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker, drained = tmp_path / "restarts", tmp_path / "drains"
    drain = ("/nonexistent/lb-drain", "gpu0") if script is None else (sys.executable, "-c", script, str(drained))
    _, client = await restarter_client(make_config(target(s, marker, drain, drain_timeout)))
    effect = RestartEffect(marker, s)
    try:
        (a,) = (await post_json(client, webhook_2447(backend="gpu0")))["alerts"]
        action = await wait_done(client, a["action"])
    finally:
        await effect.stop()
    assert (action["drain_result"]["outcome"], action["outcome"]) == (outcome, "recovered"), action
    assert detail in action["drain_result"]["detail"], action["drain_result"]
    assert marker.read_text() == "restart\n" and drained.exists() == (script is not None)
    if outcome == "failed":
        assert action["drain_result"]["output"] == "lb said no\n"
    assert sample(await metrics(client), "llm_restarter_drains_total", backend="gpu0", outcome=outcome) == 1
    assert (await ready(client))[0] == 200


async def test_a_busy_backend_is_never_drained(sim_server, ticker, restarter_client, tmp_path):
    """The alert of a backend that is busy by the time it arrives: re-verified busy, refused
    `not_hung`; the drain never runs and /-/ready never says 503 (polled all along)."""
    s = await sim_server(scenario="saturated")
    ticker.append(s)
    marker, drained = tmp_path / "restarts", tmp_path / "drains"
    _, client = await restarter_client(make_config(target(s, marker, (sys.executable, "-c", DRAIN, str(drained)))))
    (a,) = (await post_json(client, webhook_2447(backend="gpu0")))["alerts"]
    codes = set()
    while (action := next(x for x in (await status(client))["actions"] if x["id"] == a["action"]))["phase"] != "done":
        codes.add((await ready(client))[0])
        await asyncio.sleep(0.01)
    codes.add((await ready(client))[0])
    assert codes == {200}
    assert (action["refusal"], action["drain_result"]) == ("not_hung", None)
    assert not marker.exists() and not drained.exists()
    assert sample(await metrics(client), "llm_restarter_drains_total", backend="gpu0", outcome="ok") == 0


async def test_ready_names_and_dry_run(sim_server, ticker, restarter_client, tmp_path):
    """404 for a name not configured, 400 without one; open without the token (a load
    balancer's health check sends none). A dry run drains nothing and says it would."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker, drained = tmp_path / "restarts", tmp_path / "drains"
    _, client = await restarter_client(make_config(target(s, marker, (sys.executable, "-c", DRAIN, str(drained)))), dry_run=True)
    assert (await ready(client, "nope"))[0] == 404
    assert (await client.get("/-/ready")).status == 400
    (a,) = (await post_json(client, webhook_2447(backend="gpu0")))["alerts"]
    action = await wait_done(client, a["action"])
    assert action["outcome"] == "dry_run" and "would drain with [" in action["detail"] and action["drain_result"] is None
    assert not marker.exists() and not drained.exists() and (await ready(client))[0] == 200
    st = await status(client)
    assert st["backends"][0]["drain_command"][-1] == str(drained) and st["backends"][0]["drain_timeout"] == 5.0
    assert json.dumps(st).count("drain_command") >= 2
