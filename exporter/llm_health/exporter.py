"""The exporter: one background round per backend, served from a snapshot.

The two-round rule needs memory, so collection is not done at scrape time: each backend
has its own task that reads, decides and stores a snapshot every `interval`; `/metrics`
renders the snapshots with no I/O in `collect()`. One slow or broken backend delays only
its own task.

Routes: `/metrics`, `/status` (JSON per backend), `/probe?target=URL&kind=vllm`
(multi-target, blackbox-exporter style, state kept per target, bounded), `/-/healthy`,
and a landing page.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import __version__
from .client import BackendClient
from .config import Backend, Config, Timing
from .health import STATES, Verdict
from .monitor import BackendMonitor

log = logging.getLogger("llm_health.exporter")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATEFUL = " Derived by a background round every interval (stateful: two rounds tell stalled from hung), not at scrape time."


@dataclass
class Slot:
    """One backend: its monitor and what its last round found."""

    backend: Backend
    monitor: BackendMonitor
    verdict: Verdict | None = None
    last_round_at: float | None = None  # wall clock
    errors: dict[str, int] = field(default_factory=dict)
    task: asyncio.Task | None = None
    last_used: float = 0.0  # for /probe targets

    def status(self) -> dict:
        v, stats, m = self.verdict, self.monitor.stats, self.monitor
        out = {
            "backend": self.backend.name,
            "url": m.client.url,
            "kind": self.backend.kind,
            "state": v.state if v else "unknown",
            "reason": v.reason if v else "no round yet",
            "profile": stats.profile,
            "running": v.running if v and v.engines else None,
            "waiting": v.waiting if v and v.engines else None,
            "steps_per_second": v.total("steps_per_second") if v else None,
            "generation_tokens_per_second": v.total("generation_tokens_per_second") if v else None,
            "restarts": m.memory.restarts if m.memory else 0,
            "probes_sent": m.probes_sent,
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
                }
                for e in (v.engines if v else ())
            ],
        }
        return out


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
    )
    return BackendMonitor(client, kind=b.kind, settings=t.settings())


async def run_round(slot: Slot) -> None:
    """One round for one backend; nothing it meets escapes to the caller."""
    try:
        slot.verdict = await slot.monitor.round()
        if slot.monitor.stats.error:
            slot.errors[slot.monitor.stats.error] = slot.errors.get(slot.monitor.stats.error, 0) + 1
    except Exception as exc:  # noqa: BLE001 - a bug must not silence the other backends
        log.exception("round for backend %s failed: %s", slot.backend.name, type(exc).__name__)
        slot.errors["exception"] = slot.errors.get("exception", 0) + 1
    slot.last_round_at = time.time()


def families(slots: list[Slot]):
    """Metric families for these slots, from their snapshots (no I/O)."""
    up = GaugeMetricFamily("llm_backend_up", "1 if the backend's /metrics or /v1/models answered in its last round.", labels=["backend"])
    state = GaugeMetricFamily("llm_backend_state", "Health state of the backend (its worst engine), one-hot." + STATEFUL, labels=["backend", "state"])
    estate = GaugeMetricFamily(
        "llm_backend_engine_state", "Health state per engine (data-parallel rank and model), one-hot." + STATEFUL, labels=["backend", "model_name", "engine", "state"]
    )
    elabels = ["backend", "model_name", "engine"]
    running = GaugeMetricFamily("llm_backend_requests_running", "Requests running in the engine, as the engine reports.", labels=elabels)
    waiting = GaugeMetricFamily("llm_backend_requests_waiting", "Requests waiting in the engine, as the engine reports.", labels=elabels)
    steps = GaugeMetricFamily("llm_backend_engine_steps_per_second", "Engine steps per second between the last two rounds." + STATEFUL, labels=elabels)
    tokens = GaugeMetricFamily(
        "llm_backend_generation_tokens_per_second", "Generated tokens per second between the last two rounds." + STATEFUL, labels=elabels
    )
    since = GaugeMetricFamily(
        "llm_backend_seconds_since_progress", "Seconds since the engine fingerprint last changed while work was in flight.", labels=elabels
    )
    restarts = CounterMetricFamily("llm_backend_restarts", "Restarts seen: a new process start time or counters that went backwards.", labels=["backend"])
    probes = CounterMetricFamily("llm_backend_probes", "1-token probes sent to idle engines, by result.", labels=["backend", "result"])
    probe_s = GaugeMetricFamily("llm_backend_probe_duration_seconds", "Duration of the last probe sent, kept until the next one.", labels=["backend"])
    fetch_s = GaugeMetricFamily("llm_backend_metrics_fetch_duration_seconds", "Duration of the last /metrics read.", labels=["backend"])
    info = GaugeMetricFamily("llm_backend_info", "Backend kind and the engine profile detected from its payload.", labels=["backend", "kind", "profile"])
    round_s = GaugeMetricFamily("llm_exporter_round_duration_seconds", "Duration of the backend's last round.", labels=["backend"])
    errors = CounterMetricFamily("llm_exporter_round_errors", "Rounds that could not read the backend, by what failed.", labels=["backend", "reason"])
    for slot in slots:
        name, v, m = slot.backend.name, slot.verdict, slot.monitor
        stats = m.stats
        current = v.state if v else "unknown"
        up.add_metric([name], 0.0 if current == "down" or v is None else 1.0)
        for s in STATES:
            state.add_metric([name, s], 1.0 if s == current else 0.0)
        for e in v.engines if v else ():
            lab = [name, e.model_name, e.engine]
            for s in STATES:
                estate.add_metric(lab + [s], 1.0 if s == e.state else 0.0)
            running.add_metric(lab, e.running)
            waiting.add_metric(lab, e.waiting)
            if e.steps_per_second is not None:
                steps.add_metric(lab, e.steps_per_second)
            if e.generation_tokens_per_second is not None:
                tokens.add_metric(lab, e.generation_tokens_per_second)
            since.add_metric(lab, e.seconds_since_progress)
        restarts.add_metric([name], m.memory.restarts if m.memory else 0)
        for result in ("ok", "timeout", "error"):
            probes.add_metric([name, result], stats.probes.get(result, 0))
        if m.last_probe is not None:
            probe_s.add_metric([name], m.last_probe.seconds)
        if stats.metrics is not None:
            fetch_s.add_metric([name], stats.metrics.seconds)
        info.add_metric([name, slot.backend.kind, stats.profile or ""], 1.0)
        round_s.add_metric([name], stats.seconds)
        for reason, count in sorted(slot.errors.items()):
            errors.add_metric([name, reason], count)
    return [up, state, estate, running, waiting, steps, tokens, since, restarts, probes, probe_s, fetch_s, info, round_s, errors]


class _Collector:
    def __init__(self, exporter: "Exporter"):
        self.exporter = exporter

    def collect(self):
        yield from families(list(self.exporter.slots.values()))
        build = GaugeMetricFamily("llm_exporter_build_info", "llm-health version.", labels=["version"])
        build.add_metric([__version__], 1.0)
        yield build
        if self.exporter.redis_view is not None:
            yield from self.exporter.redis_view.collect()


class Exporter:
    def __init__(self, config: Config):
        self.config = config
        self.slots: dict[str, Slot] = {}
        self.targets: OrderedDict[tuple[str, str], Slot] = OrderedDict()
        self.session: aiohttp.ClientSession | None = None
        self.redis_view = None
        self._redis_task: asyncio.Task | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    async def start(self) -> None:
        # One connection per backend at most, no shared limit that a slow backend could exhaust.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=4, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
        for b in self.config.backends:
            slot = Slot(b, make_monitor(self.session, b))
            self.slots[b.name] = slot
            slot.task = asyncio.create_task(self._loop(slot), name=f"round-{b.name}")
        if self.config.redis is not None:
            from .redis_view import RedisView, parse_redis_config

            self.redis_view = RedisView(parse_redis_config(self.config.redis, self.config.source))
            await self.redis_view.start()
            self._redis_task = asyncio.create_task(self._redis_loop(), name="redis-view")

    async def stop(self) -> None:
        tasks = [s.task for s in self.slots.values() if s.task] + ([self._redis_task] if self._redis_task else [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.redis_view is not None:
            await self.redis_view.stop()
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
            states = {name: (s.verdict.state if s.verdict else "unknown") for name, s in self.slots.items()}
            try:
                await self.redis_view.refresh(states)
            except Exception:  # noqa: BLE001 - the view reports llm_redis_up 0 itself
                log.exception("redis view refresh failed")
            await asyncio.sleep(max(0.0, self.config.timing.interval - (time.monotonic() - started)))

    # --- HTTP ----------------------------------------------------------------------------
    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE})

    async def handle_status(self, request: web.Request) -> web.Response:
        body = {"backends": [s.status() for s in self.slots.values()]}
        if self.redis_view is not None:
            body["redis"] = self.redis_view.status()
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
                timing = Timing(**{**timing.__dict__, "metrics_timeout": min(timing.metrics_timeout, budget), "probe_timeout": min(timing.probe_timeout, budget / 2)})
            except ValueError:
                pass
        key = (target, kind)
        slot = self.targets.get(key)
        if slot is None:
            backend = Backend(name=target, url=target, kind=kind, timing=timing)
            slot = Slot(backend, make_monitor(self.session, backend))
            self.targets[key] = slot
            while len(self.targets) > timing.max_probe_targets:
                self.targets.popitem(last=False)
        self.targets.move_to_end(key)
        await run_round(slot)
        registry = CollectorRegistry(auto_describe=False)

        class _One:
            def collect(self_inner):
                yield from families([slot])

        registry.register(_One())
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

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

    async def handle_healthy(self, request: web.Request) -> web.Response:
        return web.Response(text="OK\n")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.handle_index)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/status", self.handle_status)
        app.router.add_get("/probe", self.handle_probe)
        app.router.add_get("/-/healthy", self.handle_healthy)

        async def lifecycle(app):
            await self.start()
            yield
            await self.stop()

        app.cleanup_ctx.append(lifecycle)
        return app


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _dumps(obj) -> str:
    import json
    import math

    def clean(o):
        if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, list | tuple):
            return [clean(v) for v in o]
        return o

    return json.dumps(clean(obj), indent=1)
