"""docs/benchmarks.md is one snapshot written by `make bench` (bench/snapshot.py): a block
per section with the commit it ran at and the paths it measures, and a summary computed from
those blocks and git (bench/summary.py). The summary can hold no goal, figure or verdict that
no run printed, and it marks a section stale when its paths changed since its commit: a doc
that claims fresh figures for changed code fails here."""

from __future__ import annotations

import subprocess

import pytest
from bench import snapshot, summary
from bench.sections import SECTIONS

MAX_LINES = 570  # 560 before bench_goodput logged its free-sequence shares (one line per load; 561 lines at c14e396); 400 before bench_goodput: its two tables (real vLLM, 21 rows with the underload repeats; simulated fleet, 18) and 18 goal lines; 530 before the nginx Lua door (its rows, CPU line, 3 goals and profile); 545 before bench_goodput's yardstick lines (3), with room for its age lines, one per door window with an age refusal (7 at a9434db, up to 10)


def test_the_summary_and_its_stale_marks_match_git():
    text = summary.DOC.read_text(encoding="utf-8")
    assert summary.current(text) == summary.render(summary.blocks(text)), (
        "docs/benchmarks.md's summary is not what the blocks and git say (a section whose measured paths "
        "changed still marked fresh, or the reverse): rerun it (make bench, or python -m bench.snapshot --only NAME), "
        "or mark it with python -m bench.summary --write"
    )


def test_one_block_per_section_in_order_and_under_the_length_limit():
    text = summary.DOC.read_text(encoding="utf-8")
    assert [b.name for b in summary.blocks(text)] == [s.name for s in SECTIONS]
    assert len(text.splitlines()) <= MAX_LINES, f"docs/benchmarks.md has {len(text.splitlines())} lines, over {MAX_LINES}"
    assert text == snapshot.document({b.name: b for b in summary.blocks(text)}), "the doc is not what bench/snapshot.py writes"


def test_a_ran_section_records_what_it_measures():
    for b in summary.blocks(summary.DOC.read_text(encoding="utf-8")):
        if b.commit != summary.NOT_RUN:
            assert len(b.commit) == 40 and b.date != summary.NOT_RUN, b.name
            assert summary.goals(b.body), f"{b.name}: a ran section with no goal line"


def test_goal_lines_are_read_only_from_code_blocks():
    body = "\ngoal: x; measured: 1: met\n\n```\ngoal: y; measured: 2 | 3: NOT met\n```\n"
    assert summary.goals(body) == [("y", "2 | 3", False)]


def _git(repo, *args: str) -> str:
    argv = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def committed(repo, *names: str):
    """A git repository at ``repo`` whose first commit holds the files ``names``, each one line."""
    _git(repo, "init", "-q")
    for i, name in enumerate(names):
        (repo / name).write_text(f"x{i} = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "first")
    return repo


@pytest.fixture
def repo(tmp_path):
    return committed(tmp_path, "measured.py", "other.py")


def _block(commit: str) -> summary.Block:
    body = "\n```\ngoal: g; measured: 1: met\n```\n"
    return summary.Block("bench_x", commit, "2026-01-01T00:00Z", ("measured.py",), body)


def test_a_section_is_stale_once_a_measured_path_changes(repo):
    head = _git(repo, "rev-parse", "HEAD")
    assert summary.staleness(_block(head), repo) == "fresh"
    (repo / "other.py").write_text("y = 2\n")  # not measured: still fresh
    assert summary.staleness(_block(head), repo) == "fresh"
    (repo / "measured.py").write_text("x = 2\n")  # changed in the work tree
    assert summary.staleness(_block(head), repo) == "stale: 1 measured file changed since"
    _git(repo, "commit", "-q", "-am", "second")  # and committed
    assert summary.staleness(_block(head), repo).startswith("stale")
    assert summary.staleness(_block(_git(repo, "rev-parse", "HEAD")), repo) == "fresh"


def test_an_unknown_commit_is_stale_and_a_section_never_run_says_so(repo):
    assert summary.staleness(_block("0" * 40), repo) == "stale: its commit is not in this history"
    assert summary.staleness(_block(summary.NOT_RUN), repo) == "not run"


def test_a_stale_section_is_marked_in_the_summary(repo):
    head = _git(repo, "rev-parse", "HEAD")
    fresh = summary.render([_block(head)], repo)
    assert "| fresh | 1 of 1 |" in fresh and "1 of 1 goal lines of fresh sections met" in fresh
    (repo / "measured.py").write_text("x = 3\n")
    stale = summary.render([_block(head)], repo)
    assert "| **stale: 1 measured file changed since** | 1 of 1 |" in stale
    assert "0 of 0 goal lines of fresh sections met; 1 of 1 in all" in stale


def test_a_section_with_a_goal_not_met_is_tallied_in_bold(repo):
    head = _git(repo, "rev-parse", "HEAD")
    body = "\n```\ngoal: g; measured: 1: met\ngoal: h; measured: 2: NOT met\n```\n"
    text = summary.render([summary.Block("bench_x", head, "2026-01-01T00:00Z", ("measured.py",), body)], repo)
    assert "| fresh | **1 of 2** |" in text and "1 of 2 goal lines of fresh sections met" in text
