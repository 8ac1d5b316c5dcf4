"""The health states, their order of badness, and what each means for a watchdog.

One vocabulary for the whole package: the state machine (`health`), `llm-health check`,
the exporter's one-hot series, the Redis drift rules and the restarter all use `State`.
`State` is a `str` enum, so a state compares equal to its name (`State.HUNG == "hung"`)
and renders as that name in JSON and in label values.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class State(StrEnum):
    IDLE = "idle"
    BUSY = "busy"
    STALLED = "stalled"
    HUNG = "hung"
    UNRESPONSIVE = "unresponsive"
    RESTARTED = "restarted"
    SLEEPING = "sleeping"
    PAUSED = "paused"
    NO_METRICS = "no_metrics"
    DOWN = "down"
    UNKNOWN = "unknown"
    UP = "up"

    @property
    def severity(self) -> int:
        """0 is the worst: a backend's state is the state of its worst engine."""
        return _BY_SEVERITY.index(self)

    @property
    def healthy(self) -> bool:
        return self in HEALTHY

    @property
    def exit_code(self) -> int:
        """`llm-health check`'s exit code for this state (see `ExitCode`)."""
        if self in HEALTHY:
            return ExitCode.HEALTHY
        if self is State.HUNG:
            return ExitCode.HUNG
        if self is State.DOWN:
            return ExitCode.DOWN
        return ExitCode.UNDETERMINED


class ExitCode:
    """`llm-health check` exit codes. HUNG (1) means "hung, restart warranted" and
    nothing else: a usage or configuration error, or a check that could not run, is
    CANNOT_RUN (4), never 1."""

    HEALTHY = 0
    HUNG = 1
    DOWN = 2
    UNDETERMINED = 3
    CANNOT_RUN = 4


# Worst first.
_BY_SEVERITY: tuple[State, ...] = (
    State.HUNG,
    State.DOWN,
    State.UNRESPONSIVE,
    State.STALLED,
    State.NO_METRICS,
    State.UNKNOWN,
    State.RESTARTED,
    State.BUSY,
    State.SLEEPING,
    State.PAUSED,
    State.IDLE,
    State.UP,
)

# States in which nothing needs doing: `check` exits 0.
HEALTHY: frozenset[State] = frozenset({State.IDLE, State.BUSY, State.SLEEPING, State.PAUSED, State.RESTARTED, State.UP})

# States that say work is in flight on the engine (for lease drift: a backend in one of
# these without a GPU lease runs a job that never claimed its GPU).
IN_FLIGHT: frozenset[State] = frozenset({State.BUSY, State.STALLED, State.HUNG, State.UNKNOWN})

# States that end a `check`: another round would not change the verdict.
FINAL: frozenset[State] = frozenset({State.IDLE, State.BUSY, State.SLEEPING, State.PAUSED, State.HUNG, State.DOWN, State.RESTARTED, State.UP, State.NO_METRICS})


def worst(states: Iterable[State]) -> State:
    """The worst of `states` (UNKNOWN for none)."""
    return min(states, key=lambda s: s.severity, default=State.UNKNOWN)
