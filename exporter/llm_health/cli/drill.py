"""`llm-health drill retry|watchdog`: the drills of `sim.drills`, runnable by a user."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..sim.drills import RetryDrillResult, format_retry, run_retry, temporary_redis, watchdog_report
from .common import add_log_level, positive_seconds


def cmd(args: argparse.Namespace) -> int:
    if args.drill == "retry":

        async def both(url: str) -> tuple[RetryDrillResult, RetryDrillResult]:
            return await run_retry(url, False, args.time_scale), await run_retry(url, True, args.time_scale)

        if args.redis:
            uncapped, gated = asyncio.run(both(args.redis))
        else:
            with temporary_redis() as url:
                uncapped, gated = asyncio.run(both(url))
        text, ok = format_retry(uncapped, gated)
    else:
        text, ok = watchdog_report()
    print(text)
    return 0 if ok else 1


def add(sub: Any) -> None:
    dr = sub.add_parser(
        "drill", help="drills: retry (late retries against the gate, real Redis), watchdog (a simulated day of naive watchdogs against llm-health)"
    )
    dr.add_argument("drill", choices=["retry", "watchdog"])
    dr.add_argument("--redis", help="Redis URL for the retry drill (default: a temporary redis-server)")
    dr.add_argument("--time-scale", type=positive_seconds, default=1.0, help="retry drill: multiply the drill's times (0.1 runs 10x faster)")
    add_log_level(dr)
    dr.set_defaults(func=cmd)
