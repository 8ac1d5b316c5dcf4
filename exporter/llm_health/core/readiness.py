"""Readiness: whether new traffic should go to a backend (the exporter's `/-/ready`).
Pure: decided from the backend's states, round by round, never from a request to it.

Not ready (503):

* `hung`: the round proved the hang;
* after a hang, until a round sees the backend `idle`, `busy`, `sleeping` or `paused`
  again: while it is restarted, `down`, loading (`no_metrics`), `restarted` but not yet
  back, or anything else; a hung server that moves again on its own is back as soon as a
  round sees it busy;
* `down`: neither `/metrics` nor `/v1/models` answered the last round (a server that
  answers nothing takes no traffic either; a `readinessProbe` on the engine's own
  `/health` took such a server out of a Service, and this keeps that).

Ready (200) in every other state: `busy` above all (a busy server is never drained), and
`stalled`, `unresponsive`, `no_metrics`, `unknown` and `restarted` when no hang came
before them: none of them is a proof, and a readiness that flaps on a slow round takes a
working server out of rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

from .states import State

# States that end the not-ready spell after a hang: the backend serves again.
BACK: frozenset[State] = frozenset({State.IDLE, State.BUSY, State.SLEEPING, State.PAUSED, State.UP})


@dataclass(frozen=True)
class Readiness:
    ready: bool = True
    reason: str = "no round yet"
    after_hang: bool = False  # a hang was proven and no round has seen the backend back since
    not_ready_total: int = 0  # times it turned not ready (llm_exporter_readiness_not_ready_total)


def next_readiness(previous: Readiness, state: State, reason: str = "") -> Readiness:
    """The readiness after a round whose verdict is `state` (and `reason`)."""
    if state is State.HUNG:
        ready, why, after_hang = False, f"hung: {reason}" if reason else "hung", True
    elif previous.after_hang and state not in BACK:
        ready, why, after_hang = False, f"{state} after a hang: not back to idle or busy yet (restarting)", True
    elif state is State.DOWN:
        ready, why, after_hang = False, f"down: {reason}" if reason else "down", False
    else:
        ready, why, after_hang = True, str(state), False
    turned = previous.ready and not ready
    return Readiness(ready, why, after_hang, previous.not_ready_total + turned)
