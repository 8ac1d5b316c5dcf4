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
import os
import platform
import time

from llm_health.sim.replay import DayPlan, format_table, replay


def main() -> None:
    plan = DayPlan()
    started = time.perf_counter()
    outcomes = [
        replay(plan, ("naive",)),
        replay(plan, ("naive", "cascade")),
        replay(plan, ("llm-health",)),
        replay(dataclasses.replace(plan, check_period=plan.check_interval, check_rounds=0), ("llm-health",)),
    ]
    outcomes[-1].watchdogs = ("llm-health exporter (10 s rounds)",)
    outcomes[-2].watchdogs = ("llm-health check every 5 min",)
    elapsed = time.perf_counter() - started
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"plan: {plan}")
    print()
    print(format_table(outcomes))
    print()
    for o in outcomes[2:]:
        print(
            f"{'+'.join(o.watchdogs)}: hang found {o.detection_seconds:.0f} s after it began, at read {o.hang_detected_rounds} after it (first read = baseline)"
        )
    print(f"\n4 simulated days in {elapsed:.1f} s of wall time")


if __name__ == "__main__":
    main()
