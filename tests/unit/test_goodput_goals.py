"""bench_goodput's goals judged on each policy's window merged from its interleaved blocks,
the goal line's figures tied to the table's rows by the same checker docs/benchmarks.md
passes."""

from __future__ import annotations

import dataclasses
import re

import pytest
from bench import _goodput_sim
from bench._goodput_model import AgeRefusal, Arrival, Outcome, Result, goals, merge, schedule, table
from bench._goodput_wire import Upstream

from tests.fixtures.bench_tables import _goodput_part


def result(policy: str, load: float, on_time: int, late: int = 0, n: int = 50, tag: str = "") -> Result:
    """A block of `n` requests a second apart over `n` seconds, the first `on_time` answered
    half a second after they arrived."""
    outcomes = []
    for i in range(n):
        o = Outcome(Arrival(f"{policy}-{tag}{i}", float(i), 1.0), ok=i < on_time, done_at=i + 0.5, tokens=16, attempts=1, codes=["200"], copies=1)
        o.copies_late = 1 if i < late else 0
        outcomes.append(o)
    return Result(policy, load, float(n), 1.0, outcomes, 16.0 * n)


def window(policy: str, load: float, blocks: tuple[int, ...], late: int = 0) -> Result:
    return merge([result(policy, load, k, late=late if i == 0 else 0, tag=f"b{i}-") for i, k in enumerate(blocks)])


def rows(door_blocks: tuple[int, int], direct_blocks: tuple[int, int], late: int = 0) -> list[Result]:
    out = []
    for load in (2.0, 4.0):
        out += [window("direct", load, (25, 25)), window("gate", load, (47, 48)), window("vllm cap 8", load, (35, 35))]
    out += [window("direct", 0.8, direct_blocks), window("gate", 0.8, door_blocks, late=late), window("vllm cap 8", 0.8, (40, 40))]
    return out


def underload(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("goal: gate at 0.8x"))


def test_merge_puts_a_policys_blocks_end_to_end() -> None:
    a, b = result("gate", 2.0, 40, late=3), result("gate", 2.0, 30, tag="b-")
    a.ages = [AgeRefusal(1000, 900, 950, True)]
    b.outcomes[0].done_at = 50.5  # answered after its block's end (a race with the block's cancel): not in the window
    b.outcomes[1].done_at = 49.9  # inside it, late for its deadline (1 s): kept, moved on, not on time
    m = merge([a, b])
    assert (m.seconds, m.generated, len(m.outcomes), m.ages, m.parts) == (100.0, 1600.0, 100, a.ages, (0.8, 0.56))
    assert [o.arrival.at for o in m.outcomes[49:52]] == [49.0, 50.0, 51.0]
    assert [o.done_at for o in m.outcomes[50:52]] == [None, 99.9]
    assert len(m.on_time()) == 40 + 28 and m.copies_late == 3
    assert m.outcomes[50].arrival.id == "gate-b-0" and b.outcomes[0].done_at == 50.5  # the blocks themselves unchanged
    with pytest.raises(ValueError, match="merge: direct at 2x among gate at 2x"):
        merge([a, result("direct", 2.0, 1)])


def test_the_underload_goal_is_judged_on_the_merged_blocks() -> None:
    # One block 5% under direct, the other 2.5% above: the windows are 1.3% apart.
    results = rows((38, 41), (40, 40))
    lines = goals(results, doors=("gate",))
    line = underload(lines)
    assert "0.7900/s against 0.8000/s, 1.3% below; 0 failed: met" in line, line
    assert "gate at 0.8x: 0.7900/s (blocks 0.760 and 0.820), direct 0.8000/s (blocks 0.800 and 0.800): 1.3% below direct" in lines
    out = "\n".join([*table(results), *lines])
    assert "| gate | 0.8x | 100 | 79 | 0.790 |" in out
    _goodput_part(out, "")  # the doc's own checker: figures from the rows, verdicts from the figures


def test_a_door_below_direct_misses_and_late_copies_of_any_block_count() -> None:
    results = rows((38, 38), (40, 40), late=1)
    lines = goals(results, doors=("gate",))
    assert underload(lines).endswith("5.0% below; 0 failed: NOT met")
    copies = next(line for line in lines if "copies reach the engine" in line)
    assert re.search(r"measured: 1 \(direct 0\); 0 failed: NOT met$", copies), copies
    _goodput_part("\n".join([*table(results), *lines]), "")


def test_the_truth_at_a_decision_is_the_oldest_copy_waiting_at_that_instant() -> None:
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

    results = rows((40, 40), (40, 40))
    results[1].generated = 16.0 * 120  # the gate at 2x: the engine made 1.2 answers' worth/s, above its load's C (1.0)
    for r in results:
        if r.load == 4.0:
            r.capacity = 1.25  # each load is judged on its own C (the closed loops between its blocks)
    first, second = yardstick(results, doors=("gate",))
    assert first == (
        "the engine's own output in the windows: 1.000 (direct at 2x) to 1.200 (gate at 2x) answers' worth/s, against C 1.000 to 1.250: "
        "above its load's C in 1 windows, so C understated the engine then"
    )
    assert second.endswith("(1.200/s), a stricter reading than the goals': gate at 2x 0.79, gate at 4x 0.79")


def test_free_share_is_the_time_a_sequence_stood_free():
    """The pass-through's diagnostic: the share of a block with fewer copies at the engine
    than its sequences (copies that left, and one still in flight, cut at the block's edges)."""
    up = Upstream("http://127.0.0.1:1")
    up.spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    assert up.free_share(2, 0.0, 10.0) == 0.9  # two at once only in [1, 2)
    up.inflight = {1: 9.0}
    assert up.free_share(1, 0.0, 10.0) == 0.5  # one or more in [0, 3), [5, 6), [9, 10)
    assert up.free_share(1, 1.0, 3.0) == 0.0


def test_a_service_configured_low_wastes_the_engine():
    """docs/admission.md's advice on `expected_service_ms`, on bench_goodput's simulated fleet
    (16 engines of 4 sequences, 2 s a request, 120 virtual seconds, seed 1): the door
    configured 25% below the true service admits requests that finish late, wasting the
    engine's tokens and goodput under overload; 25% above costs nothing there; below
    capacity none of the three changes anything. Virtual time: no clock is read."""
    engines, slots, service, seconds = 16, 4, 2.0, 120.0
    c = _goodput_sim.capacity(engines, slots, service, 1, seconds)
    got = {}
    for load in (0.8, 2.0, 4.0):
        arrivals = schedule(1, load * c, seconds, service, f"sim{load:g}")
        for scale in (0.75, 1.0, 1.25):
            fleet = _goodput_sim.Fleet("door", engines, slots, service, 1)
            fleet.policy_cfg = dataclasses.replace(fleet.policy_cfg, expected_service_ms=service * 1000 * scale)
            r = Result("door", load, seconds, c, fleet.run(arrivals, seconds), fleet.generated)
            got[load, scale] = (round(r.fraction, 2), round(r.wasted * 100, 1))
    assert got[2.0, 0.75] == (0.93, 6.2) and got[4.0, 0.75] == (0.89, 11.3)
    assert got[2.0, 1.0] == (0.98, 1.1) and got[4.0, 1.0] == (0.99, 0.9)
    assert got[2.0, 1.25] == (0.99, 0.7) and got[4.0, 1.25] == (0.99, 0.8)
    assert got[0.8, 0.75] == got[0.8, 1.0] == got[0.8, 1.25]
