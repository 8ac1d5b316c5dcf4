"""The exporter: one background round per backend, served from a snapshot.

The two-round rule needs memory, so collection is not done at scrape time: each backend
has its own task that reads, decides and stores a snapshot every `interval`, and renders
its series as exposition text when the round ends (exporter.fast_exposition); `/metrics` copies
those pieces together, with no I/O. One slow or broken backend delays only its own task.

Routes: `/metrics`, `/status` (JSON per backend), `/probe?target=URL&kind=engine`
(multi-target, blackbox-exporter style, state kept per target, bounded), `/-/healthy`,
`/-/live?backend=NAME` (a kubelet liveness probe: 503 only for a proven hang),
`/-/ready?backend=NAME` (a readinessProbe or a load balancer's health check: 503 while the
backend is hung, down, or back from a hang but not yet idle or busy; core.readiness),
`/-/reload` (POST; or SIGHUP) and `/`, the status page (exporter.page: states, pools and
routes, refreshed in place).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from .. import __version__
from ..config import exporter as config_mod
from ..config.exporter import Backend, Config, Timing
from ..config.web import WebConfig
from ..core import kinds
from ..core.states import State
from ..tasks import cancel_and_wait
from ..urls import BadTarget, parse_target
from ..web import add_reload, healthy, metrics_handler, run_with, secure
from . import page
from .collectors import BackendsCollector, BuildInfoCollector
from .fast_exposition import Exposition
from .lag import LoopLag
from .probe_targets import ProbeTargets
from .slots import Slot, engine_age_ttl_ms, engine_ages, engine_waiting, first_round_delays, make_slot, next_delay, next_planned, on_tick, run_round

log = logging.getLogger("llm_health.exporter")


class Exporter:
    def __init__(self, config: Config, config_file: str | os.PathLike[str] | None = None):
        self.config = config
        self.config_file = config_file
        self.slots: dict[str, Slot] = {}
        self.targets = ProbeTargets(config.timing.max_probe_targets, config.probe.max_engines)
        self.redis_view: Any = None  # exporter.redis_view.RedisView when configured
        self._redis_task: asyncio.Task[None] | None = None
        # `registry` holds every collector (prometheus_client renders it for a format
        # exporter.fast_exposition does not write, and bench_scale compares against it); `rest`
        # all but the backends', whose series `exposition` serves from the rounds' text.
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(BackendsCollector(lambda: self.slots.values()))
        self.rest = CollectorRegistry(auto_describe=True)
        build = BuildInfoCollector()
        self.registry.register(build)
        self.rest.register(build)
        self.lag = LoopLag()
        self.registry.register(self.lag)
        self.rest.register(self.lag)
        self.exposition = Exposition(lambda: self.slots.values(), self.rest)
        self._redis_collector: Any = None
        # /status, whole and by ?state= (at most one per state), bounded for a large fleet
        self._status_reuse: dict[str | None, Reuse] = {}

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self.lag.start()
        self._add_backends(self.config.watched())  # this replica's shard of them
        await self._start_redis()

    def _add_backends(self, backends: tuple[Backend, ...] | list[Backend]) -> None:
        delays = first_round_delays(len(backends), min((b.timing.interval for b in backends), default=1.0))
        for b, delay in zip(backends, delays):
            # Each backend has its own session and connection pool (see probe.client).
            slot = make_slot(b)
            self.slots[b.name] = slot
            slot.task = asyncio.create_task(self._loop(slot, delay), name=f"round-{b.name}")

    async def _start_redis(self) -> None:
        if self.config.redis is None:
            return
        # Imported here: the `redis` extra is needed only with a `redis:` section.
        from .redis_collector import RedisCollector
        from .redis_view import RedisView

        self.redis_view = RedisView(self.config.redis)
        self._redis_collector = RedisCollector(self.redis_view)
        self.registry.register(self._redis_collector)
        self.rest.register(self._redis_collector)
        await self.redis_view.start()
        self._redis_task = asyncio.create_task(self._redis_loop(), name="redis-view")

    async def _stop_redis(self) -> None:
        if self._redis_task is not None:
            await cancel_and_wait(self._redis_task)  # its Redis reads may swallow one cancellation
            self._redis_task = None
        if self.redis_view is not None:
            await self.redis_view.stop()
            self.registry.unregister(self._redis_collector)
            self.rest.unregister(self._redis_collector)
            self.redis_view = self._redis_collector = None

    async def stop(self) -> None:
        for slot in self.slots.values():
            await slot.close()
        await self.targets.close()
        await self._stop_redis()
        await self.lag.stop()

    async def _loop(self, slot: Slot, first_delay: float = 0.0) -> None:
        timing = slot.backend.timing
        loop = asyncio.get_running_loop()
        planned = loop.time() + first_delay
        while True:
            await asyncio.sleep(max(0.0, on_tick(planned, timing.interval) - loop.time()))
            started = loop.time()
            await run_round(slot)
            wait = next_delay(slot.verdict, timing.interval, timing.hung_after_seconds, 0.0)
            planned = next_planned(planned, started, wait, timing.interval, loop.time())

    async def _redis_loop(self) -> None:
        while True:
            started = time.monotonic()
            states = {name: s.state for name, s in self.slots.items()}
            interval = self.config.timing.interval
            try:
                now = time.time()
                await self.redis_view.refresh(
                    states,
                    engine_ages(self.slots.values(), now, interval),
                    ttl_ms=engine_age_ttl_ms(interval),
                    waiting=engine_waiting(self.slots.values(), now, interval),
                )
            except Exception:
                log.exception("redis view refresh failed")
            await asyncio.sleep(max(0.0, self.config.timing.interval - (time.monotonic() - started)))

    async def reload(self) -> str:
        """Re-read the configuration file. Backends whose settings did not change keep
        their memory (a reload never resets the two-round rule); the others start over."""
        if self.config_file is None:
            return "no configuration file to reload"
        new = config_mod.load(self.config_file)
        old = {b.name: b for b in self.config.watched()}
        wanted = {b.name: b for b in new.watched()}  # a changed shard: backends move in and out
        removed = [n for n in old if n not in wanted or old[n] != wanted[n]]
        for name in removed:
            await self.slots.pop(name).close()
        added = [n for n in wanted if n not in self.slots]
        redis_changed = new.redis != self.config.redis
        self.config = new
        self.targets.max_targets, self.targets.max_engines = new.timing.max_probe_targets, new.probe.max_engines
        self._add_backends([wanted[name] for name in added])
        if redis_changed:
            await self._stop_redis()
            await self._start_redis()
        kept = len(wanted) - len(added)
        self._status_reuse.clear()  # built afresh for the new fleet
        return f"{len(wanted)} backends ({kept} kept, {len(added)} started, {len(set(removed) - set(wanted))} removed)" + (
            "; redis view restarted" if redis_changed else ""
        )

    # --- HTTP -------------------------------------------------------------------------------
    def status_body(self, slots: list[Slot] | None = None) -> dict[str, Any]:
        """The /status document: every backend's entry (or those of `slots`), the shard,
        /probe's bounds and the Redis view's section."""
        probe = self.config.probe
        body: dict[str, Any] = {
            "backends": [s.status() for s in (self.slots.values() if slots is None else slots)],
            "shard": {"index": self.config.shard.index, "total": self.config.shard.total, "configured": len(self.config.backends)},
            "probe": {
                "enabled": probe.enabled,
                "allowed_targets": [p.pattern for p in probe.allowed_targets],
                "targets": len(self.targets),
                "engine_units": self.targets.engine_units,
                "evicted": self.targets.evicted,
                "max_targets": self.targets.max_targets,
                "max_engines": self.targets.max_engines,
            },
        }
        if self._redis_collector is not None:
            body["redis"] = self._redis_collector.status()
        return body

    async def handle_status(self, request: web.Request) -> web.Response:
        """JSON per backend. `?backend=NAME` (repeatable) and `?state=STATE` keep those
        backends only (404 for a name this exporter does not watch, 400 for a state that
        does not exist). The whole document, and the one of each state, is reused while
        it is younger than STATUS_REUSE_FACTOR times what building it cost, once that is
        at least STATUS_REUSE_MIN_S (a large fleet): however often callers ask, building
        each then takes the event loop at most about a tenth of its time. A `?backend=`
        answer is built fresh; its cost is bounded by the names a request line can hold."""
        names, state = request.query.getall("backend", []), request.query.get("state")
        if state is not None and state not in {s.value for s in State}:
            return web.Response(status=400, text=f"state must be one of {', '.join(s.value for s in State)}, got {state[:100]!r}\n")
        if names:
            unknown = [n for n in names if n not in self.slots]
            if unknown:
                return web.Response(status=404, text=f"no backend {unknown[0][:100]!r} in this exporter's configuration\n")
            return web.json_response(body=_dumps(self.status_body(self._in_state([self.slots[n] for n in dict.fromkeys(names)], state))))
        reuse = self._status_reuse.setdefault(state, Reuse())
        return web.json_response(body=reuse.get(lambda: _dumps(self.status_body(self._in_state(list(self.slots.values()), state)))))

    @staticmethod
    def _in_state(slots: list[Slot], state: str | None) -> list[Slot]:
        return slots if state is None else [s for s in slots if s.state == state]

    async def handle_probe(self, request: web.Request) -> web.Response:
        """Blackbox style: Prometheus' service discovery says what to read. Refused with
        400 (the reason in the body): a target that is not a plain http(s) URL, a bad
        kind; 403: one the allowlist does not match; 404 when /probe is disabled."""
        probe = self.config.probe
        if not probe.enabled:
            return web.Response(status=404, text="/probe is disabled in this exporter's configuration (probe.enabled: false)\n")
        kind = request.query.get("kind", kinds.ENGINE)
        try:
            target = parse_target(request.query.get("target", ""))
        except BadTarget as exc:
            return web.Response(status=400, text=f"{exc}\n")
        try:
            kind = kinds.normalize(kind)
        except ValueError as exc:
            return web.Response(status=400, text=f"{exc}\n")
        if not probe.allows(target):
            return web.Response(status=403, text=f"target {target!r} is not in this exporter's probe.allowed_targets\n")
        timing: Timing = self.config.timing
        budget = _scrape_budget(request.headers.get("X-Prometheus-Scrape-Timeout-Seconds"))
        if budget is not None:
            timing = replace(timing, metrics_timeout=min(timing.metrics_timeout, budget), probe_timeout=min(timing.probe_timeout, budget / 2))
        slot = self.targets.slot(target, kind, timing)
        await self.targets.round(slot)
        await self.targets.trim(keep=slot)
        registry = CollectorRegistry(auto_describe=True)
        registry.register(BackendsCollector(lambda: (slot,)))
        return await metrics_handler(registry)(request)

    async def handle_live(self, request: web.Request) -> web.Response:
        """For a kubelet's `livenessProbe`: `?backend=NAME` is 503 only when that backend's
        last round proved it `hung`, 200 in every other state (busy, stalled, down,
        restarting, ...), 404 for a backend this exporter does not watch. Answered from
        memory: the call sends nothing to the backend. Without `backend`, 200: the exporter
        itself is alive."""
        name = request.query.get("backend")
        if name is None:
            return web.Response(text="ok: exporter alive\n")
        slot = self.slots.get(name)
        if slot is None:
            return web.Response(status=404, text=f"no backend {name[:100]!r} in this exporter's configuration\n")
        v, state = slot.verdict, slot.state
        if state is State.HUNG:
            assert v is not None
            return web.Response(status=503, text=f"{name}: hung: {v.reason}\n")
        return web.Response(text=f"{name}: {state}\n")

    async def handle_ready(self, request: web.Request) -> web.Response:
        """For a kubelet's `readinessProbe` or a load balancer's health check:
        `?backend=NAME` is 503 while that backend should get no new traffic (hung; down;
        after a hang, until a round sees it idle or busy again), 200 otherwise, busy above
        all (core.readiness). Decided when each round ends and answered from memory: the
        call sends nothing to the backend. 404 for a backend this exporter does not
        watch; 400 without `backend` (readiness is a backend's, not the exporter's)."""
        name = request.query.get("backend")
        if name is None:
            return web.Response(status=400, text="give the backend: /-/ready?backend=NAME (a name in this exporter's configuration)\n")
        slot = self.slots.get(name)
        if slot is None:
            return web.Response(status=404, text=f"no backend {name[:100]!r} in this exporter's configuration\n")
        r = slot.readiness
        if not r.ready:
            return web.Response(status=503, text=f"{name}: not ready: {r.reason}\n")
        return web.Response(text=f"{name}: ready: {r.reason}\n")

    async def handle_index(self, request: web.Request) -> web.Response:
        """The status page (exporter.page): the worst MAX_BACKEND_ROWS backends' entries of
        /status (only theirs are built), every state's count, the Redis view's section."""
        states = [(s.state, s) for s in self.slots.values()]
        shown = page.worst_first(states, page.MAX_BACKEND_ROWS)
        data = page.PageData(
            backends=[s.status() for s in shown],
            counts=Counter(state for state, _s in states),
            now=time.time(),
            refresh_s=self.config.timing.interval,
            redis=self._redis_collector.status() if self._redis_collector is not None else None,
            shard={"index": self.config.shard.index, "total": self.config.shard.total, "configured": len(self.config.backends)},
            version=__version__,
        )
        return web.Response(text=page.render(data), content_type="text/html", charset="utf-8", headers=page.HEADERS)

    def app(self, web_config: WebConfig | None = None) -> web.Application:
        app = web.Application()
        secure(app, web_config or WebConfig())
        app.router.add_get("/", self.handle_index)
        app.router.add_get("/metrics", metrics_handler(self.registry, self.exposition.render, compress=True))
        app.router.add_get("/status", self.handle_status)
        app.router.add_get("/probe", self.handle_probe)
        app.router.add_get("/-/healthy", healthy)
        app.router.add_get("/-/live", self.handle_live)
        app.router.add_get("/-/ready", self.handle_ready)
        add_reload(app, self.reload)
        run_with(app, self.start, self.stop)
        return app


def _scrape_budget(header: str | None) -> float | None:
    """What a scraper's `X-Prometheus-Scrape-Timeout-Seconds` leaves for the reads: half a
    second less, at least half a second; None without a usable header."""
    try:
        seconds = float(header) if header else math.nan
    except ValueError:
        return None
    return max(0.5, seconds - 0.5) if math.isfinite(seconds) and seconds > 0 else None


def _clean(o: Any) -> Any:
    """JSON has no NaN or infinity: those become null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


def _dumps(obj: Any) -> bytes:
    """Compact JSON, by the C encoder (an `indent` takes the pure-Python one, several times
    slower). JSON has no NaN: a document with one is cleaned first (`_clean`)."""
    try:
        text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_clean(obj), separators=(",", ":"))
    return text.encode()


# /status at 10,000 backends takes a noticeable time to build (bench_scale, docs/benchmarks.md): callers asking for
# it back to back would hold the event loop and delay every round. Reused while younger
# than this many times its cost, once that cost is at least STATUS_REUSE_MIN_S.
STATUS_REUSE_FACTOR = 10.0
STATUS_REUSE_MIN_S = 0.02


class Reuse:
    """A built document, reused while younger than `factor` times what building it cost,
    when that cost was at least `min_cost_s`; otherwise built again. `clock`: monotonic s."""

    def __init__(self, factor: float = STATUS_REUSE_FACTOR, min_cost_s: float = STATUS_REUSE_MIN_S, clock: Any = time.perf_counter):
        self.factor, self.min_cost_s, self.clock = factor, min_cost_s, clock
        self._built: tuple[float, float, bytes] | None = None  # built at, cost, document
        self.builds = 0

    def get(self, build: Any) -> bytes:
        now = self.clock()
        if self._built is not None:
            at, cost, doc = self._built
            if cost >= self.min_cost_s and now - at < self.factor * cost:
                return doc
        doc = build()
        self._built = (now, self.clock() - now, doc)
        self.builds += 1
        return doc

    def clear(self) -> None:
        self._built = None
