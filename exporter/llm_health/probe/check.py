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

from ..core import timing
from ..core.health import Settings, Verdict
from ..core.states import FINAL, State
from .client import BackendClient
from .monitor import BackendMonitor


def default_rounds(interval: float, hung_after: float) -> int:
    """A first reading, then two rounds without progress spanning at least `hung_after`."""
    return max(3, math.ceil(hung_after / interval) + 1)


def output_quiet(verdict: Verdict) -> bool:
    """Requests run and steps move, but no output counter moved since the check's first read:
    a long prefill, or a livelock, which only `no_output_after` tells apart. Such a verdict
    does not end a check that has rounds left for it."""
    return verdict.state in (State.BUSY, State.STALLED) and any(e.no_output_seconds for e in verdict.engines)


async def run_check(
    url: str,
    kind: str = "engine",
    interval: float = timing.INTERVAL_S,
    rounds: int | None = None,
    hung_after: float = 20.0,
    probe_timeout: float = timing.PROBE_TIMEOUT_S,
    no_output_after: float | None = None,
    metrics_timeout: float = timing.METRICS_TIMEOUT_S,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Rounds until a final state (or `rounds` ran out); the verdict as a JSON-ready dict."""
    async with aiohttp.ClientSession() as session:
        client = BackendClient(
            session,
            url,
            api_key=api_key,
            probe_timeout=probe_timeout,
            metrics_timeout=metrics_timeout,
            models_timeout=min(timing.MODELS_TIMEOUT_S, metrics_timeout),
        )
        return await check_with(client, kind=kind, interval=interval, rounds=rounds, hung_after=hung_after, no_output_after=no_output_after)


async def check_with(
    client: BackendClient,
    kind: str = "engine",
    interval: float = timing.INTERVAL_S,
    rounds: int | None = None,
    hung_after: float = 20.0,
    no_output_after: float | None = None,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """`run_check`'s rounds on a client already made. `sleep` and `clock` (each round's
    `now`) are the event loop's and the monotonic clock, or a replay's simulated time.

    Rounds end at a final state, or when `rounds` ran out (default: enough for
    `hung_after`). With `no_output_after` (a livelock's bound, `Settings`), a backend whose
    requests run with steps moving and no output since the first read (`output_quiet`) is
    watched on, up to enough rounds for that bound and the rounds past it that make a
    livelock hung, until its output moves (busy) or it is hung; an explicit `rounds` is the
    most in every case. Without it (None) a busy read ends the check, as a watchdog with a
    short timeout needs, and no livelock is read: a check cannot know what an engine
    produced before it started, so telling a long prefill from a livelock takes that long."""
    # In a check every idle round may probe: the check itself is the rate limit.
    watch = no_output_after is not None
    bound = no_output_after if no_output_after is not None else math.inf
    settings = Settings(hung_after_seconds=hung_after, probe_interval=0.0, no_output_after_seconds=bound)
    usual = rounds or default_rounds(interval, hung_after)
    longest = rounds or (max(usual, math.ceil(bound / interval) + settings.hung_rounds) if watch else usual)
    started = clock()
    monitor = BackendMonitor(client, kind=kind, settings=settings)
    verdict = await monitor.round(clock())
    done = 1
    while done < longest and (verdict.state not in FINAL or (watch and output_quiet(verdict))) and (done < usual or (watch and output_quiet(verdict))):
        await sleep(interval)
        verdict = await monitor.round(clock())
        done += 1
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
