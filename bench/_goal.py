"""The goal line every benchmark prints: the goal, the figure this run measured, and
whether it is met, computed from that figure as printed (docs/benchmarks.md's summary
quotes these lines; tests/integration/test_bench_smoke.py checks each figure against the
benchmark's own table)."""

from __future__ import annotations


def goal_line(goal: str, measured: str, met: bool) -> str:
    return f"goal: {goal}; measured: {measured}: {'met' if met else 'NOT met'}"


def not_run(goal: str, why: str) -> str:
    """A goal this run did not measure at the rate or size it names: never met."""
    return goal_line(goal, f"NOT RUN ({why})", False)


def printed(value: float, digits: int = 2) -> float:
    """`value` as a goal line prints it, so the verdict is judged on the printed figure."""
    return float(f"{value:.{digits}f}")


def added_latency(p50_added_ms: float, p99_added_ms: float, goal_ms: float, p99_goal_ms: float | None = None) -> tuple[str, bool]:
    """The measured text and verdict of an added-latency goal ("adds under goal_ms at p99",
    or under goal_ms at p50 and p99_goal_ms at p99), from matched quantiles of interleaved
    runs: both the p50 and the p99 difference are printed, both must be under their goal,
    and a negative difference (the noise between the two sides larger than what the door
    adds) is never a "met"."""
    p50, p99 = printed(p50_added_ms), printed(p99_added_ms)
    measured = f"p50 added {p50:.2f} ms, p99 added {p99:.2f} ms"
    if min(p50, p99) < 0:
        measured += " (a negative difference is noise larger than the effect, not a result)"
    return measured, 0 <= p50 < goal_ms and 0 <= p99 < (goal_ms if p99_goal_ms is None else p99_goal_ms)
