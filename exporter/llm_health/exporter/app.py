"""The exporter: one background round per backend, served from a snapshot.

The two-round rule needs memory, so collection is not done at scrape time: each backend
has its own task that reads, decides and stores a snapshot every `interval`; `/metrics`
renders the snapshots with no I/O in `collect()`. One slow or broken backend delays only
its own task.

Routes: `/metrics`, `/status` (JSON per backend), `/probe?target=URL&kind=vllm`
(multi-target, blackbox-exporter style, state kept per target, bounded), `/-/healthy`,
`/-/reload` (POST; or SIGHUP) and a landing page.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from ..config import exporter as config_mod
from ..config.exporter import Backend, Config, Timing
from ..core.states import State
from ..web import add_reload, healthy, metrics_handler
from .collectors import BackendsCollector, BuildInfoCollector
from .slots import Slot, make_monitor, run_round

log = logging.getLogger("llm_health.exporter")


class Exporter:
    def __init__(self, config: Config, config_file: str | os.PathLike[str] | None = None):
        self.config = config
        self.config_file = config_file
        self.slots: dict[str, Slot] = {}
        self.targets: OrderedDict[tuple[str, str], Slot] = OrderedDict()
        self.session: aiohttp.ClientSession | None = None
        self.redis_view: Any = None  # exporter.redis_view.RedisView when configured
        self._redis_task: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(BackendsCollector(lambda: self.slots.values()))
        self.registry.register(BuildInfoCollector())
        self._redis_collector: Any = None

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        # One connection per backend at most, no shared limit that a slow backend could exhaust.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=4, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
        for b in self.config.backends:
            self._add_backend(b)
        await self._start_redis()

    def _add_backend(self, b: Backend) -> None:
        assert self.session is not None
        slot = Slot(b, make_monitor(self.session, b))
        self.slots[b.name] = slot
        slot.task = asyncio.create_task(self._loop(slot), name=f"round-{b.name}")

    async def _start_redis(self) -> None:
        if self.config.redis is None:
            return
        # Imported here: the `redis` extra is needed only with a `redis:` section.
        from .redis_collector import RedisCollector
        from .redis_view import RedisView

        self.redis_view = RedisView(self.config.redis)
        self._redis_collector = RedisCollector(self.redis_view)
        self.registry.register(self._redis_collector)
        await self.redis_view.start()
        self._redis_task = asyncio.create_task(self._redis_loop(), name="redis-view")

    async def _stop_redis(self) -> None:
        if self._redis_task is not None:
            self._redis_task.cancel()
            await asyncio.gather(self._redis_task, return_exceptions=True)
            self._redis_task = None
        if self.redis_view is not None:
            await self.redis_view.stop()
            self.registry.unregister(self._redis_collector)
            self.redis_view = self._redis_collector = None

    async def stop(self) -> None:
        tasks = [s.task for s in self.slots.values() if s.task]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._stop_redis()
        if self.session:
            await self.session.close()

    async def _loop(self, slot: Slot) -> None:
        interval = slot.backend.timing.interval
        while True:
            started = time.monotonic()
            await run_round(slot)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _redis_loop(self) -> None:
        while True:
            started = time.monotonic()
            states = {name: (s.verdict.state if s.verdict else State.UNKNOWN) for name, s in self.slots.items()}
            try:
                await self.redis_view.refresh(states)
            except Exception:
                log.exception("redis view refresh failed")
            await asyncio.sleep(max(0.0, self.config.timing.interval - (time.monotonic() - started)))

    async def reload(self) -> str:
        """Re-read the configuration file. Backends whose settings did not change keep
        their memory (a reload never resets the two-round rule); the others start over."""
        if self.config_file is None:
            return "no configuration file to reload"
        new = config_mod.load(self.config_file)
        old = {b.name: b for b in self.config.backends}
        wanted = {b.name: b for b in new.backends}
        removed = [n for n in old if n not in wanted or old[n] != wanted[n]]
        for name in removed:
            slot = self.slots.pop(name)
            if slot.task:
                slot.task.cancel()
                await asyncio.gather(slot.task, return_exceptions=True)
        added = [n for n in wanted if n not in self.slots]
        redis_changed = new.redis != self.config.redis
        self.config = new
        for name in added:
            self._add_backend(wanted[name])
        if redis_changed:
            await self._stop_redis()
            await self._start_redis()
        kept = len(wanted) - len(added)
        return f"{len(wanted)} backends ({kept} kept, {len(added)} started, {len(set(removed) - set(wanted))} removed)" + (
            "; redis view restarted" if redis_changed else ""
        )

    # --- HTTP -------------------------------------------------------------------------------
    async def handle_status(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {"backends": [s.status() for s in self.slots.values()]}
        if self._redis_collector is not None:
            body["redis"] = self._redis_collector.status()
        return web.json_response(body, dumps=_dumps)

    async def handle_probe(self, request: web.Request) -> web.Response:
        target = request.query.get("target", "")
        kind = request.query.get("kind", "vllm")
        if not target.startswith(("http://", "https://")):
            return web.Response(status=400, text=f"target must be an http(s) URL, got {target!r}\n")
        if kind not in ("vllm", "proxy"):
            return web.Response(status=400, text=f"kind must be vllm or proxy, got {kind!r}\n")
        timing: Timing = self.config.timing
        scrape_timeout = request.headers.get("X-Prometheus-Scrape-Timeout-Seconds")
        if scrape_timeout:
            try:
                budget = max(0.5, float(scrape_timeout) - 0.5)
            except ValueError:
                budget = math.inf
            if math.isfinite(budget):
                timing = replace(timing, metrics_timeout=min(timing.metrics_timeout, budget), probe_timeout=min(timing.probe_timeout, budget / 2))
        key = (target, kind)
        slot = self.targets.get(key)
        if slot is None:
            assert self.session is not None
            backend = Backend(name=target, url=target, kind=kind, timing=timing)
            slot = Slot(backend, make_monitor(self.session, backend))
            self.targets[key] = slot
            while len(self.targets) > timing.max_probe_targets:
                self.targets.popitem(last=False)
        self.targets.move_to_end(key)
        asked = time.monotonic()
        async with slot.lock:
            # Two scrapers at once (an HA pair): the second takes the round the first ran.
            if slot.round_started is None or slot.round_started < asked:
                slot.round_started = time.monotonic()
                await run_round(slot)
        registry = CollectorRegistry(auto_describe=True)
        registry.register(BackendsCollector(lambda: (slot,)))
        return await metrics_handler(registry)(request)

    async def handle_index(self, request: web.Request) -> web.Response:
        rows = "".join(
            f"<tr><td>{_esc(s.backend.name)}</td><td>{_esc(s.verdict.state if s.verdict else 'unknown')}</td>"
            f"<td>{_esc(s.verdict.reason if s.verdict else '')}</td></tr>"
            for s in self.slots.values()
        )
        html = (
            "<html><head><title>llm-health exporter</title></head><body><h1>llm-health exporter</h1>"
            '<p><a href="/metrics">Metrics</a> · <a href="/status">Status (JSON)</a> · '
            "<code>/probe?target=http://host:8000&amp;kind=vllm</code></p>"
            f"<table border=1><tr><th>backend</th><th>state</th><th>reason</th></tr>{rows}</table></body></html>"
        )
        return web.Response(text=html, content_type="text/html")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.handle_index)
        app.router.add_get("/metrics", metrics_handler(self.registry))
        app.router.add_get("/status", self.handle_status)
        app.router.add_get("/probe", self.handle_probe)
        app.router.add_get("/-/healthy", healthy)
        add_reload(app, self.reload)

        async def lifecycle(app: web.Application) -> AsyncIterator[None]:
            await self.start()
            yield
            await self.stop()

        app.cleanup_ctx.append(lifecycle)
        return app


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _clean(o: Any) -> Any:
    """JSON has no NaN or infinity: those become null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


def _dumps(obj: Any) -> str:
    return json.dumps(_clean(obj), indent=1)
