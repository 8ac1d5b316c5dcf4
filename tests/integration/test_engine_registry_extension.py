"""A test engine made for the purpose, "ticker", registered at run time with its profile
(core.engines.register) and its simulation (sim.engines.register), both defined here and
nowhere else: the product tells its payload from the others, reads it through the profile
into a Reading, gives it verdicts through core.health, and the simulator serves it, read
over HTTP by the exporter's own monitor (probe.monitor), its restart shown by its start
header. Nothing outside the engines' room names it: adding an engine is its profile and
its simulation (docs/architecture.md, "Adding an engine"). Removed again, the product
no longer knows it."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest

from llm_health.core import engines
from llm_health.core.engines import Profile, UnknownEngine
from llm_health.core.health import Settings
from llm_health.core.states import State
from llm_health.probe.client import BackendClient
from llm_health.probe.monitor import BackendMonitor
from llm_health.sim import engines as sim_engines
from llm_health.sim import servers as sim
from llm_health.sim.engines import OpenAIFlavor, Served, StepEngine

TICKER = Profile(
    name="ticker",
    title="Ticker",
    prefix="ticker_",
    marker="ticker_slots_busy",
    running=("ticker_slots_busy",),
    waiting=("ticker_queue_length",),
    steps="ticker_passes_total",
    generation_tokens="ticker_tokens_total",
    counters=("ticker_passes_total", "ticker_tokens_total"),
    gauges=("ticker_slots_busy", "ticker_queue_length"),
    unit_labels=("model",),
    start_header="Ticker-Started-Us",
)


class TickerSim(OpenAIFlavor):
    kind = "ticker"
    profile = TICKER

    def make_engines(self, count: int, max_model_len: int) -> list:
        return [StepEngine(engine="", max_model_len=max_model_len) for _ in range(count)]

    def payload(self, server: Served) -> str:
        (e,) = server.engines
        assert isinstance(e, StepEngine)
        lab = f'model="{server.model}"'
        return "".join(
            f"# TYPE {name} {typ}\n{name}{{{lab}}} {value}\n"
            for name, typ, value in (
                ("ticker_slots_busy", "gauge", e.running),
                ("ticker_queue_length", "gauge", e.waiting),
                ("ticker_passes_total", "counter", e.steps),
                ("ticker_tokens_total", "counter", e.generation_tokens),
            )
        )

    def metrics_headers(self, server: Served) -> dict[str, str]:
        return {**super().metrics_headers(server), "Ticker-Started-Us": str(server.start_us)}


@pytest.fixture
def ticker():
    before = (list(engines.PROFILES), engines.payload_names().names)
    engines.register(TICKER)
    sim_engines.register(TickerSim)
    try:
        yield
    finally:
        engines.unregister("ticker")
        sim_engines.unregister("ticker")
    assert (list(engines.PROFILES), engines.payload_names().names) == before  # the set: the compiled object is cached, not kept


def payload(scenario=sim.saturated) -> str:
    s = sim.SimServer("t", kind="ticker", model="m")
    scenario(s)
    s.advance(5)
    return s.payload()


def test_an_engine_not_registered_is_unknown():
    with pytest.raises(ValueError, match="kind 'ticker'"):
        sim.SimServer("t", kind="ticker")
    sim_engines.register(TickerSim)
    try:
        text = payload()
    finally:
        sim_engines.unregister("ticker")
    with pytest.raises(UnknownEngine, match="no known engine series"):
        engines.read(text)


def test_a_registered_engine_is_detected_and_read_through_its_profile(ticker):
    reading = engines.read(payload())
    assert reading.profile == "ticker" and engines.BY_NAME["ticker"] is TICKER
    assert engines.BY_START_HEADER["ticker-started-us"] is TICKER
    (unit,) = reading.engines.values()
    assert (unit.model_name, unit.running, unit.waiting) == ("m", 12.0, 3.0)
    assert unit.steps == 50 and unit.generation_tokens == 600  # 5 s at 10 steps a second, 12 running
    # the other engines are read as before
    assert engines.read(payload_of_vllm()).profile == "vllm_v1"


def payload_of_vllm() -> str:
    s = sim.SimServer("v")
    sim.saturated(s)
    return s.payload()


def test_a_registration_that_would_confuse_engines_is_refused(ticker):
    with pytest.raises(ValueError, match="registered already"):
        engines.register(TICKER)
    with pytest.raises(ValueError, match="tells vllm_v1 already"):
        engines.register(dataclasses.replace(TICKER, name="other", marker=engines.VLLM_V1.marker, start_header=None))
    with pytest.raises(ValueError, match="start header"):
        engines.register(dataclasses.replace(TICKER, name="other", marker="other_busy"))
    with pytest.raises(ValueError, match="doors load"):
        engines.register(dataclasses.replace(TICKER, name="other", marker="other_busy", start_header=None, never=("/admin",)))
    with pytest.raises(ValueError, match="registered already"):
        sim_engines.register(TickerSim)


async def test_the_exporter_monitor_gives_the_simulated_engine_its_verdicts(ticker):
    server = sim.SimServer("t", kind="ticker", model="m")
    sim.saturated(server)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            monitor = BackendMonitor(BackendClient(session, server.url), settings=Settings(hung_after_seconds=20, probe_interval=60))
            states = []
            for t in (0, 10, 20):
                server.advance(10)
                states.append((await monitor.round(now=t)).state)
            assert states == [State.UNKNOWN, State.BUSY, State.BUSY]
            assert monitor.stats.profile == "ticker"
            sim.hang(server)
            for t in (30, 40, 50, 60):
                server.advance(10)
                states.append((await monitor.round(now=t)).state)
            # still since the read at 20: stalled, and hung once hung_after_seconds have passed
            assert states[3:] == [State.STALLED, State.HUNG, State.HUNG, State.HUNG]
            # a new process: the same counters from 0 would read as one; here only the
            # start header tells it (the counters are set back to where they were)
            old = (server.engines[0].decode_steps, server.engines[0].generation_tokens)
            server.restart()
            sim.saturated(server)
            server.engines[0].decode_steps, server.engines[0].generation_tokens = old
            verdict = await monitor.round(now=70)
            assert verdict.restarted and verdict.state == State.RESTARTED
    finally:
        await server.stop()
