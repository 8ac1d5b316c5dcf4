"""Every benchmark in bench/ still runs against the code as it is: each is started the way
docs/benchmarks.md says, at a tiny size, and must exit 0, and every figure its goal lines
print must be one its own output shows (bench_parse, bench_hostile and bench_scale's shard
projection: the exact row).
Nothing here looks at a time; the figures come from `make bench` (docs/benchmarks.md).
(The real-engine benchmarks, engines_measure and loop_recovery, run the same code as the
real-engine tests.) `make bench` itself (bench/snapshot.py) is run here on one quick
section into a copy of the doc."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable

import pytest
from bench import _shards

from llm_health.core.shard import Shard
from tests.fixtures.paths import ROOT

SMALL = {
    "bench_parse": ["--repeat", "1", "--number", "3"],
    "bench_decision": [],
    "bench_scale": ["--backends", "10", "--interval", "1", "--rounds", "1"],
    "bench_client": ["--reads", "20", "--backends", "2", "--passes", "1"],
    "bench_hostile": ["--backends", "5", "--interval", "0.5", "--seconds", "2"],
    "bench_gate": ["--rate", "50", "--seconds", "1"],
    "bench_admission": ["--rates", "20", "--litellm-rates", "10", "--seconds", "1", "--closed-seconds", "0.5", "--concurrency", "4"],
    "bench_leases": ["--handoffs", "20", "--poll-handoffs", "3", "--seconds", "0.5", "--waiters", "4", "--gpus", "2", "--hold-ms", "1"],
    "bench_redis_view": ["--gpus", "200", "--queued", "200", "--routes", "2", "--refreshes", "2"],
    "bench_goodput": ["--sim-only", "--sim-seconds", "10", "--no-plot"],  # the simulated fleet; the real vLLM run is long (make bench-long)
}


def test_every_benchmark_is_listed_here():
    found = {p.stem for p in (ROOT / "bench").glob("bench_*.py")}
    assert found == set(SMALL), f"add the new benchmark to SMALL: {sorted(found - set(SMALL))}"


GOAL = re.compile(r"^goal: (?P<goal>.+); measured: (?P<measured>.+): (?P<verdict>met|NOT met)$", re.M)


def parse_goals_are_its_rows(out: str) -> None:
    """bench_parse: each engine's goal line names the smallest "own" ratio of its own rows, as
    printed there, and its verdict is that printed figure against 40x (a figure rounded to the
    boundary once printed "minimum 40x ... NOT met")."""
    own: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.endswith("x") and ".prom " in line:
            own.setdefault(line.split("-", 1)[0], []).append(line.split("|")[1].split()[-1])
    goals = {m["goal"].split()[0]: m for m in GOAL.finditer(out)}
    assert set(goals) == set(own), out
    for engine, ratios in own.items():
        printed = re.match(r"minimum (\d+\.\d)x", goals[engine]["measured"])[1]
        assert float(printed) == min(float(r.rstrip("x")) for r in ratios), (engine, out)
        assert f"{printed}x" in ratios, (engine, out)
        assert (goals[engine]["verdict"] == "met") == (float(printed) >= 40), (engine, out)


def hostile_goal_is_its_table(out: str) -> None:
    """bench_hostile: the goal line's longest interval is the table's "with" column."""
    row = next(line for line in out.splitlines() if line.startswith("healthy round interval, max"))
    (m,) = GOAL.finditer(out)
    assert f"longest interval {row.split()[-2]} s" in m["measured"], out


def scale_shards_goal_is_its_row(out: str) -> None:
    """bench_scale: the shard goal's count, largest shard and share are that count's row of
    the shard table, each row's share is its largest shard times the round cost the table's
    first line states (at 10 s rounds, to its printed digit), and the verdict is the count
    against the goal's own "at most" (bench/_shards.py)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("shards for "))
    round_ms = float(re.search(r"the (\d+\.\d{3}) ms a backend round", lines[head])[1])
    rows = {}
    for line in lines[head + 2 :]:
        if not re.match(r"^ +\d+ ", line):
            break
        shards, largest, _smallest, percent = line.split()
        rows[int(shards)] = (largest, percent.rstrip("%"))
        assert abs(100 * int(largest.replace(",", "")) * round_ms / 10_000 - float(percent.rstrip("%"))) <= 0.05 + 1e-9, line
    assert {10, 16, 20, 32} <= set(rows), out
    (m,) = [m for m in GOAL.finditer(out) if "split by hashmod" in m["goal"]]
    measured = re.fullmatch(r"(\d+) shards, the largest ([\d,]+) backends at (\d+\.\d)% of one core", m["measured"])
    assert measured, m[0]
    shards, largest, percent = int(measured[1]), measured[2], measured[3]
    assert rows.get(shards) == (largest, percent), (m[0], rows)
    assert float(percent) < 70 and all(float(p) >= 70 for n, (_, p) in rows.items() if n < shards), (m[0], rows)
    at_most = int(re.search(r"in at most (\d+) shards", m["goal"])[1])
    assert (m["verdict"] == "met") == (shards <= at_most), m[0]


FIGURE = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?")


def goal_figures_are_in_the_table(out: str) -> None:
    """Every benchmark: each figure a goal line's "measured" part prints (a number, as
    printed, to its last digit) also appears in the output outside the goal lines: the
    table or the line it was computed from. A goal line cannot quote a figure its run did
    not show."""
    rest = "\n".join(line for line in out.splitlines() if not GOAL.match(line.strip()))
    shown = set(FIGURE.findall(rest))
    for m in GOAL.finditer(out):
        if m["measured"].startswith("NOT RUN"):  # a goal not measured at its rate or size quotes no figure
            continue
        for figure in FIGURE.findall(m["measured"]):
            assert figure in shown or figure.lstrip("+") in shown, f"goal line figure {figure!r} is in no table:\n{m[0]}\n\n{out[-3000:]}"


CONSISTENT: dict[str, Callable[[str], None]] = {
    "bench_parse": parse_goals_are_its_rows,
    "bench_hostile": hostile_goal_is_its_table,
    "bench_scale": scale_shards_goal_is_its_row,
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_benchmark_runs(name):
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", *SMALL[name]], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, f"python -m bench.{name} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "machine" in out.stdout.lower()  # every benchmark says what it ran on
    # Every benchmark judges its goal from what it measured, in one format (docs/benchmarks.md
    # quotes these lines); at this tiny size the verdict itself means nothing.
    assert GOAL.search(out.stdout), f"bench.{name} prints no goal line:\n{out.stdout[-2000:]}"
    goal_figures_are_in_the_table(out.stdout)
    if name in CONSISTENT:
        CONSISTENT[name](out.stdout)


def test_the_shard_projection_splits_as_the_exporter_does():
    """bench_scale's shard table (bench/_shards.py) counts each shard's backends as the
    exporter's `shard:` setting assigns them (core.shard.Shard.owns), and its fewest-shards
    search, which starts where an even split would fit, finds what trying every count finds."""
    fleet = _shards.fleet_hashes(500)
    for total in (1, 7, 16):
        sizes = [sum(1 for i in range(500) if Shard(index, total).owns(f"b{i}")) for index in range(total)]
        split = _shards.split(fleet, total, 10.0)
        assert (split.largest, split.smallest) == (max(sizes), min(sizes))
        assert split.percent == round(100 * max(sizes) * 10.0 / 10_000, 1)
    for round_ms, under in ((10.0, 10.0), (10.0, 7.0), (3.0, 1.0)):
        found = _shards.fewest(fleet, round_ms, under)
        tried = next(n for n in range(1, _shards.MAX_SHARDS + 1) if _shards.split(fleet, n, round_ms).percent < under)
        assert found is not None and found.shards == tried, (round_ms, under)
    assert _shards.fewest(fleet, 8000.0, 70.0) is None  # one backend alone is 80% of a core: no count fits


def test_snapshot_writes_a_section_at_this_commit(tmp_path):
    """`python -m bench.snapshot --only bench_decision` into a copy of the doc: the block
    records HEAD and the section's paths, and `python -m bench.summary` reads the summary
    the snapshot wrote (the stale marks computed from git)."""
    from bench import summary

    doc = tmp_path / "benchmarks.md"
    doc.write_text(summary.DOC.read_text(encoding="utf-8"), encoding="utf-8")
    argv = [sys.executable, "-m", "bench.snapshot", "--only", "bench_decision", "--doc", str(doc), "--allow-dirty"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (block,) = [b for b in summary.blocks(doc.read_text(encoding="utf-8")) if b.name == "bench_decision"]
    assert block.commit == head and "bench/bench_decision.py" in block.paths
    assert summary.goals(block.body), block.body
    printed = subprocess.run([sys.executable, "-m", "bench.summary", "--doc", str(doc)], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert printed.strip() == summary.current(doc.read_text(encoding="utf-8")).strip()
