"""bench_goodput's underload goal: judged on the mean of each policy's mirrored windows, the
goal line's figures tied to the table's rows by the same checker docs/benchmarks.md passes."""

from __future__ import annotations

import re

from bench._goodput_model import Arrival, Outcome, Result, goals, table

from tests.fixtures.bench_tables import _goodput_part


def result(policy: str, load: float, on_time: int, run: int = 1, late: int = 0) -> Result:
    outcomes = []
    for i in range(100):
        o = Outcome(Arrival(f"{policy}-{run}-{i}", float(i), 1.0), ok=i < on_time, done_at=i + 0.5, tokens=16, attempts=1, codes=["200"], copies=1)
        o.copies_late = 1 if i < late else 0
        outcomes.append(o)
    return Result(policy, load, 100.0, 1.0, outcomes, 16.0 * 100, run=run)


def rows(door_runs: tuple[int, int], direct_runs: tuple[int, int]) -> list[Result]:
    out = []
    for load in (2.0, 4.0):
        out += [result("direct", load, 50), result("gate", load, 95), result("vllm cap 8", load, 70)]
    out += [result("direct", 0.8, direct_runs[0]), result("gate", 0.8, door_runs[0]), result("vllm cap 8", 0.8, 80)]
    out += [result("gate", 0.8, door_runs[1], run=2), result("direct", 0.8, direct_runs[1], run=2)]
    return out


def underload(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("goal: gate at 0.8x"))


def test_the_underload_goal_is_the_mean_of_the_mirrored_windows() -> None:
    # One window 3.8% under direct, the other 2.5% above: the means are 0.6% apart.
    results = rows((77, 82), (80, 80))
    lines = goals(results, doors=("gate",))
    line = underload(lines)
    assert "0.7950/s against 0.8000/s, 0.6% below; 0 failed: met" in line
    assert "windows 0.770 and 0.820" in "\n".join(lines)
    out = "\n".join([*table(results), *lines])
    assert "| gate (run 2) | 0.8x |" in out
    _goodput_part(out, "")  # the doc's own checker: figures from the rows, verdicts from the figures


def test_a_door_below_direct_on_the_means_misses_and_late_copies_of_the_repeat_count() -> None:
    results = rows((77, 77), (80, 80))
    results[-2] = result("gate", 0.8, 77, run=2, late=1)
    lines = goals(results, doors=("gate",))
    assert underload(lines).endswith("3.8% below; 0 failed: NOT met")
    copies = next(line for line in lines if "copies reach the engine" in line)
    assert re.search(r"measured: 1 \(direct 0\); 0 failed: NOT met$", copies), copies
    _goodput_part("\n".join([*table(results), *lines]), "")


def test_the_truth_at_a_decision_is_the_oldest_copy_waiting_at_that_instant() -> None:
    from bench._goodput_real import Upstream

    up = Upstream("http://127.0.0.1:1")
    up.spans = [(0.0, 5.0), (1.0, 6.0), (2.0, 3.0), (3.0, 10.0)]
    up.inflight = {7: 4.0}
    assert up.oldest_waiting_s(1, 2.5) == 1.5  # 0 runs; 1 (the oldest waiting), 2 in flight
    assert up.oldest_waiting_s(1, 3.0) == 2.0  # 2 has left; 3 arrives behind 1
    assert up.oldest_waiting_s(1, 5.5) == 2.5  # 0 has left: 1 runs, 3 waits since 3.0
    assert up.oldest_waiting_s(3, 5.5) == 0.0  # room for all three: nothing waits
    assert up.oldest_waiting_s(2, 5.5) == 1.5  # the copy still in flight, since 4.0


def test_the_age_checks_judge_fresh_refusals_on_the_clause_that_refused_them() -> None:
    from bench._goodput_model import AgeRefusal, age_checks

    ages = [
        AgeRefusal(door_ms=3000, slack_ms=3200, truth_ms=2900, fresh=True),  # on the slack, true within a round
        AgeRefusal(door_ms=2900, slack_ms=3200, truth_ms=200, fresh=True),  # on the slack: 200 + 1000 + 400 < 3200, wrong
        AgeRefusal(door_ms=2100, slack_ms=12000, truth_ms=1800, fresh=True),  # on the cap (2000): a round older the truth is over it
        AgeRefusal(door_ms=2500, slack_ms=12000, truth_ms=500, fresh=True),  # on the cap, the truth far under it: wrong
        AgeRefusal(door_ms=9000, slack_ms=1000, truth_ms=0, fresh=False),  # a retry: in the distance, not in the fresh counts
    ]
    r = Result("gate", 4.0, 100.0, 1.0, [], 0.0, ages=ages)
    (line,) = age_checks([r], service_ms=400, cap_ms=2000)
    assert line.startswith("gate at 4x: 5 reject_age_beats_slack (4 fresh, 1 retries); ")
    assert "median +2.00 s, min +0.10 s, max +9.00 s, 3 more than a round (1 s) off" in line
    assert "would not have refused: 2 (of 2 on the slack with the expected service 400 ms, 2 on the age cap 2000 ms)" in line
    # the words alone: the last three fresh ones, one of them over the cap in truth
    assert "younger than the slack less a round: 3 (1 of them over the age cap and 0 within the expected service of the slack, in truth)" in line


def test_the_yardstick_prints_the_doors_against_the_largest_output_of_any_window() -> None:
    from bench._goodput_model import yardstick

    results = rows((80, 80), (80, 80))
    results[1].generated = 16.0 * 120  # the gate at 2x: the engine made 1.2 answers' worth/s, above C (1.0)
    first, second = yardstick(results, doors=("gate",))
    assert first == (
        "the engine's own output in the windows: 1.000 (direct at 2x) to 1.200 (gate at 2x) answers' worth/s, against C 1.000: "
        "above C in 1 windows, so C understated the engine then"
    )
    assert second.endswith("(1.200/s), a stricter reading than the goals': gate at 2x 0.79, gate at 4x 0.79")
