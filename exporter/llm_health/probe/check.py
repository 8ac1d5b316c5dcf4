"""`llm-health check`'s loop: read, wait, read again, as many rounds as the verdict needs.

Used by the command (`cli.check`) and by the restarter's full re-verification, so a
watchdog and the restart authority judge a backend the same way.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from ..core.health import Settings
from ..core.states import FINAL
from .client import BackendClient
from .monitor import BackendMonitor


def default_rounds(interval: float, hung_after: float) -> int:
    """A first reading, then two rounds without progress spanning at least `hung_after`."""
    return max(3, math.ceil(hung_after / interval) + 1)


async def run_check(
    url: str,
    kind: str = "engine",
    interval: float = 10.0,
    rounds: int | None = None,
    hung_after: float = 20.0,
    probe_timeout: float = 5.0,
    metrics_timeout: float = 30.0,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Rounds until a final state (or `rounds` ran out); the verdict as a JSON-ready dict."""
    async with aiohttp.ClientSession() as session:
        client = BackendClient(
            session, url, api_key=api_key, probe_timeout=probe_timeout, metrics_timeout=metrics_timeout, models_timeout=min(10.0, metrics_timeout)
        )
        return await check_with(client, kind=kind, interval=interval, rounds=rounds, hung_after=hung_after)


async def check_with(
    client: BackendClient,
    kind: str = "engine",
    interval: float = 10.0,
    rounds: int | None = None,
    hung_after: float = 20.0,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """`run_check`'s rounds on a client already made. `sleep` and `clock` (each round's
    `now`) are the event loop's and the monotonic clock, or a replay's simulated time."""
    if rounds is None:
        rounds = default_rounds(interval, hung_after)
    # In a check every idle round may probe: the check itself is the rate limit.
    settings = Settings(hung_after_seconds=hung_after, probe_interval=0.0)
    started = clock()
    monitor = BackendMonitor(client, kind=kind, settings=settings)
    verdict = None
    for i in range(rounds):
        if i:
            await sleep(interval)
        verdict = await monitor.round(clock())
        if verdict.state in FINAL:
            break
    assert verdict is not None  # rounds >= 1
    state = verdict.state
    return {
        "url": client.url,
        "kind": kind,
        "state": state,
        "reason": verdict.reason,
        "exit_code": state.exit_code,
        "running": verdict.running if verdict.engines else None,
        "waiting": verdict.waiting if verdict.engines else None,
        "steps_per_second": verdict.total("steps_per_second"),
        "generation_tokens_per_second": verdict.total("generation_tokens_per_second"),
        "probe_sent": monitor.probes_sent > 0,
        "probes_sent": monitor.probes_sent,
        "rounds": monitor.rounds,
        "seconds": round(clock() - started, 3),
        "profile": monitor.stats.profile,
        "engines": [
            {"model_name": e.model_name, "engine": e.engine, "state": e.state, "running": e.running, "waiting": e.waiting, "reason": e.reason}
            for e in verdict.engines
        ],
    }
