"""docs/benchmarks.md's summary is computed from the goal lines of the outputs pasted below
it (bench/summary.py): it can hold no goal, figure or verdict that no run printed."""

from __future__ import annotations

from bench import summary


def test_the_summary_is_the_goal_lines_of_the_pasted_runs():
    text = summary.DOC.read_text(encoding="utf-8")
    rows = summary.goals(text)
    assert rows, "docs/benchmarks.md holds no goal line"
    assert summary.current(text) == summary.render(rows), "run: python -m bench.summary --write"


def test_goal_lines_are_read_only_from_code_blocks_under_their_section():
    text = "## A\n\ngoal: x; measured: 1: met\n\n```\ngoal: y; measured: 2 | 3: NOT met\n```\n## B\n```\ngoal: z; measured: 4: met\n```\n"
    assert summary.goals(text) == [("A", "y", "2 | 3", False), ("B", "z", "4", True)]
    assert "| A | y | 2 \\| 3 | **not met** |" in summary.render(summary.goals(text))
