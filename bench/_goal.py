"""The goal line every benchmark prints: the goal, the figure this run measured, and
whether it is met, computed from that figure (docs/benchmarks.md's summary quotes these)."""

from __future__ import annotations


def goal_line(goal: str, measured: str, met: bool) -> str:
    return f"goal: {goal}; measured: {measured}: {'met' if met else 'NOT met'}"
