"""`llm-health check` against simulated vLLM servers on loopback: idle, busy, hung, restarted, a proxy, a dead backend and more.

Every test also proves the rule the product stands on: no completion is ever sent to a
server with work in flight (the simulator logs every request with the work it found).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from llm_health.probe.check import run_check
from llm_health.sim import servers as sim

FAST = {"interval": 0.3, "hung_after": 0.6, "probe_timeout": 0.5, "metrics_timeout": 2.0}


async def check(url, **kw):
    return await run_check(url, **{**FAST, **kw})


async def test_idle_one_probe(sim_server):
    s = await sim_server(scenario="idle")
    r = await check(s.url)
    assert (r["state"], r["exit_code"], r["probes_sent"]) == ("idle", 0, 1)
    assert [x.path for x in s.received] == ["/v1/completions"]


async def test_saturated_twelve_running_no_probe(sim_server, ticker):
    """12 running (the limit) plus waiting: busy, at ~126 tokens/s, no request sent."""
    s = await sim_server(scenario="saturated")
    ticker.append(s)
    r = await check(s.url)
    assert (r["state"], r["exit_code"], r["running"], r["waiting"]) == ("busy", 0, 12, 3)
    assert r["probe_sent"] is False and s.received == []
    assert r["generation_tokens_per_second"] > 0 and r["steps_per_second"] > 0


async def test_batch_job_8_tokens_per_second_is_busy(sim_server, ticker):
    s = await sim_server(scenario="batch")
    ticker.append(s)
    r = await check(s.url)
    assert r["state"] == "busy" and s.received == []


async def test_v1_long_prefill_is_not_hung(sim_server, ticker):
    """Only KV usage moves during a V1 chunked prefill: still progress."""
    s = await sim_server(scenario="long_prefill")
    ticker.append(s)
    steps_before = s.engines[0].steps
    r = await check(s.url, rounds=6)
    assert r["state"] == "busy" and s.received == []
    assert s.engines[0].steps == steps_before  # the step count really did not move


async def test_hung_with_requests_running(sim_server, ticker):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    r = await check(s.url)
    assert (r["state"], r["exit_code"], r["rounds"]) == ("hung", 1, 3)
    assert s.received == []


async def test_hung_with_only_waiting(sim_server, ticker):
    """vLLM #39863: engine died silently, running 0, waiting 3."""
    s = await sim_server(scenario="hung_waiting")
    ticker.append(s)
    r = await check(s.url)
    assert (r["state"], r["running"], r["waiting"]) == ("hung", 0, 3)
    assert s.received == []


async def test_hung_while_idle_two_failed_probes(sim_server):
    s = await sim_server(scenario="idle")
    s.probe_hangs = True
    r = await check(s.url)
    assert (r["state"], r["exit_code"], r["probes_sent"]) == ("hung", 1, 2)
    assert "did not answer" in r["reason"]


async def test_restarted_between_rounds(sim_server, ticker):
    s = await sim_server(scenario="batch")
    ticker.append(s)

    async def restart_after_first_read():
        while s.metrics_reads < 1:
            await asyncio.sleep(0.01)
        s.restart()
        sim.idle(s)

    task = asyncio.create_task(restart_after_first_read())
    r = await check(s.url)
    await task
    assert (r["state"], r["exit_code"]) == ("restarted", 0)
    assert r["probes_sent"] == 1  # the restarted, idle server is asked for a response
    assert s.completions_while_busy() == []


async def test_restart_without_start_time(sim_server, ticker):
    """Multiprocess mode has no process_start_time_seconds: counters going back show the restart."""
    s = await sim_server(scenario="batch")
    s.multiprocess = True
    s.engines[0].advance(100)  # counters well above a fresh process's
    ticker.append(s)

    async def restart_after_first_read():
        while s.metrics_reads < 1:
            await asyncio.sleep(0.01)
        s.restart(keep_start_time=True)
        sim.batch_job(s)

    task = asyncio.create_task(restart_after_first_read())
    r = await check(s.url)
    await task
    assert r["state"] == "restarted" and "backwards" in r["reason"]
    assert s.received == []


async def test_sleeping_is_healthy(sim_server, ticker):
    s = await sim_server(scenario="sleeping")
    s.engines[0].waiting = 2
    ticker.append(s)
    r = await check(s.url)
    assert (r["state"], r["exit_code"]) == ("sleeping", 0)
    assert s.received == []


async def test_paused_endpoint(sim_server, ticker):
    s = await sim_server(scenario="hung")
    s.paused = True
    ticker.append(s)
    r = await check(s.url)
    assert (r["state"], r["exit_code"]) == ("paused", 0)


async def test_one_dp_engine_hung_while_sibling_runs(sim_server, ticker):
    s = await sim_server(engines=2, scenario="saturated")
    sim.hang(s, engine=0)
    ticker.append(s)
    r = await check(s.url)
    assert (r["state"], r["exit_code"]) == ("hung", 1)
    assert {e["engine"]: e["state"] for e in r["engines"]} == {"0": "hung", "1": "busy"}
    assert s.received == []


async def test_server_without_metrics(sim_server):
    s = await sim_server(scenario="idle")
    s.metrics_mode = "404"
    r = await check(s.url)
    assert (r["state"], r["exit_code"]) == ("no_metrics", 3)
    assert s.received == []  # liveness from /v1/models only


@pytest.mark.parametrize("mode", ["html", "garbage", "huge"])
async def test_bad_metrics_payloads(sim_server, mode):
    s = await sim_server(scenario="idle")
    s.metrics_mode = mode
    r = await check(s.url)
    assert r["state"] == "no_metrics"
    assert r["exit_code"] == 3


async def test_slow_metrics_is_not_down(sim_server):
    """A /metrics that answers later than the timeout (a starved API server) is evidence of load, not of death."""
    s = await sim_server(scenario="saturated")
    s.metrics_mode, s.slow_seconds = "slow", 5.0
    r = await check(s.url, metrics_timeout=0.3, rounds=1)
    assert (r["state"], r["exit_code"]) == ("unknown", 3)
    assert "slow read is load" in r["reason"]


async def test_proxy_checked_only_through_models(sim_server):
    a = await sim_server("a", scenario="saturated")
    b = await sim_server("b", scenario="idle")
    proxy = sim.SimProxy("p", [a, b])
    await proxy.start()
    try:
        r = await check(proxy.url, kind="proxy")
    finally:
        await proxy.stop()
    assert (r["state"], r["exit_code"]) == ("up", 0)
    assert proxy.metrics_reads == 0 and proxy.models_reads == 1
    assert a.received == [] and b.received == []


async def test_dead_backend():
    r = await check(sim.dead_url())
    assert (r["state"], r["exit_code"]) == ("down", 2)
    assert "refused" in r["reason"]


async def test_url_with_v1_suffix(sim_server):
    s = await sim_server(scenario="idle")
    r = await check(s.url + "/v1/")
    assert r["state"] == "idle" and r["url"] == s.url


async def test_api_key_sent_and_never_printed(sim_server, tmp_path):
    s = await sim_server(scenario="idle", api_key="sk-secret-123")
    key = tmp_path / "key"
    key.write_text("sk-secret-123\n")
    code, out, err = await _cli("check", s.url, "--json", "--interval", "0.2", "--api-key-file", str(key))
    assert code == 0 and json.loads(out)["state"] == "idle"
    assert "sk-secret" not in out + err
    # without the key nothing can be probed (401): no evidence either way, never hung
    code, out, _ = await _cli("check", s.url, "--json", "--interval", "0.2")
    r = json.loads(out)
    assert (code, r["state"], r["probes_sent"]) == (0, "idle", 0)
    assert "HTTP 401" in r["reason"]


async def _cli(*args, env=None):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llm_health",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode(), err.decode()


async def test_cli_exit_codes(sim_server, ticker):
    idle = await sim_server("idle", scenario="idle")
    busy = await sim_server("busy", scenario="saturated")
    hung = await sim_server("hung", scenario="hung")
    ticker.extend([busy, hung])
    fast = ["--interval", "0.3", "--hung-after", "0.6", "--json"]
    for url, code, state in ((idle.url, 0, "idle"), (busy.url, 0, "busy"), (hung.url, 1, "hung"), (sim.dead_url(), 2, "down")):
        rc, out, err = await _cli("check", url, *fast)
        assert rc == code, err
        assert json.loads(out)["state"] == state
    nometrics = await sim_server("nm", scenario="idle")
    nometrics.metrics_mode = "404"
    rc, out, _ = await _cli("check", nometrics.url, *fast)
    assert rc == 3
    rc, out, _ = await _cli("check", idle.url, "--interval", "0.3")  # plain text line
    assert rc == 0 and out.startswith("idle: ")
    assert busy.received == [] and hung.received == []


async def test_cli_rejects_bad_arguments():
    # A usage error is "cannot run" (4): never 1 (hung) nor 2 (down), on which a watchdog acts.
    rc, _, err = await _cli("check", "http://127.0.0.1:1", "--interval", "-1")
    assert rc == 4 and "--interval" in err
    # A URL that is no server's address is "cannot run" too, named, never "down".
    for url, why in (("ftp://gpu0", "not an http(s) URL"), ("gpu0:8000", "not an http(s) URL"), ("http://", "no host"), ("http://u:p@gpu0", "credentials")):
        rc, _, err = await _cli("check", url, "--rounds", "1")
        assert rc == 4 and why in err, (url, err)
        assert "u:p" not in err


async def test_gzip_payload_is_read(sim_server, ticker):
    s = await sim_server(scenario="saturated")
    s.metrics_mode = "gzip"
    ticker.append(s)
    r = await check(s.url)
    assert r["state"] == "busy"


async def test_gzip_bomb_is_capped_after_decompression(sim_server):
    s = await sim_server(scenario="idle")
    s.metrics_mode = "gzip_bomb"
    r = await check(s.url)
    assert r["state"] == "no_metrics" and "larger than" in r["reason"]


async def test_half_open_backend_is_down_after_both_timeouts():
    """A server that accepts connections and never answers: down only once both endpoints timed out."""
    writers = []

    async def silent(reader, writer):
        writers.append(writer)
        await asyncio.sleep(3600)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        r = await check(f"http://127.0.0.1:{port}", metrics_timeout=0.5, rounds=1)
    finally:
        for w in writers:
            w.close()
        server.close()
    assert (r["state"], r["exit_code"]) == ("down", 2)
    assert "timeout" in r["reason"]
