"""Scale: one exporter process watching N simulated vLLM backends with 10 s rounds.

The simulated fleet runs in separate processes (their CPU is not counted), at most
`--per-process` listeners each (2,500 by default: a listener and its accepted connection
are two descriptors, so no process nears its RLIMIT_NOFILE, which every process raises to
its hard limit): 70% idle, 25% busy (progressing), 5% hung, each on its own loopback port
with a ~36 KB V1 payload. The exporter runs here. Measured, after one warm-up round: its
CPU seconds (user + system, from getrusage) per backend round, and from that its share of
one core at 10 s rounds; its memory (RSS and peak); and a scrape of it both ways on the
same fleet in the same run: the new path (each round's rendered text copied together,
exporter.fast_exposition) and the old one (prometheus_client rendering every snapshot at scrape
time), with the size and the cost of gzip (which /metrics applies where Prometheus asks).

Two machine figures: the calibration of bench/_machine.py, and prometheus_client's parse
of the 45 KB vLLM fixture (as bench_admission reports it); plus prometheus_client's parse
of a busy backend's own payload, against which a round's cost is printed (no goal: the
goal is the floor below).

A fleet process on a 2-core machine serves a few hundred reads a second: past ~1,000
backends run it with a longer `--interval` (the share of a core at 10 s rounds is computed
from the cost of a backend round, which does not depend on the interval).

    python -m bench.bench_scale [--backends 1000] [--interval 10] [--rounds 6] [--per-process 2500] [--scrapes 3]
                                [--server-keepalive 5] [--profile N]

An idle backend gets a 1-token probe once per `probe_interval`, a cost per second rather
than per round: the run scales it with `--interval` (6 rounds, as the default 60 s gives
at 10 s rounds), so runs at longer intervals charge each round what a 10 s round pays.

A real vLLM closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, uvicorn's
default), so at 10 s rounds every round opens a new one; the simulated fleet does the same
unless `--server-keepalive` says otherwise (75, aiohttp's default, shows a reused one).

Goals: a backend round at most 1.5x the floor measured in the same run (a minimal asyncio
GET of a backend's payload on a new connection plus the targeted parse, in this process
after the rounds); 10,000 backends at 10 s rounds on new connections in under one core
(judged at 10,000 backends only, else NOT RUN, and only on a run at 10 s rounds: at another
interval the share at 10 s rounds is a round's cost times the rounds, printed as
`projected`, which judges no goal); a scrape's body rendered and gzipped under 1 s (in this
process, without HTTP: what /metrics does before it writes), and the render at least 10x
cheaper than the old path (side by side); and what 100,000 backends take in shards,
projected from the cost of a round measured here (bench/_shards.py).
`--profile N` prints the N functions of the exporter that cost most over the measured
rounds (cProfile; the CPU figures are then inflated by the profiler).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import gzip
import io
import json
import multiprocessing as mp
import os
import pstats
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from bench import _shards
from bench._goal import goal_line, not_run, printed
from bench._machine import machine_line, parse_calibration_ms, prometheus_parse_ms
from bench._raw_get import raw_get
from bench._unjudged import projected_line
from llm_health.config.exporter import Backend, Config, Timing
from llm_health.exporter import slots
from llm_health.exporter.app import Exporter, _clean, _dumps
from llm_health.sim import servers as sim
from llm_health.web import gzip_body

GOAL_BACKENDS = 10_000  # the share-of-a-core goal is judged at this size, on new connections, or NOT RUN
GOAL_CORE_PERCENT = 100.0  # of one core at 10 s rounds
GOAL_SCRAPE_MS = 1000.0
GOAL_SCRAPE_RATIO = 10.0  # the old path's scrape / the new path's
GOAL_FLOOR_RATIO = 1.5  # a backend round's CPU against the floor measured in the same run
FLOOR_READS = 300
TICK_S = 2.0


class CachedServer(sim.SimServer):
    """Renders its payload once per tick, so a fleet process keeps up with its reads."""

    _cache: str | None = None

    def payload(self) -> str:
        if self._cache is None:
            self._cache = super().payload()
        return self._cache

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        self._cache = None


def raise_nofile() -> tuple[int, int]:
    """The soft RLIMIT_NOFILE raised to the hard one; (soft before, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


def fleet_process(first: int, count: int, conn: Any, keepalive: float = 75.0) -> None:
    """Backends b{first}..b{first+count-1}; only the busy ones progress (an idle or hung
    engine's payload does not change, so it is rendered once). Each closes a connection
    idle for `keepalive` seconds."""
    raise_nofile()

    async def main() -> None:
        servers, busy = [], []
        for i in range(first, first + count):
            s = CachedServer(f"b{i}")
            s.keepalive_timeout = keepalive
            if i % 20 == 0:
                sim.hang(s)
            elif i % 4 == 1:
                sim.saturated(s, running=8, waiting=0)
                busy.append(s)
            await s.start()
            servers.append(s)
        conn.send([s.url for s in servers])
        while not conn.poll():
            await asyncio.sleep(TICK_S)
            for s in busy:
                s.advance(TICK_S)
        for s in servers:
            await s.stop()

    asyncio.run(main())


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def system_cpu() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def rss_mib() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def timed(fn: Any, times: int) -> tuple[float, bytes]:
    """Median ms of `times` calls, and the last result."""
    out, ms = b"", []
    for _ in range(times):
        s0 = time.perf_counter()
        out = fn()
        ms.append((time.perf_counter() - s0) * 1000)
    return statistics.median(ms), out


async def run(urls: list[str], interval: float, rounds: int, scrapes: int, profile: int) -> dict:
    # An idle backend gets a 1-token probe once per probe_interval, a cost per second, not
    # per round: scaled with the interval, so that it is probed every 6th round at any
    # interval, as the default probe_interval (60 s) does at 10 s rounds.
    probe_interval = Timing().probe_interval * interval / 10.0
    timing = Timing(interval=interval, hung_after_seconds=2 * interval, probe_interval=probe_interval, metrics_timeout=interval, probe_timeout=2.0)
    exporter = Exporter(Config(timing=timing, backends=tuple(Backend(f"b{i}", u, "vllm", timing) for i, u in enumerate(urls))))
    base_rss = rss_mib()[0]
    await exporter.start()
    gc.freeze()  # as web.freeze_after_startup does in `llm-health serve`
    await asyncio.sleep(interval * 1.5)  # warm-up round: connections, first readings
    profiler = cProfile.Profile() if profile else None
    c0, t0, sys0 = cpu(), time.monotonic(), system_cpu()
    rounds0 = sum(s.monitor.rounds for s in exporter.slots.values())
    probes0 = sum(s.monitor.probes_sent for s in exporter.slots.values())
    if profiler:
        profiler.enable()
    await asyncio.sleep(interval * rounds)
    if profiler:
        profiler.disable()
    c1, t1, sys1 = cpu(), time.monotonic(), system_cpu()
    rounds1 = sum(s.monitor.rounds for s in exporter.slots.values())
    probes1 = sum(s.monitor.probes_sent for s in exporter.slots.values())
    # a scrape of the exporter itself, both ways, as Prometheus would take it every round
    new_ms, new_body = timed(lambda: exporter.exposition.render(generate_latest), scrapes)
    old_ms, old_body = timed(lambda: generate_latest(exporter.registry), scrapes)
    gzip_ms, zipped = timed(lambda: gzip_body(new_body), scrapes)
    default_gzip_ms, default_zipped = timed(lambda: gzip.compress(new_body), 1)  # what prometheus_client's handlers do
    # /status, built whole: as it is encoded now, and as it was before (every value walked
    # by _clean, then the pure-Python encoder that `indent` selects)
    status_ms, status_body = timed(lambda: _dumps(exporter.status_body()), scrapes)
    old_status_ms, old_status_body = timed(lambda: json.dumps(_clean(exporter.status_body()), indent=1).encode(), scrapes)
    if json.loads(status_body) != json.loads(old_status_body):
        raise SystemExit("the two /status encodings differ")
    states: dict[str, int] = {}
    reasons: dict[str, str] = {}  # one reason of each state the fleet was not made to be in
    for s in exporter.slots.values():
        st = str(s.verdict.state) if s.verdict else "none"
        states[st] = states.get(st, 0) + 1
        if st not in ("idle", "busy", "hung"):
            reasons.setdefault(st, f"{s.backend.name}: {s.verdict.reason if s.verdict else 'no round'}")
    rss, peak = rss_mib()
    series = sum(1 for line in new_body.split(b"\n") if line and not line.startswith(b"#"))
    await exporter.stop()
    wall = t1 - t0
    backend_rounds = rounds1 - rounds0
    per_round_ms = (c1 - c0) / max(1, backend_rounds) * 1000
    top = ""
    if profiler:
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        stats.sort_stats("tottime").print_stats(profile)
        top = buf.getvalue() + breakdown(stats, backend_rounds)
    return {
        "backends": len(urls),
        "interval_s": interval,
        "wall_s": wall,
        "backend_rounds": backend_rounds,
        "probes": probes1 - probes0,
        "probe_interval_s": probe_interval,
        "expected_rounds": len(urls) * wall / interval,
        "cpu_s": c1 - c0,
        "system_ms_per_round": (sys1 - sys0) / max(1, backend_rounds) * 1000,
        "measured_share": (c1 - c0) / wall,
        "per_round_ms": per_round_ms,
        "share_at_10s": per_round_ms / 1000 * len(urls) / 10.0,
        "rss_mib": rss,
        "rss_growth_mib": rss - base_rss,
        "peak_rss_mib": peak,
        "new_ms": new_ms,
        "old_ms": old_ms,
        "new_bytes": len(new_body),
        "old_bytes": len(old_body),
        "gzip_ms": gzip_ms,
        "gzip_bytes": len(zipped),
        "default_gzip_ms": default_gzip_ms,
        "default_gzip_bytes": len(default_zipped),
        "status_ms": status_ms,
        "old_status_ms": old_status_ms,
        "status_bytes": len(status_body),
        "old_status_bytes": len(old_status_body),
        "series": series,
        "states": states,
        "reasons": reasons,
        "profile": top,
    }


def loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# Where a round's time goes, by the file a function lives in (first match wins).
PARTS = (
    ("the HTTP client (aiohttp, yarl, multidict)", ("/aiohttp/", "/yarl/", "/multidict/", "/propcache/")),
    ("the fast read (probe.fast_http, the connect and system calls in it)", ("llm_health/probe/fast_http",)),
    ("parsing (core.exposition, probe.pieces)", ("llm_health/core/exposition", "llm_health/probe/pieces")),
    ("reducing and deciding (core.engines, core.health, core.evidence)", ("llm_health/core/",)),
    ("rendering the series (exporter.fast_exposition)", ("llm_health/exporter/fast_exposition",)),
    ("the round's own code (probe.client, probe.monitor, exporter)", ("llm_health/",)),
    ("the event loop and the rest", ("",)),
)


def _part(path: str) -> str:
    return next(name for name, prefixes in PARTS if any(p in path for p in prefixes))


def breakdown(stats: pstats.Stats, backend_rounds: int) -> str:
    """Own time per backend round of each part of PARTS (the profiler's own time, which
    inflates every figure; the shares are what count), the event loop's wait left out. A
    function of no part (a builtin, the standard library, prometheus_client's
    floatToGoString) counts for the part of the function that called it."""
    rest = PARTS[-1][0]
    totals = dict.fromkeys((name for name, _ in PARTS), 0.0)
    for (path, _line, func), (_cc, _nc, tottime, _ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "method 'poll' of" in func or "method 'run' of 'uvloop" in func or "method 'select' of" in func:
            continue  # waiting, not working
        part = _part(path)
        if part != rest or not callers:
            totals[part] += tottime
            continue
        for (caller_path, _l, _f), timing in callers.items():
            totals[_part(caller_path)] += timing[2]  # the time spent here when called from there
    whole = sum(totals.values())
    lines = [f"a backend round's own time under the profiler ({1000 * whole / max(1, backend_rounds):.3f} ms), by part:"]
    lines += [f"  {100 * t / whole:5.1f}%  {name}" for name, t in totals.items()]
    return "\n".join(lines) + "\n"


async def floor_per_read_ms(urls: list[str], text: str, reads: int) -> float:
    """The floor of a round, in this process's CPU ms a read: a minimal asyncio GET of a
    backend's /metrics on a new connection (bench_client's, Content-Length bodies only, none
    of the exporter's checks) plus the targeted parse of a busy payload with vLLM's names."""
    from urllib.parse import urlsplit

    from llm_health.core import engines
    from llm_health.core.exposition import parse

    ports = [urlsplit(u).port or 80 for u in urls]
    start = cpu()
    for i in range(reads):
        await raw_get(ports[i % len(ports)])
        parse(text, engines.VLLM_V1.wanted)
    return (cpu() - start) / reads * 1000


def start_fleet(n: int, per_process: int, keepalive: float) -> tuple[list[str], list[tuple[mp.Process, Any]]]:
    procs, urls = [], []
    for first in range(0, n, per_process):
        parent, child = mp.Pipe()
        proc = mp.Process(target=fleet_process, args=(first, min(per_process, n - first), child, keepalive), daemon=True)
        proc.start()
        procs.append((proc, parent))
    for _, parent in procs:
        urls += parent.recv()
    return urls, procs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=6, help="rounds measured (6: one probe_interval, so each idle backend is probed about once in the window)")
    ap.add_argument("--per-process", type=int, default=2500, help="listeners per fleet process")
    ap.add_argument("--scrapes", type=int, default=3, help="scrapes timed per path (the median is reported)")
    ap.add_argument(
        "--server-keepalive",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds a simulated backend keeps an idle connection (5: vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default, so "
        "at 10 s rounds every round opens a new connection, as against a real vLLM; 75: aiohttp's default)",
    )
    ap.add_argument(
        "--first-rounds-per-second",
        type=float,
        default=slots.FIRST_ROUNDS_PER_SECOND,
        metavar="R",
        help="how fast the exporter starts its backends' first rounds (the exporter's own setting by default; 1e9: all at once, the rounds then stay aligned)",
    )
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the exporter's N costliest functions (cProfile)")
    args = ap.parse_args()
    slots.FIRST_ROUNDS_PER_SECOND = args.first_rounds_per_second
    machine = machine_line()  # the load average before the fleet starts
    soft, hard = raise_nofile()
    calibration = parse_calibration_ms()
    payload = CachedServer("p")
    sim.saturated(payload, running=8, waiting=0)
    payload_text = payload.payload()
    payload_before_ms = payload_ms = prometheus_parse_ms(payload_text)
    urls, procs = start_fleet(args.backends, args.per_process, args.server_keepalive)
    try:
        # the loop `llm-health serve` runs on (web.run_app): uvloop where it is installed
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            r = runner.run(run(urls, args.interval, args.rounds, args.scrapes, args.profile))
            floor_ms = runner.run(floor_per_read_ms(urls, payload_text, FLOOR_READS))
    finally:
        for _, parent in procs:
            parent.send("stop")
        for proc, _ in procs:
            proc.join(10)
    # again after the run, the machine being shared: the lower of the two judges the round
    payload_after_ms = prometheus_parse_ms(payload_text)
    payload_ms = min(payload_ms, payload_after_ms)
    n = r["backends"]
    print(f"machine: {machine}")
    print(f"exporter: event loop {'uvloop' if loop_factory() else 'asyncio'}, the garbage collector frozen after start, as in `llm-health serve`")
    print(f"calibration: prometheus_client parses the 45 KB vLLM payload in {calibration:.1f} ms (best of 7)")
    print(
        f"fleet: {n} backends in {len(procs)} processes (at most {args.per_process} listeners each); RLIMIT_NOFILE soft {soft} raised to {hard} in each process; "
        f"an idle connection closed by the backend after {args.server_keepalive:g} s"
        + (" (every round opens a new one)" if args.server_keepalive < args.interval else " (rounds reuse theirs)")
    )
    print(
        f"a busy backend's payload: {len(payload_text.encode()) / 1024:.0f} KiB, parsed by prometheus_client in "
        f"{payload_before_ms:.2f} ms before the run and {payload_after_ms:.2f} ms after it (best of 7 each; the lower judges)"
    )
    print(
        f"backends {n}, rounds every {r['interval_s']:g} s, measured over {r['wall_s']:.1f} s "
        f"({r['backend_rounds']} backend rounds of {r['expected_rounds']:.0f} due)"
    )
    print(
        f"exporter CPU: {r['cpu_s']:.2f} s = {100 * r['measured_share']:.1f}% of one core measured; "
        f"{r['per_round_ms']:.3f} ms per backend round -> {100 * r['share_at_10s']:.1f}% of one core at 10 s rounds"
    )
    print(f"  of which system (kernel) time {r['system_ms_per_round']:.3f} ms a round; first rounds at most {slots.FIRST_ROUNDS_PER_SECOND:g} a second")
    print(
        f"  probes: {r['probes']} 1-token probes sent to idle backends ({r['probes'] / max(1, r['backend_rounds']):.3f} a backend round; "
        f"probe_interval {r['probe_interval_s']:g} s, the default 60 s scaled to the interval: every 6th round of an idle backend, as at 10 s rounds)"
    )
    parse_ratio = payload_ms / r["per_round_ms"]
    print(
        f"a backend round costs 1/{parse_ratio:.1f} of prometheus_client's parse of its payload ({r['per_round_ms'] / calibration:.3f} of the calibration parse)"
    )
    print(f"memory: RSS {r['rss_mib']:.0f} MiB (+{r['rss_growth_mib']:.0f} MiB for the fleet state), peak {r['peak_rss_mib']:.0f} MiB")
    scrape_ratio = r["old_ms"] / r["new_ms"]
    print(
        f"one scrape of the exporter (median of {args.scrapes}): rendered at round end {r['new_ms']:.1f} ms, "
        f"{r['new_bytes'] / 1024:.0f} KiB; prometheus_client at scrape time {r['old_ms']:.0f} ms, {r['old_bytes'] / 1024:.0f} KiB; "
        f"ratio {scrape_ratio:.0f}x"
    )
    print(
        f"gzip of the scrape (median of {args.scrapes}): level 1 (what /metrics sends) {r['gzip_ms']:.1f} ms -> {r['gzip_bytes'] / 1024:.0f} KiB "
        f"({r['new_bytes'] / r['gzip_bytes']:.0f}x smaller); gzip.compress's default level 9 {r['default_gzip_ms']:.0f} ms -> "
        f"{r['default_gzip_bytes'] / 1024:.0f} KiB"
    )
    print(
        f"/status built whole (median of {args.scrapes}): {r['status_ms']:.0f} ms, {r['status_bytes'] / 1024:.0f} KiB compact; "
        f"as before (every value cleaned, indented) {r['old_status_ms']:.0f} ms, {r['old_status_bytes'] / 1024:.0f} KiB; ratio {r['old_status_ms'] / r['status_ms']:.1f}x"
    )
    print(f"series: {r['series']} ({r['series'] / n:.1f} per backend), {r['new_bytes'] / n:.0f} bytes per backend")
    print(f"states: {r['states']}")
    for reason in r["reasons"].values():
        print(f"  unexpected, e.g. {reason}")
    print(f"loadavg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if r["profile"]:
        print(r["profile"])
    floor_ratio = float(f"{r['per_round_ms'] / floor_ms:.2f}")
    print(
        f"floor ({FLOOR_READS} reads after the run, same process and loop): a minimal asyncio GET on a new connection plus the targeted parse, "
        f"{floor_ms:.3f} ms CPU a read; a backend round {r['per_round_ms']:.3f} ms = {floor_ratio:.2f}x the floor"
    )
    shard_table, shard_goal = _shards.report(n, r["per_round_ms"], GOAL_CORE_PERCENT / 100 * 10_000 / GOAL_BACKENDS)
    print("\n".join(shard_table))
    core_goal = f"{GOAL_BACKENDS} backends at 10 s rounds on new connections in under one core"
    if n != GOAL_BACKENDS or args.server_keepalive >= 10:
        print(not_run(core_goal, f"this run: {n} backends, connections kept {args.server_keepalive:g} s"))
    elif r["interval_s"] == 10.0:  # measured: the exporter's CPU over the rounds, against the wall clock
        share = float(f"{100 * r['measured_share']:.1f}")
        print(goal_line(core_goal, f"{share:.1f}% of one core", share < GOAL_CORE_PERCENT))
    else:  # a round's cost at another interval, times the rounds 10 s would take: not a measurement
        print(
            projected_line(
                f"{core_goal}, from the cost of a backend round at {r['interval_s']:g} s rounds (judges no goal)",
                f"{100 * r['share_at_10s']:.1f}% of one core",
            )
        )
    print(
        goal_line(
            f"{n} backends: a backend round at most {GOAL_FLOOR_RATIO:g}x the floor measured in the same run",
            f"{floor_ratio:.2f}x",
            floor_ratio <= GOAL_FLOOR_RATIO,
        )
    )
    print(shard_goal)
    scrape_ms = printed(r["new_ms"], 1) + printed(r["gzip_ms"], 1)
    print(
        goal_line(
            f"{n} backends: a scrape's body rendered and gzipped (level 1, as /metrics sends it) under {GOAL_SCRAPE_MS:g} ms, "
            f"in this process, without HTTP (median of {args.scrapes})",
            f"{r['new_ms']:.1f} ms + {r['gzip_ms']:.1f} ms = {scrape_ms:.1f} ms",
            scrape_ms < GOAL_SCRAPE_MS,
        )
    )
    print(
        goal_line(
            f"{n} backends: a scrape at least {GOAL_SCRAPE_RATIO:g}x cheaper than prometheus_client rendering every snapshot",
            f"{scrape_ratio:.0f}x",
            printed(scrape_ratio, 0) >= GOAL_SCRAPE_RATIO,
        )
    )


if __name__ == "__main__":
    main()
