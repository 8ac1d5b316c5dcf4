"""Every benchmark in bench/ still runs against the code as it is: each is started the way
docs/benchmarks.md says, at a tiny size, and must exit 0. Nothing here looks at a time;
the figures come from the full runs in docs/benchmarks.md. (The real-engine benchmarks,
engines_measure and loop_recovery, run the same code as the real-engine tests.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.paths import ROOT

SMALL = {
    "bench_parse": [],
    "bench_decision": [],
    "bench_scale": ["--backends", "10", "--interval", "1", "--rounds", "1"],
    "bench_hostile": ["--backends", "5", "--interval", "0.5", "--seconds", "2"],
    "bench_gate": ["--rate", "50", "--seconds", "1"],
    "bench_leases": ["--handoffs", "20", "--poll-handoffs", "3", "--seconds", "0.5", "--waiters", "4", "--gpus", "2", "--hold-ms", "1"],
    "bench_redis_view": ["--gpus", "200", "--queued", "200", "--routes", "2", "--refreshes", "2"],
}


def test_every_benchmark_is_listed_here():
    found = {p.stem for p in (ROOT / "bench").glob("bench_*.py")}
    assert found == set(SMALL), f"add the new benchmark to SMALL: {sorted(found - set(SMALL))}"


@pytest.mark.parametrize("name", sorted(SMALL))
def test_benchmark_runs(name):
    out = subprocess.run([sys.executable, "-m", f"bench.{name}", *SMALL[name]], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, f"python -m bench.{name} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert "machine" in out.stdout.lower()  # every benchmark says what it ran on
