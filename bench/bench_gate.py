"""The gate's added latency and throughput, against a direct connection to the same fake
upstream, in the same run.

Processes: a fake OpenAI-compatible upstream (answers at once), the gate (real Redis,
started here), and this load generator. Open loop at a fixed rate (default 500 req/s):
latency p50/p99 direct and through the gate, and the difference. Then closed loop with
64 concurrent clients for the throughput of each path.

A third path, `hop`, is a decomposition and nothing a user runs: a second gate process
whose two Redis round trips are replaced by constants (the request is admitted as a first
attempt on an empty queue), so the figures show what the HTTP hop costs on its own and
what the Redis calls add to it.

    python -m bench.bench_gate [--rate 500] [--seconds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from tests.harness.processes import free_port

from bench._goal import added_latency, goal_line, not_run
from bench._machine import machine_line
from bench._stats import percentile

ROOT = Path(__file__).resolve().parents[1]
GOAL_ADDED_P99_MS = 1.0
GOAL_RATE = 500.0  # the goal is judged at this rate only; another rate prints NOT RUN


BODY = {"model": "m", "prompt": "x", "max_tokens": 1}
REPLY = {"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def upstream_proc(port: int) -> None:
    async def handle(request):
        await request.read()
        return web.json_response(REPLY)

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def gate_proc(port: int, upstream: str, redis_url: str, without_redis: bool = False) -> None:
    from llm_health.config.gate import parse_gate_config
    from llm_health.gate.app import Gate, tune_gc
    from llm_health.store.queue import QueueRecord, RouteStats
    from llm_health.web import run_app

    cfg = parse_gate_config({"gate": {"redis": redis_url, "routes": {"bench": {"upstream": upstream, "default_deadline_ms": 30000}}}}, "<bench>")
    gate = Gate(cfg)
    if without_redis:  # the `hop` decomposition: the same handler, no Redis round trips

        async def enqueue_and_read(request_id, route, tenant, deadline_ms, now):
            record = QueueRecord(request_id, route, tenant, enqueued_ms=now, deadline_ms=deadline_ms, state="running")
            return record, RouteStats(0, None, None, 0, 0, None), None

        async def finish(*_args):
            return None

        gate.admission._enqueue_and_read, gate.admission._finish_once = enqueue_and_read, finish  # type: ignore[method-assign]
    tune_gc()
    run_app(gate.app(), "127.0.0.1", port, handler_cancellation=True)  # as `llm-health gate` runs it


async def wait_port(port: int) -> None:
    for _ in range(200):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


async def open_loop(session, url: str, rate: float, seconds: float) -> tuple[list[float], int]:
    lat: list[float] = []
    errors = 0

    async def one(i):
        nonlocal errors
        t = time.perf_counter()
        async with session.post(url, json=BODY, headers={"X-Request-Id": f"b{time.time_ns()}-{i}"}) as r:
            await r.read()
            if r.status != 200:
                errors += 1
        lat.append(time.perf_counter() - t)

    tasks = []
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return lat, errors


async def closed_loop(session, url: str, concurrency: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(w):
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            async with session.post(url, json=BODY, headers={"X-Request-Id": f"c{w}-{i}-{time.time_ns()}"}) as r:
                await r.read()
            done += 1
            i += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / seconds


def pct(values, p):
    """The percentile of latencies in seconds, in ms."""
    return percentile(values, p) * 1000


PATHS = ("direct", "gate", "hop")


async def measure(urls: dict[str, str], rate: float, seconds: float) -> dict:
    conn = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=conn) as s:
        for url in urls.values():  # warm up connections and scripts
            await open_loop(s, url, 100, 1)
        out = {key: {"lat": [], "errors": 0} for key in PATHS}
        # interleave the paths in halves so machine noise hits them alike
        for _half in range(2):
            for key in PATHS:
                lat, err = await open_loop(s, urls[key], rate, seconds / 2)
                out[key]["lat"] += lat
                out[key]["errors"] += err
        for key in PATHS:
            out[key]["throughput"] = await closed_loop(s, urls[key], 64, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=6)
    args = ap.parse_args()
    from llm_health.sim.drills import temporary_redis

    up_port, gate_port, hop_port = free_port(), free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    with temporary_redis() as redis_url:
        procs = [
            mp.Process(target=upstream_proc, args=(up_port,), daemon=True),
            mp.Process(target=gate_proc, args=(gate_port, upstream, redis_url), daemon=True),
            mp.Process(target=gate_proc, args=(hop_port, upstream, redis_url, True), daemon=True),
        ]
        for p in procs:
            p.start()
        try:
            for port in (up_port, gate_port, hop_port):
                asyncio.run(wait_port(port))
            urls = {key: f"http://127.0.0.1:{port}/v1/completions" for key, port in zip(PATHS, (up_port, gate_port, hop_port))}
            r = asyncio.run(measure(urls, args.rate, args.seconds))
        finally:
            for p in procs:
                p.terminate()
                p.join(5)
    print(f"machine: {machine_line()}")
    print(f"open loop at {args.rate:g} req/s for {args.seconds:g} s per path (interleaved halves); closed loop: 64 clients, 3 s")
    print("hop = the gate with its Redis round trips replaced by constants (a decomposition, not a mode)")
    print(f"{'path':<8} {'requests':>8} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'max req/s':>10}")
    for key in PATHS:
        lat = r[key]["lat"]
        print(
            f"{key:<8} {len(lat):>8} {r[key]['errors']:>6} {pct(lat, 50):>8.2f} {pct(lat, 99):>8.2f} {statistics.mean(lat) * 1000:>8.2f} {r[key]['throughput']:>10.0f}"
        )
    d = r["direct"]["lat"]
    for key, what in (("gate", "added by the gate"), ("hop", "added by the HTTP hop alone")):
        g = r[key]["lat"]
        print(
            f"{what}: p50 {pct(g, 50) - pct(d, 50):.2f} ms, p99 {pct(g, 99) - pct(d, 99):.2f} ms; "
            f"throughput ratio {key}/direct {r[key]['throughput'] / r['direct']['throughput']:.2f}"
        )
    goal = f"the gate adds under {GOAL_ADDED_P99_MS:g} ms at p50 and p99 at {GOAL_RATE:g} requests/s over direct, no errors"
    if args.rate != GOAL_RATE:
        print(not_run(goal, f"this run was at {args.rate:g} requests/s"))
        return
    g = r["gate"]["lat"]
    measured, met = added_latency(pct(g, 50) - pct(d, 50), pct(g, 99) - pct(d, 99), GOAL_ADDED_P99_MS)
    errors = r["gate"]["errors"]
    print(goal_line(goal, f"{measured}, {errors} errors", met and errors == 0))


if __name__ == "__main__":
    main()
