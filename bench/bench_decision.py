"""Decision quality: a day with a batch job and one real hang, replayed in simulated time.

A naive watchdog (real request every 5 minutes, 45 s timeout, restart after 5 failures),
the same with a second watchdog that counts HTTP 500s, and llm-health at the
same 5-minute cadence (`llm-health check`: reads 10 s apart) and as the exporter
(continuous 10 s rounds). Goal: 0 false restarts, 0 probes sent to a busy server, the
hang found within 2 rounds.

    python -m bench.bench_decision
"""

from __future__ import annotations

import dataclasses
import time

from bench._goal import goal_line
from bench._machine import machine_line
from llm_health.sim.replay import DayPlan, format_table, replay

# "Within 2 rounds": the first read after the hang is the baseline, then two rounds
# without progress, so the hang is found at the 3rd read at the latest.
GOAL_READ = 3
NAIVE_LUCK = (0.25, 0.5)


def main() -> None:
    plan = DayPlan()
    started = time.perf_counter()
    outcomes = [replay(plan, ("naive",)), replay(plan, ("naive", "cascade"))]
    for share in NAIVE_LUCK:  # the naive watchdog when some requests to a busy server get through
        lucky = replay(dataclasses.replace(plan, naive_busy_success=share), ("naive",))
        lucky.watchdogs = (f"naive, {share:.0%} answered when busy",)
        outcomes.append(lucky)
    ours = [replay(plan, ("llm-health",)), replay(dataclasses.replace(plan, check_period=plan.check_interval, check_rounds=0), ("llm-health",))]
    ours[0].watchdogs, ours[1].watchdogs = ("llm-health check every 5 min",), ("llm-health exporter (10 s rounds)",)
    outcomes += ours
    elapsed = time.perf_counter() - started
    print(f"machine: {machine_line()}")
    print(f"plan: {plan}")
    print()
    print(format_table(outcomes))
    print()
    for o in ours:
        print(
            f"{'+'.join(o.watchdogs)}: hang found {o.detection_seconds:.0f} s after it began, at read {o.hang_detected_rounds} after it (first read = baseline)"
        )
    for o in ours:
        met = o.false_restarts == 0 and o.probes_to_busy == 0 and o.true_restarts == 1 and 0 < (o.hang_detected_rounds or 0) <= GOAL_READ
        print(
            goal_line(
                f"{'+'.join(o.watchdogs)}: 0 false restarts, 0 probes to a busy server, the hang restarted, found by read {GOAL_READ} after it",
                f"{o.false_restarts} false restarts, {o.probes_to_busy} probes to a busy server, {o.true_restarts} true restart, found at read {o.hang_detected_rounds}",
                met,
            )
        )
    print(f"\n{len(outcomes)} simulated days in {elapsed:.1f} s of wall time")


if __name__ == "__main__":
    main()
