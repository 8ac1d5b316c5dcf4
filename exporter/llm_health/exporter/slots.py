"""One watched backend: its monitor, what its last round found, and its `/status` entry."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ..config.exporter import Backend
from ..core.health import Verdict
from ..core.queue_age import to_ms
from ..core.readiness import Readiness, next_readiness
from ..core.states import State
from ..probe.client import BackendClient
from ..probe.monitor import BackendMonitor
from ..urls import redact_url
from .fast_exposition import Renderer

log = logging.getLogger("llm_health.exporter")


@dataclass
class Slot:
    """One backend: its monitor and what its last round found."""

    backend: Backend
    monitor: BackendMonitor
    verdict: Verdict | None = None
    readiness: Readiness = field(default_factory=Readiness)  # /-/ready, updated when a round ends
    last_round_at: float | None = None  # wall clock
    errors: dict[str, int] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    # /probe targets: one round at a time, and when the current one started (monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    round_started: float | None = None
    # The slot's series as exposition text, one piece per fast_exposition.FAMILIES entry, rendered
    # when a round ends (and at creation): a scrape copies them.
    renderer: Renderer = field(default_factory=Renderer)
    rendered: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        self.render()

    def render(self) -> None:
        self.rendered = self.renderer.render(self)

    async def close(self) -> None:
        """Stop the slot's task, close its session and the connections it kept."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.monitor.client.close()
        await self.monitor.client.session.close()

    @property
    def state(self) -> State:
        """What its last round found; `unknown` before its first."""
        return self.verdict.state if self.verdict else State.UNKNOWN

    @property
    def engine_units(self) -> int:
        """Engine units the slot keeps state for (the /probe budget counts these)."""
        memory = self.monitor.memory
        return len(memory.engines) if memory else 0

    def status(self) -> dict[str, Any]:
        v, stats, m = self.verdict, self.monitor.stats, self.monitor
        ages = m.queue_ages
        out = {
            "backend": self.backend.name,
            "url": redact_url(m.client.url),
            "kind": self.backend.kind,
            "state": self.state,
            "reason": v.reason if v else "no round yet",
            "ready": self.readiness.ready,
            "readiness": self.readiness.reason,
            "profile": stats.profile,
            "running": v.running if v and v.engines else None,
            "waiting": v.waiting if v and v.engines else None,
            # the engine's queue age (core.queue_age), null while unknown
            "queue_age_ms": to_ms(ages.backend) if v else None,
            "steps_per_second": v.total("steps_per_second") if v else None,
            "generation_tokens_per_second": v.total("generation_tokens_per_second") if v else None,
            # the engine refused requests itself since the previous round (its own queue cap)
            "shedding": bool(v and v.shedding),
            "refused": dict(sorted(v.refused.items())) if v else {},
            # the profile's evidence endpoint read this round, for a suspected engine only
            "evidence": stats.evidence.detail if stats.evidence else None,
            "restarts": m.memory.restarts if m.memory else 0,
            "probes_sent": m.probes_sent,
            "rounds": m.rounds,
            "probe_sent": stats.probe is not None,
            "last_round_at": self.last_round_at,
            "round_seconds": stats.seconds,
            "metrics_seconds": stats.metrics.seconds if stats.metrics else None,
            "metrics_bytes": stats.metrics.size if stats.metrics else None,
            "engines": [
                {
                    "model_name": e.model_name,
                    "engine": e.engine,
                    "state": e.state,
                    "reason": e.reason,
                    "running": e.running,
                    "waiting": e.waiting,
                    "steps_per_second": e.steps_per_second,
                    "generation_tokens_per_second": e.generation_tokens_per_second,
                    "seconds_since_progress": e.seconds_since_progress,
                    "queue_age_ms": to_ms(ages.units.get((e.model_name, e.engine))),
                }
                for e in (v.engines if v else ())
            ],
        }
        return out


def _fresh(s: Slot, now: float, interval: float) -> bool:
    """Its last round ended within 3 intervals: a round stuck on a slow read leaves no
    figure behind that would outlive it."""
    return s.verdict is not None and s.last_round_at is not None and now - s.last_round_at <= 3 * max(interval, s.backend.timing.interval)


def engine_ages(slots: Iterable[Slot], now: float, interval: float) -> dict[str, int | None]:
    """What the exporter publishes to Redis (QueueKeys.engine_age) for its engine backends
    (a proxy has no engine queue): each one's queue age in ms, None (the key deleted) while
    unknown or stale (`_fresh`)."""
    return {s.backend.name: to_ms(s.monitor.queue_ages.backend) if _fresh(s, now, interval) else None for s in slots if s.backend.kind != "proxy"}


def engine_waiting(slots: Iterable[Slot], now: float, interval: float) -> dict[str, str | None]:
    """Published beside `engine_ages` (QueueKeys.engine_waiting): each engine backend's
    waiting and running counts, when its round's read ended and what it runs when full
    (`QueueAges.slots`; 0 while not yet known: no read has found it full since it
    started), `"W R READ_MS S"`; None (deleted) while unknown or stale, as the age."""
    out: dict[str, str | None] = {}
    for s in slots:
        if s.backend.kind == "proxy":
            continue
        ages = s.monitor.queue_ages
        known = _fresh(s, now, interval) and ages.waiting is not None and ages.running is not None and ages.read_at is not None
        out[s.backend.name] = f"{ages.waiting} {ages.running} {int((ages.read_at or 0) * 1000)} {ages.slots or 0}" if known else None
    return out


def engine_age_ttl_ms(interval: float) -> int:
    """The expiry of a published engine queue age: 3 rounds of the Redis view, at least 3 s,
    so a figure outlives a late round but not a stopped exporter by more than that."""
    return max(3000, int(3 * interval * 1000))


# A fleet's first rounds are spread over up to one interval, at most this many starting per
# second, as Prometheus spreads its targets' scrapes over the scrape interval. Started at
# once, 10,000 first reads queue behind each other, the event loop falls behind and every
# read times out (bench_scale); spread, the first pass is no denser than the rounds after
# it (a round's next one is due an interval after its own start) or than 100 a second.
# Ten backends start within 0.1 s.
FIRST_ROUNDS_PER_SECOND = 100.0


def first_round_delays(count: int, interval: float) -> list[float]:
    """Seconds from start to each of `count` backends' first round: evenly spread over
    min(interval, count / FIRST_ROUNDS_PER_SECOND)."""
    spread = min(interval, count / FIRST_ROUNDS_PER_SECOND)
    return [spread * i / count for i in range(count)]


# Rounds start on a grid of this many seconds of the event loop's clock (or the interval,
# where it is shorter): rounds due within one tick start together, in one wake-up of the
# process, instead of one wake-up each. On a VM a process that wakes a hundred times a
# second to do 1 ms of work each time pays for a cold CPU every time: bench_scale at 1,000
# backends, when this grid came in (d145fc6), measured each round on its own at more than
# twice the CPU per backend round of rounds on a 0.25 s grid, and a 1 s grid no cheaper
# (code since changed: may be stale; no section of docs/benchmarks.md compares grids). A
# round starts at most one tick late, and the intervals stay exact on average.
ROUND_TICK = 0.25


def on_tick(t: float, interval: float) -> float:
    """The first grid point at or after `t` (loop time): a multiple of min(ROUND_TICK, interval)."""
    tick = min(ROUND_TICK, interval)
    if tick <= 0:
        return t
    return math.ceil(t / tick - 1e-9) * tick


def next_planned(planned: float, started: float, wait: float, interval: float, now: float) -> float:
    """When the next round is planned (loop time), after a round planned for `planned` that
    started at `started` and asked for `wait` (next_delay with nothing elapsed): an interval
    after the planned time, so the plan does not drift by the loop's lateness; sooner, for
    a stalled engine, `wait` after the actual start, so the round that can prove the hang
    is not early; never in the past: an exporter that fell behind starts the next round at
    once, it does not replay the rounds it missed."""
    due = planned + wait if wait >= interval else started + wait
    return max(due, now)


def next_delay(verdict: Verdict | None, interval: float, hung_after: float, elapsed: float) -> float:
    """Seconds to wait before the backend's next round: `interval` from the start of the
    last one, or less where an engine that stalled becomes due for `hung` sooner: the round
    that can prove the hang runs when it can, not up to an interval later."""
    wait = interval
    for e in verdict.engines if verdict else ():
        if e.state is State.STALLED:
            wait = min(wait, max(0.0, hung_after - e.seconds_since_progress) + 0.01)
    return max(0.0, wait - elapsed)


def new_session(tls: bool) -> aiohttp.ClientSession:
    """A backend's own HTTP session for its rare calls (`/v1/models`, the probe, `/health`;
    `/metrics` and the sleep flags are read by probe.fast_http): its own small connection pool, so
    no backend (or /probe caller) can use up connections another one waits for. No cookie
    jar: nothing the exporter reads sets or needs a cookie, and a jar is work on every
    request and response. aiohttp's closed-transport sweep (a timer every 2 s, for the
    Python TLS transports that can stay open after close) runs for an https backend only:
    1,000 http backends would wake the loop 500 times a second for it (bench/bench_scale.py)."""
    connector = aiohttp.TCPConnector(limit=4, limit_per_host=4, enable_cleanup_closed=tls)
    return aiohttp.ClientSession(connector=connector, auto_decompress=True, cookie_jar=aiohttp.DummyCookieJar())


def make_slot(b: Backend) -> Slot:
    return Slot(b, make_monitor(new_session(b.url.lower().startswith("https:")), b))


def make_monitor(session: aiohttp.ClientSession, b: Backend) -> BackendMonitor:
    t = b.timing
    client = BackendClient(
        session,
        b.url,
        api_key=b.api_key,
        connect_timeout=t.connect_timeout,
        metrics_timeout=t.metrics_timeout,
        models_timeout=t.models_timeout,
        probe_timeout=t.probe_timeout,
        max_bytes=t.max_metrics_bytes,
        keepalive=True,
    )
    return BackendMonitor(client, kind=b.kind, settings=t.settings(), limits=t.limits())


async def run_round(slot: Slot) -> None:
    """One round for one backend; nothing it meets escapes to the caller."""
    try:
        slot.verdict = await slot.monitor.round()
        if slot.monitor.stats.error:
            slot.errors[slot.monitor.stats.error] = slot.errors.get(slot.monitor.stats.error, 0) + 1
    except Exception as exc:
        log.exception("round for backend %s failed: %s", slot.backend.name, type(exc).__name__)
        slot.errors["exception"] = slot.errors.get("exception", 0) + 1
    slot.last_round_at = time.time()
    v = slot.verdict
    slot.readiness = next_readiness(slot.readiness, slot.state, v.reason if v else "")
    try:
        slot.render()
    except Exception:  # the previous round's text is kept; the same error would fail a scrape
        log.exception("rendering the series of backend %s failed", slot.backend.name)
