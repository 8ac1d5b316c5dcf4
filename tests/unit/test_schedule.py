"""When the exporter runs a backend's next round (exporter.slots.next_delay): pure."""

import pytest

from llm_health.core.health import EngineVerdict, Memory, Verdict
from llm_health.core.states import State
from llm_health.exporter.slots import next_delay


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
