"""Scale: one exporter process watching N simulated vLLM backends with 10 s rounds.

The simulated fleet runs in a separate process (its CPU is not counted): 70% idle, 25%
busy (progressing), 5% hung, each on its own loopback port with a ~36 KB V1 payload.
The exporter runs here; we measure its CPU seconds per round (user + system, from
getrusage) and its memory (RSS and peak), after one warm-up round.

    python -m bench.bench_scale [--backends 1000] [--interval 10] [--rounds 3]

Goal: under 25% of one core for 1,000 backends at 10 s rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from bench._goal import goal_line
from bench._machine import machine_line
from llm_health.config.exporter import Backend, Config, Timing
from llm_health.exporter.app import Exporter
from llm_health.sim import servers as sim

GOAL_CORE_PERCENT = 25.0  # of one core, for 1,000 backends at 10 s rounds


class CachedServer(sim.SimServer):
    """Renders its payload once per tick, so the fleet process keeps up with 100 reads/s."""

    _cache: str | None = None

    def payload(self) -> str:
        if self._cache is None:
            self._cache = super().payload()
        return self._cache

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        self._cache = None


def fleet_process(n: int, conn: Any) -> None:
    async def main() -> None:
        servers = []
        for i in range(n):
            s = CachedServer(f"b{i}")
            if i % 20 == 0:
                sim.hang(s)
            elif i % 4 == 1:
                sim.saturated(s, running=8, waiting=0)
            await s.start()
            servers.append(s)
        conn.send([s.url for s in servers])
        while not conn.poll():
            await asyncio.sleep(2.0)
            for s in servers:
                s.advance(2.0)
        for s in servers:
            await s.stop()

    asyncio.run(main())


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rss_mib() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


async def run(urls: list[str], interval: float, rounds: int) -> dict:
    timing = Timing(interval=interval, hung_after_seconds=2 * interval, probe_interval=60, metrics_timeout=interval, probe_timeout=2.0)
    exporter = Exporter(Config(timing=timing, backends=tuple(Backend(f"b{i}", u, "vllm", timing) for i, u in enumerate(urls))))
    base_rss = rss_mib()[0]
    await exporter.start()
    await asyncio.sleep(interval * 1.5)  # warm-up round: connections, first readings
    c0, t0 = cpu(), time.monotonic()
    rounds0 = sum(s.monitor.rounds for s in exporter.slots.values())
    await asyncio.sleep(interval * rounds)
    c1, t1 = cpu(), time.monotonic()
    rounds1 = sum(s.monitor.rounds for s in exporter.slots.values())
    # a scrape of the exporter itself, as Prometheus would take every round
    s0 = time.perf_counter()
    body = generate_latest(exporter.registry)
    scrape_ms = (time.perf_counter() - s0) * 1000
    states: dict[str, int] = {}
    for s in exporter.slots.values():
        st = str(s.verdict.state) if s.verdict else "none"
        states[st] = states.get(st, 0) + 1
    rss, peak = rss_mib()
    await exporter.stop()
    wall = t1 - t0
    backend_rounds = rounds1 - rounds0
    return {
        "backends": len(urls),
        "interval_s": interval,
        "wall_s": wall,
        "backend_rounds": backend_rounds,
        "cpu_s": c1 - c0,
        "cpu_per_round_s": (c1 - c0) / (wall / interval),
        "core_share": (c1 - c0) / wall,
        "cpu_per_backend_round_ms": (c1 - c0) / max(1, backend_rounds) * 1000,
        "rss_mib": rss,
        "rss_growth_mib": rss - base_rss,
        "peak_rss_mib": peak,
        "scrape_ms": scrape_ms,
        "scrape_bytes": len(body),
        "states": states,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    parent, child = mp.Pipe()
    proc = mp.Process(target=fleet_process, args=(args.backends, child), daemon=True)
    proc.start()
    urls = parent.recv()
    try:
        r = asyncio.run(run(urls, args.interval, args.rounds))
    finally:
        parent.send("stop")
        proc.join(10)
    print(f"machine: {machine_line()}")
    print(f"backends {r['backends']}, rounds every {r['interval_s']:g} s, measured over {r['wall_s']:.1f} s ({r['backend_rounds']} backend rounds)")
    print(
        f"exporter CPU: {r['cpu_s']:.2f} s -> {r['cpu_per_round_s']:.2f} s per round = {100 * r['core_share']:.1f}% of one core "
        f"({r['cpu_per_backend_round_ms']:.2f} ms per backend per round)"
    )
    print(f"memory: RSS {r['rss_mib']:.0f} MiB (+{r['rss_growth_mib']:.0f} MiB for the fleet state), peak {r['peak_rss_mib']:.0f} MiB")
    print(f"one scrape of the exporter: {r['scrape_ms']:.0f} ms, {r['scrape_bytes'] / 1024:.0f} KiB")
    print(f"states: {r['states']}")
    share = 100 * r["core_share"]
    print(
        goal_line(
            f"{r['backends']} backends at {r['interval_s']:g} s rounds in under {GOAL_CORE_PERCENT:g}% of one core",
            f"{share:.1f}% of one core",
            share < GOAL_CORE_PERCENT,
        )
    )


if __name__ == "__main__":
    main()
