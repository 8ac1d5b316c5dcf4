"""Livelocks: an engine that keeps stepping while it produces nothing (vLLM #45094: prefill at
about 20k tokens/s, decode at 0, `/health` 200), and a preemption loop that prefills again
and generates nothing. Played back as vLLM 0.32 payloads: tests/data/vllm-real/busy.prom
(a real vLLM's `/metrics` with 4 running and 4 waiting) with its counters edited per round,
through the parser, the state machine (`core.health`) and `llm-health check`'s own loop
(`probe.check.check_with`) in simulated time. Each busy shape beside them stays busy.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from llm_health.core.confirm import ConfirmRead, against_evidence
from llm_health.core.engines import read
from llm_health.core.evidence import Evidence, progress_digest
from llm_health.core.health import Memory, Observation, Settings, decide
from llm_health.core.states import ExitCode, State
from llm_health.probe.check import check_with
from llm_health.probe.client import Fetched, ProbeResult

BUSY = (Path(__file__).parents[1] / "data" / "vllm-real" / "busy.prom").read_text()
INTERVAL = 10.0
SETTINGS = Settings(hung_after_seconds=60, probe_interval=60, no_output_after_seconds=120)
# The documented bound (docs/engines.md): hung at the first round at least
# no_output_after_seconds after the last output, plus (hung_rounds - 1) rounds.
HUNG_BY = SETTINGS.no_output_after_seconds + (SETTINGS.hung_rounds - 1) * INTERVAL


def payload(t: float, steps: float, prompt: float, gen: float, done: float, preempt: float = 0.0, running: int = 4, kv: float | None = None) -> str:
    """busy.prom with its counters at these values (the `length` reason holds every finish)."""
    values = {
        "vllm:iteration_tokens_total_count": steps,
        "vllm:prompt_tokens_total": prompt,
        "vllm:generation_tokens_total": gen,
        'vllm:request_success_total{engine="0",finished_reason="length"': done,
        "vllm:num_preemptions_total": preempt,
        "vllm:num_requests_running": running,
        "vllm:kv_cache_usage_perc": 0.3 + 0.001 * (t % 7) if kv is None else kv,
    }
    text = BUSY
    for name, value in values.items():
        head = re.escape(name) + (r"[^\n]*" if name.endswith('"') else r"\{[^\n]*")
        text, n = re.subn(rf"^({head}\}}) \S+$", lambda m, v=value: f"{m.group(1)} {v!r}", text, count=1, flags=re.M)
        assert n == 1, name
    return text


Shape = Callable[[float], str]

# Each shape: the payload at time t (seconds), rounds every INTERVAL.
LIVELOCKS: dict[str, Shape] = {
    # #45094: steps and prompt tokens moving (20k tokens/s), KV moving, generation and finishes flat.
    "prefill at 20k tokens/s, decode at 0": lambda t: payload(t, steps=1000 + 2 * t, prompt=5000 + 20_000 * t, gen=119, done=4),
    # Preempt, prefill again, preempt: preemptions, steps and prompt tokens move, nothing generated.
    "preemption loop": lambda t: payload(t, steps=1000 + t, prompt=5000 + 4096 * t, gen=119, done=4, preempt=t // 2),
}

BUSY_SHAPES: dict[str, Shape] = {
    "decoding": lambda t: payload(t, steps=45 + 20 * t, prompt=23 + 50 * t, gen=119 + 80 * t, done=4 + t // 5),
    # A long prefill: 100 s of steps, prompt tokens and KV with no token, then tokens come out.
    "a long prefill, then decode": lambda t: payload(t, steps=45 + t, prompt=23 + 2000 * t, gen=119 + max(0.0, t - 100) * 40, done=4),
    # A slow engine: one token every 60 s.
    "one token a minute": lambda t: payload(t, steps=45 + t, prompt=23, gen=119 + t // 60, done=4),
    # A preemption storm that still produces tokens.
    "preemption storm with output": lambda t: payload(t, steps=45 + 5 * t, prompt=23 + 3000 * t, gen=119 + 3 * t, done=4, preempt=t),
    # A V1 chunked prefill: only KV usage moves (no step counted, no prompt token yet), ten minutes.
    "chunked prefill, KV only": lambda t: payload(t, steps=45, prompt=23, gen=119, done=4),
    # A pooling (embedding) model: no token generated, requests finish.
    "pooling: finishes, no tokens": lambda t: payload(t, steps=45 + 5 * t, prompt=23 + 500 * t, gen=119, done=4 + t),
}


def play(shape: Shape, seconds: float, settings: Settings = SETTINGS) -> list[tuple[float, State, str]]:
    mem: Memory | None = None
    out = []
    t = 0.0
    while t <= seconds:
        v = decide(mem, Observation(now=t, reading=read(shape(t))), settings)
        mem = v.memory
        out.append((t, v.state, v.reason))
        t += INTERVAL
    return out


@pytest.mark.parametrize("name", LIVELOCKS)
def test_a_livelock_reaches_hung_within_the_bound(name):
    states = play(LIVELOCKS[name], 300)
    first_hung = next(t for t, s, _ in states if s is State.HUNG)
    assert first_hung <= HUNG_BY, states
    # Busy (never stalled or hung) until no honest prefill could take so long; then stalled,
    # then hung, and it stays hung.
    assert all(s is State.BUSY for t, s, _ in states if 0 < t < SETTINGS.no_output_after_seconds), states
    assert [s for t, s, _ in states if t >= SETTINGS.no_output_after_seconds][:2] == [State.STALLED, State.HUNG]
    assert all(s is State.HUNG for t, s, _ in states if t >= first_hung)
    reason = next(r for _, s, r in states if s is State.HUNG)
    assert "no token generated and no request finished" in reason and "livelock" in reason


@pytest.mark.parametrize("name", BUSY_SHAPES)
def test_busy_shapes_stay_busy(name):
    states = play(BUSY_SHAPES[name], 600)
    assert {s for t, s, _ in states if t > 0} == {State.BUSY}, states


def test_output_again_is_busy_again_and_restarts_the_clock():
    def shape(t: float) -> str:  # a livelock for 150 s, then decode
        return payload(t, steps=1000 + 2 * t, prompt=5000 + 20_000 * t, gen=119 + max(0.0, t - 150) * 40, done=4)

    states = {t: s for t, s, _ in play(shape, 400)}
    assert states[130] is State.HUNG and states[160] is State.BUSY
    assert all(states[t] is State.BUSY for t in states if t >= 160)


def test_nothing_running_never_a_livelock():
    """Waiting requests with none running, steps moving (no output expected): the clock
    runs only while requests run."""
    states = play(lambda t: payload(t, steps=1000 + t, prompt=5000 + 10 * t, gen=119, done=4, running=0), 600)
    assert State.HUNG not in {s for _, s, _ in states}


def test_a_bound_from_the_settings():
    """no_output_after_seconds is what the clock is compared with."""
    quick = Settings(hung_after_seconds=60, probe_interval=60, no_output_after_seconds=30)
    states = play(LIVELOCKS["prefill at 20k tokens/s, decode at 0"], 100, quick)
    assert next(t for t, s, _ in states if s is State.HUNG) == 40


class Playback:
    """`probe.client.BackendClient` answering with a shape's payload at the replay's time."""

    url = "http://livelock.invalid:8000"

    def __init__(self, shape: Shape) -> None:
        self.shape, self.now, self.probes = shape, 0.0, 0

    async def metrics(self) -> Fetched:
        text = self.shape(self.now)
        return Fetched(parts=(text,), size=len(text))

    async def models(self) -> tuple[bool, str | None, str | None]:
        return True, "tiny-llama", None

    health = models

    async def flag(self, path: str) -> bool:
        return False

    async def probe(self, model: str | None) -> ProbeResult:
        self.probes += 1
        return ProbeResult(True, 0.1, "answered")

    async def sleep(self, seconds: float) -> None:
        self.now += seconds

    def clock(self) -> float:
        return self.now


def check(shape: Shape, **kw) -> tuple[dict, Playback]:
    client = Playback(shape)
    result = asyncio.run(check_with(client, interval=INTERVAL, hung_after=20, sleep=client.sleep, clock=client.clock, **kw))  # type: ignore[arg-type]
    return result, client


@pytest.mark.parametrize("name", LIVELOCKS)
def test_check_watches_a_quiet_engine_until_the_livelock_is_hung(name):
    result, client = check(LIVELOCKS[name], no_output_after=120)
    assert result["state"] == "hung" and result["exit_code"] == ExitCode.HUNG, result
    assert result["seconds"] <= HUNG_BY and client.probes == 0


@pytest.mark.parametrize("name", BUSY_SHAPES)
def test_check_on_a_busy_shape_exits_0(name):
    result, client = check(BUSY_SHAPES[name], no_output_after=120)
    assert result["state"] == "busy" and result["exit_code"] == ExitCode.HEALTHY, result
    assert client.probes == 0


def test_check_without_the_bound_ends_at_a_busy_read():
    """Without --no-output-after a check ends at its first busy read, as a watchdog with a
    short timeout needs: a livelock reads busy there (the exporter and the restarter watch)."""
    result, _ = check(LIVELOCKS["prefill at 20k tokens/s, decode at 0"])
    assert result["rounds"] == 2 and result["state"] == "busy"


def test_check_on_output_ends_as_soon_as_busy():
    """Output moving: two reads, as before the livelock rule."""
    result, _ = check(BUSY_SHAPES["decoding"], no_output_after=120)
    assert result["rounds"] == 2


def test_check_rounds_given_are_the_most():
    result, _ = check(LIVELOCKS["prefill at 20k tokens/s, decode at 0"], rounds=3, no_output_after=120)
    assert result["rounds"] == 3 and result["state"] == "busy"


def test_the_restarter_confirms_a_livelock_by_its_output():
    """The exporter proves a livelock with the engine's output digest (its progress digest
    moves every step): the restarter's reads confirm it while the steps move and nothing
    comes out, and refuse it once a token or a finished request shows, or after a restart."""
    shape = LIVELOCKS["prefill at 20k tokens/s, decode at 0"]
    mem: Memory | None = None
    t = 0.0
    while True:
        v = decide(mem, Observation(now=t, reading=read(shape(t))), SETTINGS)
        mem = v.memory
        if v.state is State.HUNG:
            break
        t += INTERVAL
    (hung,) = v.engines
    evidence = Evidence(frozenset({hung.digest}))
    later = read(shape(t + 30))
    assert hung.digest not in {progress_digest(later.profile, later.start_time, e) for e in later.engines.values()}
    assert against_evidence(evidence, ConfirmRead(later)) is None
    decoding = read(payload(t + 30, steps=1000 + 2 * (t + 30), prompt=5000 + 20_000 * (t + 30), gen=120, done=4))
    assert "not hung" in (against_evidence(evidence, ConfirmRead(decoding)) or "")
    restarted = read(shape(t + 30).replace("process_start_time_seconds 1.79599076391e+09", "process_start_time_seconds 1.8e+09"))
    assert "not hung" in (against_evidence(evidence, ConfirmRead(restarted)) or "")
