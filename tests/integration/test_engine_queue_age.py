"""The engine's queue age published to Redis by `llm-health serve` (core.queue_age,
exporter.redis_view), on every Redis deployment (tests/fixtures/redis_any.py): the key
the doors read appears, tracks the figure, is deleted while the figure is unknown (a
restarted engine with a queue, a backend down) and expires once the exporter stops.
Failure bounds only: no test asserts a wall-clock time."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from prometheus_client import generate_latest

from llm_health.config.exporter import Backend, Config, Timing
from llm_health.config.redis import parse_redis_config
from llm_health.exporter.app import Exporter
from llm_health.sim import servers as sim
from llm_health.store.deployment import connect

T = Timing(interval=0.2, hung_after_seconds=5.0, probe_interval=60, probe_timeout=0.5, metrics_timeout=1.0, models_timeout=1.0)


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    return any_redis_url


async def eventually(predicate: Any, what: str, bound_s: float = 15.0) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while True:
        got = await predicate()
        if got:
            return got
        if loop.time() > end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.02)


async def test_engine_queue_age_key_appears_tracks_goes_on_unknown_and_expires(sim_server, ticker, redis_url, redis_kind):
    busy = await sim_server("busy", scenario="overloaded")  # 3 requests a second arrive, 2 are served
    steady = await sim_server("steady", scenario="idle")
    ticker.extend([busy, steady])
    config = Config(
        timing=T,
        backends=(Backend("busy", busy.url, "vllm", T), Backend("steady", steady.url, "vllm", T), Backend("router", steady.url, "proxy", T)),
        redis=parse_redis_config({"url": redis_url, "routes": ["chat"]}, "test.yaml"),
    )
    prefix = "{llm:admission}:" if redis_kind == "cluster" else "llm:admission:"  # Cluster: the queue's hash tag
    key = {name: f"{prefix}engine:{name}:queue_age_ms" for name in ("busy", "steady", "router")}
    checker = connect(redis_url, socket_timeout=2.0)
    r = checker.client
    exporter = Exporter(config)
    await exporter.start()
    try:

        async def get(name: str) -> str | None:
            value = await r.get(key[name])
            return None if value is None else value.decode() if isinstance(value, bytes) else str(value)

        async def aged() -> bool:
            value = await get("busy")
            return value is not None and int(value) >= 1000

        await eventually(aged, "the overloaded engine's queue age reached 1 s in Redis")
        assert await get("steady") == "0"  # nothing waits: 0, known
        assert await get("router") is None  # a proxy has no engine queue: nothing published
        assert 0 < await r.pttl(key["busy"]) <= 3000  # 3 rounds of 0.2 s, at least 3 s
        # It tracks the figure: what Redis holds is a figure the exporter held in a round
        # around the read (not a monotone one: when the head is served the next is younger).
        figures = []
        for _ in range(20):  # the rounds of the last second (the publication is at most one old)
            figures.append((await exporter_status(exporter, "busy"))["queue_age_ms"])
            await asyncio.sleep(0.05)
        published = int(await get("busy") or 0)
        figures.append((await exporter_status(exporter, "busy"))["queue_age_ms"])
        assert None not in figures and min(figures) - 1 <= published <= max(figures) + 1, (published, figures)
        # Beside it, the waiting and running counts and when they were read, on the doors'
        # clock (Unix ms): what a door reads its own figure with (core.queue_age.door_age).
        waiting, running, read_ms, slots = (int(x) for x in (await r.get(key["busy"].replace("queue_age_ms", "waiting"))).split())
        assert waiting > 0 and running >= 0 and abs(read_ms / 1000 - time.time()) < 5, (waiting, running, read_ms)
        assert slots >= running, (slots, running)  # the most it ran at once, this read's count included
        # An engine never found full: what it runs when full is not known, S 0 (no wait projected).
        never_full = (await r.get(key["steady"].replace("queue_age_ms", "waiting"))).split()
        assert [never_full[0], never_full[3]] in (["0", "0"], [b"0", b"0"]), never_full
        assert await r.get(key["router"].replace("queue_age_ms", "waiting")) is None

        # A restart with requests already waiting: their arrival is unknown, so is the age.
        busy.restart()
        sim.overloaded(busy, arrivals_per_second=0.0)
        busy.engines[0].waiting = 8

        async def deleted_on_unknown() -> bool:
            return exporter.slots["busy"].monitor.queue_ages.backend is None and await get("busy") is None

        await eventually(deleted_on_unknown, "the key deleted while the restarted engine's age is unknown")

        async def known_again() -> bool:
            return await get("busy") is not None

        await eventually(known_again, "the key back once the restarted engine's queue was served past its first read")

        # A backend that is down: unknown, the key deleted.
        await steady.stop()

        async def steady_gone() -> bool:
            return await get("steady") is None

        await eventually(steady_gone, "the key of a backend that is down deleted")
        assert exporter.redis_view.publish_failures == 0
    finally:
        await exporter.stop()
    # The exporter stopped: nothing renews the key, it expires within its 3 s.
    assert await r.pttl(key["busy"]) <= 3000

    async def expired() -> bool:
        return await get("busy") is None

    await eventually(expired, "the key expired after the exporter stopped")
    await checker.aclose()


async def exporter_status(exporter: Exporter, backend: str) -> dict[str, Any]:
    body = exporter.status_body()
    return next(b for b in body["backends"] if b["backend"] == backend)


async def test_a_redis_that_is_down_is_counted_and_does_not_hold_the_rounds(sim_server, ticker):
    busy = await sim_server("busy", scenario="overloaded")
    ticker.append(busy)
    dead = sim.dead_url().replace("http://", "redis://")  # nothing listens: refused at once
    config = Config(timing=T, backends=(Backend("busy", busy.url, "vllm", T),), redis=parse_redis_config({"url": dead, "routes": ["chat"]}, "test.yaml"))
    exporter = Exporter(config)
    await exporter.start()
    try:

        async def counted() -> bool:
            return exporter.redis_view.publish_failures >= 3

        await eventually(counted, "failed publications counted")
        rounds = exporter.slots["busy"].monitor.rounds

        async def rounds_go_on() -> bool:
            return exporter.slots["busy"].monitor.rounds >= rounds + 5 and exporter.slots["busy"].monitor.queue_ages.backend is not None

        await eventually(rounds_go_on, "the backend's rounds and its figure going on without Redis")
        assert not exporter.redis_view.up
        text = generate_latest(exporter.registry).decode()
        failures = [line for line in text.splitlines() if line.startswith("llm_redis_engine_age_publish_failures_total ")]
        assert failures and float(failures[0].split()[1]) >= 3
        # the figure itself is still exported and in /status while Redis is down
        assert 'llm_backend_queue_age_seconds{backend="busy"}' in text
    finally:
        await exporter.stop()
