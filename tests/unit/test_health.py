"""The state machine, as tables of cases: sequences of readings and the verdict after each."""

from __future__ import annotations

import math

import pytest

from llm_health.core.engines import EngineReading, Reading
from llm_health.core.health import Memory, Observation, Settings, after_probe, decide
from llm_health.core.states import State, worst

NAN = math.nan
S = Settings(hung_after_seconds=20, probe_interval=60)


def eng(running=0, waiting=0, steps=0.0, prompt=0.0, gen=0.0, done=0.0, kv=0.0, engine="0", sleeping=False, preempt=0.0):
    counters = (steps, prompt, gen, done, preempt)
    return EngineReading("m", engine, running, waiting, steps, gen, counters, (kv, running, waiting), sleeping)


def reading(*engines, start=1000.0):
    return Reading("vllm_v1", start, {e.key: e for e in engines})


def run(seq, settings=S, probes=()):
    """Feed (t, reading-or-Observation) in order; answer probes from `probes` in order."""
    probes = list(probes)
    mem, states = None, []
    for t, r in seq:
        obs = r if isinstance(r, Observation) else Observation(now=t, reading=r)
        v = decide(mem, obs, settings)
        if v.probe_wanted:
            v = after_probe(v, probes.pop(0), t, settings, "test")
        mem = v.memory
        states.append(v.state)
    return states, v


CASES = {
    # busy and healthy: 2 running, 107 new tokens between two reads
    "busy progressing": ([(0, reading(eng(2, 0, steps=10, gen=20))), (10, reading(eng(2, 0, steps=64, gen=127)))], [], ["unknown", "busy"]),
    "saturated 12 running + waiting": (
        [(0, reading(eng(12, 3, steps=100, gen=1000, kv=0.6))), (10, reading(eng(12, 3, steps=205, gen=2260, kv=0.61)))],
        [],
        ["unknown", "busy"],
    ),
    # V1 long prefill: steps and tokens frozen, only KV usage rises
    "long prefill, KV only": (
        [(t, reading(eng(1, 0, steps=5, prompt=10, gen=5, kv=0.05 + t / 100))) for t in (0, 10, 20, 30, 40)],
        [],
        ["unknown", "busy", "busy", "busy", "busy"],
    ),
    # a healthy long prefill can look frozen for one round: stalled, never hung
    "one frozen round then progress": (
        [(0, reading(eng(1, 0, kv=0.1))), (10, reading(eng(1, 0, kv=0.1))), (20, reading(eng(1, 0, kv=0.2)))],
        [],
        ["unknown", "stalled", "busy"],
    ),
    "hung with running": ([(t, reading(eng(4, 0, steps=50, gen=200, kv=0.3))) for t in (0, 10, 20)], [], ["unknown", "stalled", "hung"]),
    # vLLM #39863: running 0, waiting 3, nothing moves
    "hung with only waiting": ([(t, reading(eng(0, 3, steps=9))) for t in (0, 10, 20)], [], ["unknown", "stalled", "hung"]),
    # two rounds are not enough when they are shorter than hung_after_seconds
    "two quick rounds are not hung yet": (
        [(t, reading(eng(4, 0, steps=50))) for t in (0, 5, 10, 15, 20)],
        [],
        ["unknown", "stalled", "stalled", "stalled", "hung"],
    ),
    "idle probed once per probe_interval": (
        [(t, reading(eng())) for t in (0, 10, 20, 60, 70)],
        [True, True],
        ["idle", "idle", "idle", "idle", "idle"],
    ),
    "idle, probe fails twice": ([(0, reading(eng())), (60, reading(eng()))], [False, False], ["unresponsive", "hung"]),
    "idle, probe fails once then answers": ([(0, reading(eng())), (60, reading(eng()))], [False, True], ["unresponsive", "idle"]),
    "restart: new start time": (
        [
            (0, reading(eng(2, 0, steps=500))),
            (10, reading(eng(2, 0, steps=600))),
            (20, reading(eng(0, 0, steps=0), start=2000.0)),
            (30, reading(eng(), start=2000.0)),
        ],
        [True],
        ["unknown", "busy", "restarted", "idle"],
    ),
    # multiprocess mode: no start time; counters went backwards
    "restart without start time": (
        [
            (0, reading(eng(2, 0, steps=500, gen=900), start=None)),
            (10, reading(eng(1, 0, steps=3, gen=4), start=None)),
            (20, reading(eng(1, 0, steps=9, gen=10), start=None)),
        ],
        [],
        ["unknown", "restarted", "busy"],
    ),
    # a restarted server is never compared with the process before it: frozen after restart is a fresh count
    "restart resets the no-progress count": (
        [
            (0, reading(eng(4, 0, steps=50))),
            (10, reading(eng(4, 0, steps=50))),
            (20, reading(eng(4, 0, steps=1), start=3000.0)),
            (30, reading(eng(4, 0, steps=1), start=3000.0)),
        ],
        [],
        ["unknown", "stalled", "restarted", "stalled"],
    ),
    "sleeping is never hung": ([(t, reading(eng(0, 2, steps=7, sleeping=True))) for t in (0, 10, 20, 30)], [], ["sleeping"] * 4),
    # data parallel: engine 0 hung while engine 1 runs; the backend is hung, engine 1 stays busy
    "one DP engine hung": (
        [(t, reading(eng(4, 0, steps=9, engine="0"), eng(4, 0, steps=t * 10, engine="1"))) for t in (0, 10, 20)],
        [],
        ["unknown", "stalled", "hung"],
    ),
    "work arrives after idle": ([(0, reading(eng())), (10, reading(eng(3, 0, steps=4)))], [True], ["idle", "busy"]),
    # A fingerprint field flipping between a number and NaN (no evidence) on an engine that
    # is otherwise still is not progress: hung exactly as if the field had not moved.
    "still engine, KV usage flips between a number and NaN": (
        [(t, reading(eng(4, 0, steps=9, kv=0.31 if i % 2 == 0 else NAN))) for i, t in enumerate((0, 10, 20, 30))],
        [],
        ["unknown", "stalled", "hung", "hung"],
    ),
    "still engine, KV usage flat (the same engine, nothing flipping)": (
        [(t, reading(eng(4, 0, steps=9, kv=0.31))) for t in (0, 10, 20, 30)],
        [],
        ["unknown", "stalled", "hung", "hung"],
    ),
    "still engine, a counter flips between a number and NaN": (
        [(t, reading(eng(4, 0, steps=9, done=77.0 if i % 2 else NAN))) for i, t in enumerate((0, 10, 20, 30))],
        [],
        ["unknown", "stalled", "hung", "hung"],
    ),
    # The memory keeps the last number: 0.31, NaN, 0.35 has moved.
    "KV usage moves across a NaN": (
        [(0, reading(eng(4, 0, steps=9, kv=0.31))), (10, reading(eng(4, 0, steps=9, kv=NAN))), (20, reading(eng(4, 0, steps=9, kv=0.35)))],
        [],
        ["unknown", "stalled", "busy"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_state_sequences(name):
    seq, probes, expected = CASES[name]
    states, _ = run(seq, probes=probes)
    assert states == expected


def test_dp_engines_kept_apart():
    _, v = run(CASES["one DP engine hung"][0])
    by_engine = {e.engine: e.state for e in v.engines}
    assert by_engine == {"0": "hung", "1": "busy"}
    assert "engine 0" in v.reason


def test_no_probe_while_work_in_flight():
    """Across every case, a probe is only ever wanted when nothing is running or waiting."""
    wanted = in_flight = 0
    for seq, _, _ in CASES.values():
        mem = None
        for t, r in seq:
            v = decide(mem, Observation(now=t, reading=r), S)
            in_flight += any(e.running or e.waiting for e in r.engines.values())
            if v.probe_wanted:
                wanted += 1
                assert all(e.running == 0 and e.waiting == 0 for e in r.engines.values())
                v = after_probe(v, True, t, S)
            mem = v.memory
    assert wanted and in_flight, (wanted, in_flight)  # the cases hold both: the rule was put to the test


def test_probe_rate_limited():
    mem, wanted = None, []
    for t in range(0, 130, 10):
        v = decide(mem, Observation(now=t, reading=reading(eng())), S)
        wanted.append(v.probe_wanted)
        if v.probe_wanted:
            v = after_probe(v, True, t, S)
        mem = v.memory
    assert [t for t, w in zip(range(0, 130, 10), wanted) if w] == [0, 60, 120]


def test_hung_needs_time_as_well_as_rounds():
    s = Settings(hung_after_seconds=100)
    states, v = run([(t, reading(eng(4, 0, steps=1))) for t in (0, 10, 20, 30)], settings=s)
    assert states == ["unknown", "stalled", "stalled", "stalled"]
    assert v.engines[0].seconds_since_progress == 30


def test_rates():
    _, v = run([(0, reading(eng(12, 0, steps=100, gen=1000))), (10, reading(eng(12, 0, steps=205, gen=2260)))])
    assert v.total("steps_per_second") == pytest.approx(10.5)
    assert v.total("generation_tokens_per_second") == pytest.approx(126.0)


def test_nan_fingerprints_compare_equal():
    """A series the engine does not expose (NaN) must not count as progress."""
    e = EngineReading("m", "", 2, 0, None, None, (NAN, 5.0), (NAN,))
    states, _ = run([(t, reading(e)) for t in (0, 10, 20)])
    assert states == ["unknown", "stalled", "hung"]


@pytest.mark.parametrize(
    "obs,state",
    [
        (Observation(now=0, metrics_error="HTTP 404", models_ok=True), "no_metrics"),
        (Observation(now=0, metrics_error="timeout after 30s", metrics_timed_out=True, models_ok=True), "unknown"),
        (Observation(now=0, metrics_error="connection refused", metrics_refused=True, models_ok=False, models_error="refused"), "down"),
        (Observation(now=0, metrics_error="timeout after 30s", metrics_timed_out=True, models_ok=False, models_error="timeout"), "down"),
    ],
)
def test_without_metrics(obs, state):
    v = decide(None, obs, S)
    assert v.state == state
    assert not v.probe_wanted


def test_no_metrics_is_never_a_restart_verdict():
    mem = None
    for t in range(5):
        v = decide(mem, Observation(now=t * 10, metrics_error="HTTP 404", models_ok=True), S)
        mem = v.memory
        assert v.state.exit_code != 1


def test_proxy_only_models():
    assert decide(None, Observation(now=0, models_ok=True), S, kind="proxy").state == "up"
    assert decide(None, Observation(now=0, models_ok=False, models_error="refused"), S, kind="proxy").state == "down"


@pytest.mark.parametrize(
    "state,code",
    [
        ("idle", 0),
        ("busy", 0),
        ("sleeping", 0),
        ("paused", 0),
        ("restarted", 0),
        ("up", 0),
        ("hung", 1),
        ("down", 2),
        ("stalled", 3),
        ("unresponsive", 3),
        ("no_metrics", 3),
        ("unknown", 3),
    ],
)
def test_exit_codes(state, code):
    assert State(state).exit_code == code


def test_worst():
    assert worst([State.BUSY, State.HUNG, State.IDLE]) == "hung"
    assert worst([State.IDLE, State.BUSY]) == "busy"
    assert worst([State.SLEEPING, State.IDLE]) == "sleeping"


def test_paused_endpoint_is_never_hung():
    mem = None
    for t in (0, 10, 20, 30):
        v = decide(mem, Observation(now=t, reading=reading(eng(2, 0, steps=3)), paused=True), S)
        mem = v.memory
        assert v.state == "paused"
    assert isinstance(mem, Memory)


def test_one_round_is_never_hung_however_long():
    """Two rounds without progress are needed even when hung_after_seconds has long passed:
    a healthy long prefill can look frozen for one round."""
    s = Settings(hung_after_seconds=5)
    states, _ = run([(0, reading(eng(1, 0, kv=0.1))), (60, reading(eng(1, 0, kv=0.1))), (120, reading(eng(1, 0, kv=0.1)))], settings=s)
    assert states == ["unknown", "stalled", "hung"]


def test_one_failed_probe_is_not_hung():
    s = Settings(probe_interval=0)
    states, _ = run([(0, reading(eng()))], settings=s, probes=[False])
    assert states == ["unresponsive"]


def test_a_field_flipping_to_nan_is_no_progress_and_no_restart():
    """Number, NaN, number, NaN on a still engine: the verdicts are those of the still
    engine whose field never moved, seconds without progress included, and never
    `restarted` (a counter that turns NaN did not go back)."""
    flat = [(t, reading(eng(4, 0, steps=9, done=77.0, kv=0.31))) for t in (0, 10, 20, 30, 40)]
    flipping = [(t, reading(eng(4, 0, steps=9, done=77.0 if i % 2 == 0 else NAN, kv=NAN if i % 2 else 0.31))) for i, t in enumerate((0, 10, 20, 30, 40))]
    (s1, v1), (s2, v2) = run(flat), run(flipping)
    assert s1 == s2 == ["unknown", "stalled", "hung", "hung", "hung"]
    assert [e.seconds_since_progress for e in v1.engines] == [e.seconds_since_progress for e in v2.engines] == [40.0]
    assert v2.memory.engines[("m", "0")].fingerprint == v1.memory.engines[("m", "0")].fingerprint
