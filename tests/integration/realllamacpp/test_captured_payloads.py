"""The payloads captured from the pinned llama-server (tests/data/llamacpp/, see its
SOURCES.md) served again on loopback with the headers llama.cpp sent, read through
llm-health's own client and judged by its state machine. No llama-server needed: these run
everywhere and pin what the live tests in this directory showed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import ClientSession, web
from prometheus_client.parser import text_string_to_metric_families

from llm_health.core.engines import Limits, Reading, read
from llm_health.core.health import Observation, Settings, decide
from llm_health.core.states import State
from llm_health.probe.client import BackendClient
from llm_health.probe.pieces import read_fetched

DATA = Path(__file__).resolve().parents[2] / "data" / "llamacpp"
HEADERS = json.loads((DATA / "headers.json").read_text())
NAMES = sorted(HEADERS)
S = Settings(hung_after_seconds=3, probe_interval=60)


def body(name: str) -> str:
    return (DATA / f"{name}.prom").read_text()


@pytest.fixture
async def replay(aiohttp_server):
    """A loopback server answering /metrics with a captured body and its headers;
    `serve(name)` switches the payload."""
    current = {"name": "fresh"}

    async def metrics(request: web.Request) -> web.Response:
        name = current["name"]
        h = HEADERS[name]
        return web.Response(body=body(name).encode(), headers={"Content-Type": h["content-type"], "Process-Start-Time-Unix": h["process-start-time-unix"]})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app)
    async with ClientSession() as session:
        client = BackendClient(session, str(server.make_url("")))

        async def serve(name: str) -> Reading:
            current["name"] = name
            fetched = await client.metrics()
            assert fetched.parts is not None, fetched
            return await read_fetched(fetched.parts, fetched.start_header, Limits())

        yield serve


@pytest.mark.parametrize("name", NAMES)
def test_capture_is_valid_exposition_with_the_series_llm_health_reads(name):
    families = {f.name: f for f in text_string_to_metric_families(body(name))}
    for series in ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:n_decode_total"):
        assert series.removesuffix("_total") in families, sorted(families)
    assert "process_start_time_seconds" not in body(name)  # llama.cpp has none: the header stands in
    reading = read(body(name))
    assert reading.profile == "llamacpp" and reading.start_time is None


async def test_header_is_the_start_time(replay):
    reading = await replay("idle")
    assert reading.start_time == int(HEADERS["idle"]["process-start-time-unix"]) / 1e6
    e = next(iter(reading.engines.values()))
    assert (e.running, e.waiting, e.steps) == (0, 0, 19)


def judge(*readings: Reading, step: float = 1.0):
    v = None
    for i, r in enumerate(readings):
        v = decide(v.memory if v else None, Observation(now=i * step, reading=r), S)
    assert v is not None
    return v


async def test_busy_then_busy(replay):
    v = judge(await replay("busy"), await replay("busy-1s-later"))
    assert v.state is State.BUSY and (v.running, v.waiting) == (2, 1), v
    assert v.total("steps_per_second") == 246 - 179


async def test_frozen_in_decode_is_hung_after_two_rounds_spanning_hung_after(replay):
    a, b = await replay("frozen-in-decode"), await replay("frozen-in-decode-2s-later")
    assert judge(a, b, step=2.0).state is State.STALLED  # one round without progress
    assert judge(a, b, b, step=2.0).state is State.HUNG  # two, and 4 s >= hung_after 3 s


async def test_long_prompt_moves_only_the_decode_count(replay):
    a, b = await replay("long-prompt"), await replay("long-prompt-later")
    ea, eb = next(iter(a.engines.values())), next(iter(b.engines.values()))
    assert ea.generation_tokens == eb.generation_tokens  # tokens_predicted_total: only at request end
    assert ea.counters[1] == eb.counters[1]  # prompt_tokens_total: only at prompt end
    assert eb.steps == ea.steps + 2  # n_decode_total: one per 512-token decode
    assert judge(a, b).state is State.BUSY


async def test_restart_seen_only_in_the_header(replay):
    """fresh.prom and restarted.prom are the same bytes: a restart of a server that had
    served nothing shows in the start header alone."""
    assert body("fresh") == body("restarted")
    v = judge(await replay("fresh"), await replay("restarted"))
    assert v.state is State.RESTARTED and "process start time changed" in v.reason, v
    # without the header the same two payloads are one idle server
    assert judge(read(body("fresh")), read(body("restarted"))).state is State.IDLE


def timed_out(now: float, models_ok: bool = True) -> Observation:
    return Observation(
        now=now, metrics_error="timeout after 2s", metrics_timed_out=True, models_ok=models_ok, models_error=None if models_ok else "timeout after 2s"
    )


def test_llamacpp_metrics_timeouts_while_health_answers_are_failed_probes():
    """A llama.cpp /metrics is a task on the inference loop's queue: timed out while /health
    answers, it counts as a failed probe; hung after two in a row spanning hung_after."""
    idle = read(body("idle"))
    v = decide(None, Observation(now=0.0, reading=idle), S)
    v = decide(v.memory, timed_out(1.0), S)
    assert v.state is State.UNRESPONSIVE, v  # one timeout: never hung on it
    v = decide(v.memory, timed_out(2.0), S)
    assert v.state is State.UNRESPONSIVE, v  # two, but 2 s < hung_after 3 s
    v = decide(v.memory, timed_out(3.5), S)
    assert v.state is State.HUNG and "inference loop takes no task" in v.reason, v
    assert v.memory.last_probe_at is None
    # /metrics answers idle again: a probe is due at once, to confirm the loop is back
    back = decide(v.memory, Observation(now=4.0, reading=idle), S)
    assert back.probe_wanted and back.state is State.HUNG, back
    # /health silent too: the whole process is stopped or dead, never hung on that
    assert decide(v.memory, timed_out(5.0, models_ok=False), S).state is State.DOWN


def test_timeouts_without_a_llamacpp_reading_stay_unknown():
    """With no earlier llama.cpp reading (a check started on a stuck server, or another
    engine) a /metrics timeout is load, not death: unknown, never hung."""
    v = decide(None, timed_out(0.0), S)
    for now in (1.0, 5.0, 10.0):
        v = decide(v.memory, timed_out(now), S)
        assert v.state is State.UNKNOWN, v
