"""`llm-health demo`: a simulated fleet on loopback, the exporter on it, a live table.

The fleet: an idle server, two saturated at 12 running (their limit),
a batch job at 8 tokens/s, a V1 long prefill, a hung engine, a data-parallel pair with
one rank hung, a server that restarts, one that sleeps, a proxy and a dead backend.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from ..config.exporter import Backend, Config, Timing
from ..exporter.app import Exporter
from . import servers as sim


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


def table(exporter: Exporter) -> str:
    lines = [f"{'backend':<14} {'state':<13} {'run':>4} {'wait':>4} {'steps/s':>8} {'tok/s':>7}  reason"]
    for slot in exporter.slots.values():
        st = slot.status()

        def num(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"

        lines.append(
            f"{st['backend']:<14} {st['state']:<13} {num(st['running'], '4.0f'):>4} {num(st['waiting'], '4.0f'):>4} "
            f"{num(st['steps_per_second'], '8.1f'):>8} {num(st['generation_tokens_per_second'], '7.1f'):>7}  {st['reason'][:90]}"
        )
    return "\n".join(lines)


async def run_demo(duration: float = 60.0, listen: tuple[str, int] = ("127.0.0.1", 9118), interval: float = 2.0) -> int:
    fleet = DemoFleet()
    await fleet.start()
    timing = Timing(interval=interval, hung_after_seconds=2 * interval, probe_interval=10 * interval, probe_timeout=1.0, metrics_timeout=5.0)
    exporter = Exporter(Config(timing=timing, backends=fleet.backends(timing), source="<demo>"))
    runner = web.AppRunner(exporter.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, *listen)
    await site.start()
    host, port = listen
    print(f"llm-health demo: exporter on http://{host}:{port}/metrics and /status; {len(exporter.slots)} simulated backends", flush=True)
    started = time.monotonic()
    try:
        while duration <= 0 or time.monotonic() - started < duration:
            await asyncio.sleep(interval)
            print(f"\n--- t={time.monotonic() - started:5.1f}s", flush=True)
            print(table(exporter), flush=True)
        busy_probed = sum(len(s.completions_while_busy()) for s in fleet.servers.values())
        print(f"\ncompletions sent to servers with work in flight: {busy_probed}", flush=True)
    finally:
        await runner.cleanup()
        await fleet.stop()
    return 0
