"""What docs/benchmarks.md's figures can be trusted for: each section's goal figures follow
from its own table (tests/fixtures/bench_tables.py), a projection or a figure of a run with
failed requests is never counted as a goal, a section measures what its code imports
(bench/_imports.py) and bench.summary refuses a path that is not there."""

from __future__ import annotations

import subprocess

import pytest
from bench import _shards, bench_gate, summary
from bench._unjudged import failed_line, projected_line
from bench.sections import SECTIONS

from tests.fixtures import bench_tables
from tests.unit.test_benchmarks_doc import _git, committed

RAN = [b for b in summary.blocks(summary.DOC.read_text(encoding="utf-8")) if b.commit != summary.NOT_RUN and b.name in bench_tables.CHECKS]


@pytest.mark.parametrize("block", RAN, ids=lambda b: b.name)
def test_each_sections_goal_figures_follow_from_its_table(block):
    bench_tables.no_failed_requests(block.body)
    bench_tables.CHECKS[block.name](block.body)


@pytest.mark.parametrize("block", [b for b in RAN if bench_tables._judged(b.body)], ids=lambda b: b.name)
def test_a_verdict_that_is_not_its_figures_is_caught(block):
    m = bench_tables._judged(block.body)[0]
    flipped = m[0][: -len(m["verdict"])] + ("NOT met" if m["verdict"] == "met" else "met")
    with pytest.raises(AssertionError):
        bench_tables.CHECKS[block.name](block.body.replace(m[0], flipped))


def test_a_failed_line_fails_the_check():
    with pytest.raises(AssertionError, match="failed requests"):
        bench_tables.no_failed_requests("```\n" + failed_line("g", "hop 3 of 3000 requests failed") + "\n```\n")


def test_the_sections_measure_what_their_code_imports():
    by = {s.name: s.measured for s in SECTIONS}
    for name, paths in by.items():
        assert paths[0] == f"bench/{name}.py" and "bench/_machine.py" in paths, name
        assert not [p for p in paths if not (summary.ROOT / p).exists()], name
    assert {"exporter/llm_health/sim/replay.py", "exporter/llm_health/sim/servers.py", "exporter/llm_health/sim/engines/vllm.py"} <= set(by["bench_decision"])
    assert "exporter/llm_health/core/engines/vllm.py" in by["bench_parse"] and "tests/data/real-world/metrics" in by["bench_parse"]
    assert "bench/bench_scale.py" in by["bench_client"]  # a benchmark imported by another
    assert "exporter/llm_health/__main__.py" in by["bench_admission"]  # a `python -m llm_health` it starts
    assert "tests/fixtures/loop.py" in by["loop_recovery"]  # imported by the test file it runs
    assert "exporter/llm_health/gate/decision.py" in by["bench_gate"]


@pytest.fixture
def repo(tmp_path):
    return committed(tmp_path, "measured.py", "imported.py")


BODY = "\n```\ngoal: g; measured: 1: met\n```\n"


def test_a_path_not_in_its_commit_fails_the_summary(repo):
    head = _git(repo, "rev-parse", "HEAD")
    gone = summary.Block("bench_x", head, "2026-01-01T00:00Z", ("measured.py", "moved_away.py"), BODY)
    with pytest.raises(summary.MissingPath, match=r"moved_away\.py"):
        summary.staleness(gone, repo, ())
    with pytest.raises(summary.MissingPath, match=r"nowhere\.py"):  # measured now, and not here
        summary.staleness(summary.Block("bench_x", head, "d", ("measured.py",), BODY), repo, ("nowhere.py",))


def test_summary_exits_1_on_a_missing_path(tmp_path, capsys):
    head = subprocess.run(["git", "-C", str(summary.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        f"{summary.START}\n{summary.END}\n<!-- bench bench_x commit={head} date=d paths=bench/no_such_module.py -->\n{BODY}<!-- end bench bench_x -->\n"
    )
    assert summary.main(["--doc", str(doc)]) == 1
    assert "bench/no_such_module.py" in capsys.readouterr().err


def test_a_change_to_what_a_section_imports_now_makes_it_stale(repo):
    """The block recorded only measured.py (a hand list that missed an import): a change to
    imported.py, which the section measures now, still marks it stale."""
    block = summary.Block("bench_x", _git(repo, "rev-parse", "HEAD"), "d", ("measured.py",), BODY)
    assert summary.staleness(block, repo, ("imported.py",)) == "fresh"
    (repo / "imported.py").write_text("y = 2\n")
    assert summary.staleness(block, repo, ()) == "fresh"
    assert summary.staleness(block, repo, ("imported.py",)) == "stale: 1 measured file changed since"


def test_projected_and_failed_lines_are_counted_apart_from_goals(repo):
    body = (
        "\n```\n"
        + "\n".join(
            [
                "goal: g; measured: 1: met",
                projected_line("10000 backends at 10 s rounds in under one core", "67.7% of one core"),
                failed_line("the gate adds under 1 ms", "gate 3 of 3000 open-loop and 0 closed-loop requests failed"),
            ]
        )
        + "\n```\n"
    )
    assert summary.goals(body) == [("g", "1", True)]
    assert summary.projected(body) == [("10000 backends at 10 s rounds in under one core", "67.7% of one core")]
    assert len(summary.failed(body)) == 1
    text = summary.render([summary.Block("bench_x", _git(repo, "rev-parse", "HEAD"), "d", ("measured.py",), body)], repo, {"bench_x": ()})
    assert "| fresh | 1 of 1 | **1** | 1 |" in text
    assert "1 figures of runs with failed requests (FAILED), 1 projections" in text


def test_the_shard_figure_is_a_projection():
    _table, line = _shards.report(10_000, 0.677, 1.0)
    assert line.startswith("projected: ") and not summary.GOAL.match(line) and summary.PROJECTED.match(line)


def test_the_hop_stand_ins_match_what_they_replace():
    assert bench_gate.standin_drift() == []


def _gate_run(hop_errors: int) -> dict:
    lat = [0.001] * 10
    return {
        "direct": {"lat": lat, "errors": 0, "throughput": 100.0, "closed_errors": 0},
        "gate": {"lat": [0.002] * 10, "errors": 0, "throughput": 50.0, "closed_errors": 0},
        "hop": {"lat": [] if hop_errors else lat, "errors": hop_errors, "throughput": 0.0, "closed_errors": 7 if hop_errors else 0},
    }


def test_a_path_with_failed_requests_prints_no_figure_of_it():
    out = "\n".join(bench_gate.report(_gate_run(10), 500, 1))
    assert not [line for line in out.splitlines() if line.startswith("added by the HTTP hop alone:")]
    assert "FAILED: what is added by the HTTP hop alone; hop 10 of 10 open-loop and 7 closed-loop requests failed: no figure judged" in out
    assert summary.GOAL.match(out.splitlines()[-1])  # the gate's own goal is judged: its run failed nothing
    with pytest.raises(AssertionError):
        bench_tables.no_failed_requests(out)
    clean = "\n".join(bench_gate.report(_gate_run(0), 500, 1))
    bench_tables.no_failed_requests(clean)
    bench_tables.gate(clean)
