"""Every benchmark in bench/ still runs against the code as it is: each is started the way
docs/benchmarks.md says, at a tiny size, and must exit 0 with no request failed (no FAILED
line), every figure its goal lines print must be one its own output shows, and each goal
figure is recomputed from the benchmark's own table and its verdict from that figure
(tests/fixtures/bench_tables.py, for every benchmark).
Nothing here looks at a time; the figures come from `make bench` (docs/benchmarks.md).
(The real-engine benchmarks, engines_measure and loop_recovery, run the same code as the
real-engine tests.) `make bench` itself (bench/snapshot.py) is run here on one quick
section into a copy of the doc."""

from __future__ import annotations

import subprocess
import sys

import pytest
from bench import _shards

from llm_health.core.shard import Shard
from tests.fixtures import bench_tables
from tests.fixtures.bench_tables import GOAL
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
    assert set(bench_tables.CHECKS) == set(SMALL), "every benchmark's goal figures are recomputed from its table: add it to bench_tables.CHECKS"


@pytest.mark.parametrize("name", sorted(SMALL))
def test_benchmark_runs(name):
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", *SMALL[name]], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, f"python -m bench.{name} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "machine" in out.stdout.lower()  # every benchmark says what it ran on
    # Every benchmark judges its goal from what it measured, in one format (docs/benchmarks.md
    # quotes these lines); at this tiny size the verdict itself means nothing.
    assert GOAL.search(out.stdout), f"bench.{name} prints no goal line:\n{out.stdout[-2000:]}"
    # a run with failed requests: its FAILED lines, and the benchmark's stderr (a server that exited says so there)
    assert not bench_tables.FAILED.search(out.stdout), "\n".join(m[0] for m in bench_tables.FAILED.finditer(out.stdout)) + "\n" + out.stderr[-3000:]
    bench_tables.CHECKS[name](out.stdout)


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
