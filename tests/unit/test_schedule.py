"""When the exporter runs a backend's next round (exporter.slots.next_delay): pure."""

import itertools

import pytest

from llm_health.core.health import EngineVerdict, Memory, Verdict
from llm_health.core.states import State
from llm_health.exporter.slots import first_round_delays, next_delay, next_planned, on_tick


def test_next_delay():
    def v(*engines):
        return Verdict(
            State.STALLED, "", Memory(), tuple(EngineVerdict("m", str(i), s, "", 1, 0, seconds_since_progress=t) for i, (s, t) in enumerate(engines))
        )

    assert next_delay(None, 10, 60, 0.5) == 9.5
    assert next_delay(v((State.BUSY, 0)), 10, 60, 0) == 10
    assert next_delay(v((State.STALLED, 55)), 10, 60, 0) == pytest.approx(5.01)
    assert next_delay(v((State.STALLED, 10), (State.STALLED, 58)), 10, 60, 1.0) == pytest.approx(1.01)
    assert next_delay(v((State.STALLED, 75)), 10, 60, 0.2) == 0.0  # overdue: at once


def test_first_rounds_are_spread_not_aligned():
    # a small fleet starts at once
    assert first_round_delays(0, 10) == []
    assert max(first_round_delays(10, 10)) < 0.1
    # 500 backends: over 5 s (100 a second); 10,000: over the whole 10 s interval, evenly
    five_hundred = first_round_delays(500, 10)
    assert five_hundred[0] == 0 and five_hundred[-1] == pytest.approx(4.99)
    fleet = first_round_delays(10_000, 10)
    assert 9.99 < fleet[-1] < 10.0
    gaps = {round(b - a, 9) for a, b in itertools.pairwise(fleet)}
    assert gaps == {0.001}
    # never more than one interval, however short the interval
    assert max(first_round_delays(10_000, 0.2)) < 0.2


def test_rounds_start_on_a_grid_and_keep_their_interval():
    # a fleet's first rounds, spread over 10 s, start on 41 ticks of 0.25 s (100.0 to 110.0), not 1,000 moments
    starts = {on_tick(100.0 + d, 10) for d in first_round_delays(1000, 10)}
    assert len(starts) == 41 and all(abs(t / 0.25 - round(t / 0.25)) < 1e-9 for t in starts)
    # at most one tick late, never early
    assert on_tick(100.01, 10) == pytest.approx(100.25) and on_tick(100.25, 10) == pytest.approx(100.25)
    # an interval shorter than the tick is its own grid
    assert on_tick(1.03, 0.1) == pytest.approx(1.1)
    # an interval that is no multiple of the tick (0.3 s) keeps 0.3 s on average: the plan
    # advances by the interval, only each start waits for its tick
    planned, starts_03 = 0.0, []
    for _ in range(100):
        start = on_tick(planned, 0.3)
        starts_03.append(start)
        planned = next_planned(planned, start + 0.004, 0.3, 0.3, start + 0.01)
    assert (starts_03[-1] - starts_03[0]) / 99 == pytest.approx(0.3, abs=0.25 / 99)
    assert all(0 <= s - 0.3 * i < 0.25 + 1e-9 for i, s in enumerate(starts_03))


def test_next_planned():
    # a late start (loop lag) does not push the plan: an interval after the planned time
    assert next_planned(10.0, 10.2, 10.0, 10.0, 10.3) == 20.0
    # a stalled engine's early round: its wait counts from the actual start
    assert next_planned(10.0, 10.2, 5.01, 10.0, 10.3) == pytest.approx(15.21)
    # behind (a round longer than the interval, or a blocked loop): at once, no replay
    assert next_planned(10.0, 10.0, 10.0, 10.0, 45.0) == 45.0
