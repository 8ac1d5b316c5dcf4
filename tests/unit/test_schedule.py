"""When the exporter runs a backend's next round (exporter.slots.next_delay): pure."""

import itertools

import pytest

from llm_health.core.health import EngineVerdict, Memory, Verdict
from llm_health.core.states import State
from llm_health.exporter.slots import first_round_delays, next_delay


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
