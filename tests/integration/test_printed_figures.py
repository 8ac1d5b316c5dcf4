"""Every figure a drill or benchmark prints in its verdict or goal line comes from the same
run: each test runs the command as a user does and checks the verdict against the
timeline or table the same output printed above it."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.fixtures.paths import ROOT


def run(*argv: str, timeout: float = 300) -> str:
    out = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def table(text: str) -> dict[str, dict[str, str]]:
    """The `a | b | c` table of sim.replay.format_table, by its first column."""
    lines = [line for line in text.splitlines() if " | " in line]
    header = [c.strip() for c in lines[0].split("|")]
    return {cells[0]: dict(zip(header, cells)) for cells in ([c.strip() for c in line.split("|")] for line in lines[1:])}


def section(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


def test_retry_drill_verdict_is_its_own_timeline():
    out = run("llm_health", "drill", "retry", "--time-scale", "0.1")
    verdict = re.search(r"verdict: PASS: the gate rejected the first retry at T\+(\d+) ms \((\d+) (\w+), deadline slack (-?\d+) ms\)", out)
    assert verdict, out
    at, status, code, slack = verdict.groups()
    gated = section(out, "gated (", "attempts")
    # The refusal the verdict names is the one on the gated timeline, at the same time.
    assert re.search(rf"T\+\s*{at} ms  admission: REJECTS lab-1 with {status} {code}", gated), gated
    # The refusal came after the deadline (T+3000), so the slack is negative; the gate
    # measured it when the retry arrived, at most a little before the refusal (the 50 ms
    # allow for the drill's whole-millisecond clocks at a 0.1 time scale).
    assert 3000 - int(at) - 50 <= int(slack) < 0
    # The table's counts are the timelines' own.
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("uncapped ", "gated "))}
    uncapped = section(out, "uncapped (", "gated (")
    for name, timeline in (("uncapped", uncapped), ("gated", gated)):
        attempts, calls, units, _ = rows[name]
        assert int(attempts) == timeline.count("retry_proxy: sends lab-1"), (name, out)
        assert int(calls) == len(re.findall(r"fake_worker: lab-1 (returns|replies)", timeline)), (name, out)
        assert int(units) == 272 * int(calls)


def test_watchdog_drill_verdict_is_its_own_table():
    out = run("llm_health", "drill", "watchdog")
    rows = table(out)
    verdict = re.search(r"\((\d+) s after the hang at a 5-minute check, (\d+) s with 10 s rounds\).*made (\d+) and (\d+) false restarts", out)
    assert verdict, out
    check, exporter, naive, cascade = verdict.groups()
    assert rows["llm-health check every 5 min"]["hang_detection_seconds"] == check
    assert rows["llm-health exporter, 10 s rounds"]["hang_detection_seconds"] == exporter
    assert (rows["naive"]["false_restarts"], rows["naive+cascade"]["false_restarts"]) == (naive, cascade)


def test_decision_benchmark_goal_lines_are_its_own_table():
    out = run("bench.bench_decision")
    rows = table(out)
    goals = re.findall(
        r"goal: (.+?): 0 false restarts.*measured: (\d+) false restarts, (\d+) probes to a busy server, (\d+) true restart, found at read (\d+): (met|NOT met)",
        out,
    )
    assert len(goals) == 2, out
    for name, false, busy, true, read, verdict in goals:
        row = rows[name]
        assert (row["false_restarts"], row["probes_to_busy_server"], row["true_restarts"]) == (false, busy, true)
        assert f"{name}: hang found {row['hang_detection_seconds']} s after it began, at read {read} after it" in out
        assert verdict == ("met" if (false, busy, true) == ("0", "0", "1") and int(read) <= 3 else "NOT met")
    assert f"{len(rows)} simulated days in" in out
