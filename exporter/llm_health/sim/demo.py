"""`llm-health demo`: the whole product on loopback, for a while, then what it proved.

- the simulated fleet and the exporter on it (this module);
- a real redis-server (sim.launch) with a GPU pool whose jobs lease through the lease
  library, one crashing (sim.gpu_pool), read by the exporter's `redis:` section;
- `llm-health gate` in front of a simulated worker with the retry drill's traffic
  (sim.demo_routes);
- where installed, Prometheus with the shipped rules and Alertmanager routing the hung
  alerts to `llm-health restarter`, whose restart command restarts the simulated server
  (sim.alerting);
- the terminal view and the summary (sim.demo_view).

The fleet: an idle server, two saturated at 12 running (their limit),
a batch job at 8 tokens/s, a V1 long prefill, a hung engine, a data-parallel pair with
one rank hung, a server that restarts, one that sleeps, a proxy and a dead backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from ..config.exporter import Backend, Config, Timing
from ..exporter.app import Exporter
from ..store.records import Pool
from . import alerting, launch
from . import servers as sim
from .demo_view import Parts, frame, parse_series, proofs, summary
from .stalls import StallWatch

POOL, GPUS, ROUTE = "demo", ("g0", "g1", "g2", "g3"), "chat"


# `overloaded` (4 places, 2 s a request): 3 requests a second for OVERLOAD_S, then none
# until its queue is empty and DRAINED_S more: its queue's head ages past the engine route's
# 1.5 s deadline (about a third of the overload's length), then drains.
OVERLOAD_S, DRAINED_S, OVERLOAD_ARRIVALS = 9.0, 4.0, 3.0


def _one_rank_hung(server: sim.SimServer) -> None:
    """A data-parallel pair: rank 0 hung with work in flight, rank 1 busy."""
    sim.saturated(server, running=4, waiting=0)
    sim.hang(server, engine=0)


class DemoFleet:
    """The demo's simulated servers and the ticker that moves their engines."""

    def __init__(self) -> None:
        self.servers: dict[str, sim.SimServer] = {}
        self.proxy: sim.SimProxy | None = None
        self.dead = sim.dead_url()
        self._ticker: asyncio.Task[None] | None = None
        self._since_restart = 0.0
        self._prefill_for = 0.0
        self._overload_for = 0.0

    async def start(self) -> None:
        plan = {
            "idle": (1, sim.idle),
            "saturated-a": (1, lambda s: sim.saturated(s, tokens_per_second=10.5)),
            "saturated-b": (1, lambda s: sim.saturated(s, tokens_per_second=8.4)),
            "batch-8tps": (1, sim.batch_job),
            "long-prefill": (1, sim.long_prefill),
            "hung": (1, sim.hang),
            "dp-one-hung": (2, _one_rank_hung),
            "restarting": (1, sim.batch_job),
            "sleeping": (1, sim.sleep),
            "overloaded": (1, sim.overloaded),
        }
        for name, (engines, scenario) in plan.items():
            server = sim.SimServer(name, engines=engines)
            scenario(server)
            await server.start()
            self.servers[name] = server
        self.proxy = sim.SimProxy("proxy", [self.servers["saturated-a"], self.servers["idle"]])
        await self.proxy.start()
        self._ticker = asyncio.create_task(self._tick())

    async def _tick(self, step: float = 0.25) -> None:
        while True:
            await asyncio.sleep(step)
            for server in self.servers.values():
                server.advance(step)
            self._overload(step)
            self._since_restart += step
            if self._since_restart >= 20.0:
                self._since_restart = 0.0
                restarting = self.servers["restarting"]
                restarting.restart()
                sim.batch_job(restarting)
            # The long prompt takes 8 s of prefill, then decodes its first token, then restarts prefilling another.
            prefill = self.servers["long-prefill"].engines[0]
            self._prefill_for += step
            if prefill.mode == "prefill" and self._prefill_for >= 8.0:
                prefill.finish_prefill(1800)
                self._prefill_for = 0.0
            elif prefill.mode == "decode" and self._prefill_for >= 1.0:
                prefill.finish(1, prompt_tokens=0, generation_tokens=1)
                prefill.mode, prefill.kv_usage, self._prefill_for = "prefill", 0.05, 0.0

    def _overload(self, step: float) -> None:
        """`overloaded` in cycles: requests arrive faster than it serves them for
        OVERLOAD_S (its queue ages past the route's deadline), then none until its queue
        has drained and stayed empty for DRAINED_S."""
        engine = self.servers["overloaded"].engines[0]
        self._overload_for += step
        if engine.arrivals_per_second > 0 and self._overload_for >= OVERLOAD_S:
            engine.arrivals_per_second, self._overload_for = 0.0, 0.0
        elif engine.arrivals_per_second == 0 and engine.waiting > 0:
            self._overload_for = 0.0
        elif engine.arrivals_per_second == 0 and self._overload_for >= DRAINED_S:
            engine.arrivals_per_second, self._overload_for = OVERLOAD_ARRIVALS, 0.0

    def backends(self, timing: Timing) -> tuple[Backend, ...]:
        out = [Backend(name, s.url, "vllm", timing) for name, s in self.servers.items()]
        assert self.proxy is not None  # started
        out.append(Backend("proxy", self.proxy.url, "proxy", timing))
        out.append(Backend("dead", self.dead, "vllm", timing))
        return tuple(out)

    async def stop(self) -> None:
        if self._ticker:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        for s in self.servers.values():
            await s.stop()
        if self.proxy:
            await self.proxy.stop()


async def _metrics_text(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url + "/metrics") as resp:
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return ""


def _install_sigterm(task: asyncio.Task[Any] | None) -> None:
    """SIGTERM stops the demo as Ctrl-C does: cleanly, every process it started stopped."""
    if task is not None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


async def run_demo(
    duration: float = 60.0, listen: tuple[str, int] = ("127.0.0.1", 9118), interval: float = 1.0, view_every: float | None = None, until_proven: bool = False
) -> int:
    """The whole product on loopback for `duration` seconds (0: until interrupted), or
    (`until_proven`) until every proof of the summary holds, at most `duration`; 0 when
    every proof holds at the end, 1 otherwise."""
    _install_sigterm(asyncio.current_task())
    tty = sys.stdout.isatty()
    every = view_every if view_every is not None else (interval if tty else 5.0)
    stack = contextlib.AsyncExitStack()
    skipped: dict[str, str] = {}
    started_pids: dict[str, int] = {}
    try:
        stalls = StallWatch()  # from the start: a stall while the parts start can make a lease or request late
        stalls.start()
        stack.push_async_callback(stalls.stop)
        fleet = DemoFleet()
        stack.push_async_callback(fleet.stop)
        await fleet.start()
        hung_at_start = {n for n, s in fleet.servers.items() if any(e.mode == "hung" for e in s.engines)}

        redis_url = None
        try:
            redis = await asyncio.to_thread(launch.RedisServer)
            stack.callback(redis.stop)
            redis_url, started_pids["redis-server"] = redis.url, redis.pid
        except launch.NotInstalled as exc:
            skipped["pool"] = skipped["route"] = f"{exc}"

        pool: Any = None
        route: Any = None
        redis_cfg = None
        if redis_url:
            try:  # the `redis` package (pip install '.[demo]'; `make demo` installs it)
                from ..config.redis import parse_redis_config
                from .demo_routes import RetryTraffic
                from .gpu_pool import GpuPool
            except ImportError as exc:
                skipped["pool"] = skipped["route"] = f"{exc.name or exc} is not installed: pip install '.[demo]' (make demo installs it)"
                redis_url = None
        if redis_url:
            pool = GpuPool(redis_url, Pool(POOL, GPUS))
            stack.push_async_callback(pool.stop)
            await pool.start()
            overloaded = fleet.servers["overloaded"]
            route = RetryTraffic(redis_url, ROUTE, engine=(overloaded.url, overloaded.model, "overloaded"))
            stack.push_async_callback(route.stop)
            await route.start()
            redis_cfg = parse_redis_config({"url": redis_url, "pools": [{"name": POOL, "gpus": list(GPUS)}], "routes": [ROUTE]}, "<demo>")

        timing = Timing(interval=interval, hung_after_seconds=2 * interval, probe_interval=10 * interval, probe_timeout=1.0, metrics_timeout=5.0)
        exporter = Exporter(Config(timing=timing, backends=fleet.backends(timing), redis=redis_cfg, source="<demo>"))
        runner = web.AppRunner(exporter.app(), access_log=None)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, *listen).start()
        host, port = listen
        exporter_url = f"http://{host}:{port}"

        alerts = None
        why = alerting.missing()
        if why:
            skipped["alerts"] = why
        else:
            scrape = {"llm-health": [f"{host}:{port}"]}
            if route is not None:
                scrape["llm-health-gate"] = [route.gate_url.removeprefix("http://")]
            alerts = alerting.AlertLoop(dict(fleet.servers), scrape)
            stack.push_async_callback(alerts.stop)
            await alerts.start()
            started_pids.update(alerts.pids())

        parts = Parts(exporter, exporter_url, pool, route, alerts, skipped, time.time(), time.monotonic(), stalls)
        print(f"llm-health demo: exporter on {exporter_url}/ (its status page), /metrics and /status; {len(exporter.slots)} simulated backends", flush=True)
        if route is not None:
            print(f"llm-health gate on {route.gate_url} (route {ROUTE}), Redis at {redis_url}", flush=True)
        if alerts is not None and alerts.prom and alerts.am:
            print(f"Prometheus on {alerts.prom.url} (rules/fast), Alertmanager on {alerts.am.url} (rules/alertmanager.example.yml)", flush=True)
        for part, reason in skipped.items():
            print(f"skipped {part}: {reason}", flush=True)
        print("processes started: " + (", ".join(f"{n} pid {p}" for n, p in started_pids.items()) or "none"), flush=True)

        started = parts.t0_mono
        last_view = -every
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                while duration <= 0 or time.monotonic() - started < duration:
                    await asyncio.sleep(min(interval, 0.5))
                    elapsed = time.monotonic() - started
                    if elapsed - last_view >= every:
                        last_view = elapsed
                        text = frame(parts, parse_series(await _metrics_text(session, exporter_url)), elapsed)
                        print(("\x1b[H\x1b[J" if tty else "\n") + text, flush=True)
                    if until_proven and all(p.ok for p in proofs(parts, fleet.servers, hung_at_start)):
                        print(f"\nevery proof holds at t={time.monotonic() - started:.1f}s: stopping (--until-proven)", flush=True)
                        break
                if alerts is not None:
                    await alerts.refresh()
                text = frame(parts, parse_series(await _metrics_text(session, exporter_url)), time.monotonic() - started)
                print(("\x1b[H\x1b[J" if tty else "\n") + text, flush=True)  # the last view, then the summary
        except asyncio.CancelledError:
            print("\ninterrupted", flush=True)
        items = proofs(parts, fleet.servers, hung_at_start)
        print(summary(items), flush=True)
        return 0 if all(p.ok for p in items) else 1
    finally:
        await stack.aclose()
        if started_pids:
            print("stopped: " + ", ".join(f"{n} pid {p}" for n, p in started_pids.items()), flush=True)
