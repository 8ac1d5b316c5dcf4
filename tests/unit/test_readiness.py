"""core.readiness: which rounds make a backend not ready (the exporter's /-/ready), and
the count of times it turned so."""

from __future__ import annotations

import pytest

from llm_health.core.readiness import Readiness, next_readiness
from llm_health.core.states import State


def run(*states: State) -> list[Readiness]:
    r, out = Readiness(), []
    for s in states:
        r = next_readiness(r, s, "why")
        out.append(r)
    return out


@pytest.mark.parametrize("state", [s for s in State if s not in (State.HUNG, State.DOWN)])
def test_every_state_but_hung_and_down_is_ready_without_a_hang_before(state):
    (r,) = run(state)
    assert (r.ready, r.after_hang, r.not_ready_total) == (True, False, 0), r


def test_a_busy_server_is_never_made_not_ready():
    """Busy, slow (stalled), probes unanswered, payload unreadable: none of it is a proof."""
    rounds = run(*[State.BUSY, State.STALLED, State.BUSY, State.UNRESPONSIVE, State.NO_METRICS, State.UNKNOWN, State.BUSY] * 5)
    assert all(r.ready for r in rounds) and rounds[-1].not_ready_total == 0


def test_hung_until_back_idle_or_busy_counted_once():
    rounds = run(State.BUSY, State.STALLED, State.HUNG, State.HUNG, State.DOWN, State.NO_METRICS, State.RESTARTED, State.UNKNOWN, State.IDLE, State.BUSY)
    assert [r.ready for r in rounds] == [True, True, False, False, False, False, False, False, True, True]
    assert rounds[2].reason == "hung: why"
    assert rounds[6].reason == "restarted after a hang: not back to idle or busy yet (restarting)"
    assert [r.not_ready_total for r in rounds] == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]


def test_a_hang_that_moves_again_is_ready_at_once():
    rounds = run(State.HUNG, State.BUSY)
    assert [r.ready for r in rounds] == [False, True]


def test_down_is_not_ready_and_each_spell_counts():
    rounds = run(State.IDLE, State.DOWN, State.DOWN, State.IDLE, State.HUNG, State.BUSY, State.DOWN)
    assert [r.ready for r in rounds] == [True, False, False, True, False, True, False]
    assert rounds[1].reason == "down: why"
    assert rounds[-1].not_ready_total == 3
