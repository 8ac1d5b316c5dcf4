"""Decision quality on a day with a batch job and one real hang (simulated time): the goals of the benchmark, as tests."""

from __future__ import annotations

import dataclasses

from llm_health.sim.replay import DayPlan, replay

PLAN = DayPlan()


def test_naive_watchdog_restarts_a_healthy_server():
    o = replay(PLAN, ("naive",))
    assert o.false_restarts >= 3  # the batch job makes its real request time out
    assert o.probes_to_busy > 0
    assert o.true_restarts == 1


def test_the_field_reports_8_restarts_only_when_no_busy_request_gets_through():
    """The README's day: 8 restarts (7 false, the real hang's 1) with `naive_busy_success` 0,
    3 when a quarter of the requests to the busy server come back in time, 1 at half."""
    got = {}
    for share in (0.0, 0.25, 0.5):
        o = replay(dataclasses.replace(PLAN, naive_busy_success=share), ("naive",))
        got[share] = (len(o.restarts), o.false_restarts, o.true_restarts)
    assert PLAN.naive_busy_success == 0.0
    assert got == {0.0: (8, 7, 1), 0.25: (3, 2, 1), 0.5: (1, 0, 1)}


def test_cascade_makes_it_worse():
    assert replay(PLAN, ("naive", "cascade")).false_restarts > replay(PLAN, ("naive",)).false_restarts


def test_llm_health_check_same_cadence():
    o = replay(PLAN, ("llm-health",))
    assert (o.false_restarts, o.true_restarts, o.probes_to_busy) == (0, 1, 0)
    assert o.probes_sent > 0  # idle engines were probed
    # baseline read, then two rounds without progress
    assert o.hang_detected_rounds == 3
    assert o.detection_seconds <= PLAN.check_period + 2 * PLAN.check_interval


def test_llm_health_exporter_rounds():
    o = replay(dataclasses.replace(PLAN, check_period=PLAN.check_interval, check_rounds=0), ("llm-health",))
    assert (o.false_restarts, o.true_restarts, o.probes_to_busy) == (0, 1, 0)
    assert o.detection_seconds <= 3 * PLAN.check_interval


def test_slower_engine_still_not_hung():
    """At 1 token/s the batch still moves every 10 s round: never a restart."""
    o = replay(dataclasses.replace(PLAN, tokens_per_second=1.0, hang_at=10 * 24 * 3600), ("llm-health",))
    assert o.restarts == []
