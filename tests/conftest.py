"""Shared fixtures. Tests read the real payloads in place from ../shared/real-world/."""

from __future__ import annotations

import asyncio
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
