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
import inspect
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
from bench._unjudged import failed_line
from llm_health.config.gate import Route
from llm_health.gate.outcome import Attempt
from llm_health.store.policy import Figures, Verdict
from llm_health.store.queue import Decided, QueueRecord, RouteStats

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


async def _enqueue_and_read(
    request_id: str, route: Route, tenant: str, deadline_ms: int, now: int, fingerprint: str | None = None, retries: int = 0
) -> Decided:
    """The `hop` stand-in for Admission._enqueue_and_read: admitted as a first attempt on an
    empty queue, no tenant budget, no engine queue age, nothing ahead (the decision the
    script makes there, store.policy)."""
    record = QueueRecord(request_id, route.name, tenant, enqueued_ms=now, deadline_ms=deadline_ms, state="running")
    slack = deadline_ms - now
    verdict = Verdict("admit_once", f"queue age 0 ms < deadline slack {slack} ms", 200, None, False)
    return Decided(record, RouteStats(0, None, None, 0, 0, None), 0.0, [], None, False, None, None, verdict, Figures(0, slack, 0, None, None))


async def _finish_once(attempt: Attempt, status: int | None, units: int) -> None:
    """The `hop` stand-in for Admission._finish_once: nothing recorded."""


STANDINS = {"_enqueue_and_read": _enqueue_and_read, "_finish_once": _finish_once}


def standin_drift() -> list[str]:
    """How each `hop` stand-in's signature (names, defaults, annotations, the return type)
    differs from the Admission method it replaces; empty when they match. The run refuses to
    start on a difference (a stand-in of the wrong shape made every `hop` request fail once)."""
    from llm_health.gate.decision import Admission

    out = []
    for name, standin in STANDINS.items():
        real = inspect.signature(getattr(Admission, name))
        real = real.replace(parameters=list(real.parameters.values())[1:])  # less `self`
        if (mine := inspect.signature(standin)) != real:
            out.append(f"{name}{mine} is not Admission.{name}{real}")
    return out


def gate_proc(port: int, upstream: str, redis_url: str, without_redis: bool = False) -> None:
    from llm_health.config.gate import parse_gate_config
    from llm_health.gate.app import Gate, tune_gc
    from llm_health.web import run_app

    cfg = parse_gate_config({"gate": {"redis": redis_url, "routes": {"bench": {"upstream": upstream, "default_deadline_ms": 30000}}}}, "<bench>")
    gate = Gate(cfg)
    if without_redis:  # the `hop` decomposition: the same handler, no Redis round trips
        if drift := standin_drift():
            raise SystemExit("bench_gate: " + "; ".join(drift))
        for name, standin in STANDINS.items():
            setattr(gate.admission, name, standin)
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


async def answered_200(session, url: str, request_id: str) -> bool:
    """One request (its own id): whether it was answered 200 (an error or no answer: no)."""
    try:
        async with session.post(url, json=BODY, headers={"X-Request-Id": request_id}) as r:
            await r.read()
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def open_loop(session, url: str, rate: float, seconds: float) -> tuple[list[float], int]:
    """(the latency of each answer, how many requests failed: an answer other than 200 or
    none). A failed request's time is in no latency figure."""
    lat: list[float] = []
    errors = 0

    async def one(i):
        nonlocal errors
        t = time.perf_counter()
        if await answered_200(session, url, f"b{time.time_ns()}-{i}"):
            lat.append(time.perf_counter() - t)
        else:
            errors += 1

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


async def closed_loop(session, url: str, concurrency: int, seconds: float) -> tuple[float, int]:
    """(200 answers per second, how many requests failed): only a 200 counts as throughput."""
    done = failed = 0
    stop = time.perf_counter() + seconds

    async def worker(w):
        nonlocal done, failed
        i = 0
        while time.perf_counter() < stop:
            ok = await answered_200(session, url, f"c{w}-{i}-{time.time_ns()}")
            done, failed = (done + 1, failed) if ok else (done, failed + 1)
            i += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / seconds, failed


def pct(values, p):
    """The percentile of latencies in seconds, in ms."""
    return percentile(values, p) * 1000 if values else float("nan")


PATHS = ("direct", "gate", "hop")


async def measure(urls: dict[str, str], rate: float, seconds: float) -> dict:
    conn = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
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
            out[key]["throughput"], out[key]["closed_errors"] = await closed_loop(s, urls[key], 64, 3)
    return out


def report(r: dict, rate: float, seconds: float) -> list[str]:
    """The table, the added figures and the goal line. A figure taken from a path that saw a
    failed request (open or closed loop) is not printed: a FAILED line says how many failed,
    and no goal is judged on it."""
    sent = {key: len(r[key]["lat"]) + r[key]["errors"] for key in PATHS}
    lines = [
        f"open loop at {rate:g} req/s for {seconds:g} s per path (interleaved halves); closed loop: 64 clients, 3 s; "
        "a request failed: an answer other than 200, or none (its time is in no figure)",
        "hop = the gate with its Redis round trips replaced by constants (a decomposition, not a mode)",
        "requests, failed, p50, p99, mean: the open loop's; max req/s: the closed loop's 200 answers a second, failed: its failed requests",
        f"{'path':<8} {'requests':>8} {'failed':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'max req/s':>10} {'failed':>6}",
    ]
    for key in PATHS:
        lat = r[key]["lat"]
        mean = statistics.mean(lat) * 1000 if lat else float("nan")
        lines.append(
            f"{key:<8} {sent[key]:>8} {r[key]['errors']:>6} {pct(lat, 50):>8.2f} {pct(lat, 99):>8.2f} {mean:>8.2f} "
            f"{r[key]['throughput']:>10.0f} {r[key]['closed_errors']:>6}"
        )
    d = r["direct"]["lat"]

    def failures(*keys: str) -> str:
        return ", ".join(
            f"{key} {r[key]['errors']} of {sent[key]} open-loop and {r[key]['closed_errors']} closed-loop requests failed"
            for key in keys
            if r[key]["errors"] or r[key]["closed_errors"]
        )

    for key, what in (("gate", "added by the gate"), ("hop", "added by the HTTP hop alone")):
        if failed := failures("direct", key):
            lines.append(failed_line(f"what is {what}", failed))
            continue
        g = r[key]["lat"]
        lines.append(
            f"{what}: p50 {pct(g, 50) - pct(d, 50):.2f} ms, p99 {pct(g, 99) - pct(d, 99):.2f} ms; "
            f"throughput ratio {key}/direct {r[key]['throughput'] / r['direct']['throughput']:.2f}"
        )
    goal = f"the gate adds under {GOAL_ADDED_P99_MS:g} ms at p50 and p99 at {GOAL_RATE:g} requests/s over direct, no errors"
    if rate != GOAL_RATE:
        lines.append(not_run(goal, f"this run was at {rate:g} requests/s"))
    elif failed := failures("direct", "gate"):
        lines.append(failed_line(goal, failed))
    else:
        g = r["gate"]["lat"]
        measured, met = added_latency(pct(g, 50) - pct(d, 50), pct(g, 99) - pct(d, 99), GOAL_ADDED_P99_MS)
        lines.append(goal_line(goal, f"{measured}, 0 errors", met))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=6)
    args = ap.parse_args()
    from llm_health.sim.drills import temporary_redis

    if drift := standin_drift():
        raise SystemExit("bench_gate: " + "; ".join(drift))
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
    print("\n".join(report(r, args.rate, args.seconds)))


if __name__ == "__main__":
    main()
