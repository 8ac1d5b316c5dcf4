"""The lines a benchmark prints for a figure no goal is judged on (bench/_goal.py prints the
goal lines): a figure of a run with failed requests, and a projection. bench.summary counts
each apart from the goal lines; the smoke test fails on a FAILED line."""

from __future__ import annotations


def failed_line(goal: str, failures: str) -> str:
    """A goal (or a figure) whose run saw failed requests: no figure and no verdict, only how
    many failed. A time of failed requests describes nothing the goal names; bench.summary
    counts these apart, and the smoke test fails on one."""
    return f"FAILED: {goal}; {failures}: no figure judged"


def projected_line(what: str, figure: str) -> str:
    """A figure computed from a measurement, not measured itself (a share of a core at a rate
    the run did not run at, a split of backends it did not run): labelled `projected`,
    counted apart in bench.summary, and never a goal's verdict."""
    return f"projected: {what}; {figure}"
