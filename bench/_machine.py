"""The machine line every benchmark prints: which CPU the figures come from."""

from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def calibration_ms() -> float:
    """This machine's speed right now, on one core: the best of 5 runs of a fixed
    pure-Python workload (string building, a dict, sha256), in ms. The same figure on two
    runs means the same speed; use it to compare absolute times across runs and machines."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        table: dict[str, int] = {}
        for i in range(20_000):
            key = f'vllm:num_requests_running{{engine="{i % 64}"}}'
            table[key] = table.get(key, 0) + len(hashlib.sha256(key.encode()).digest())
        best = min(best, time.perf_counter() - start)
    return best * 1000


def machine_line(*software: str, calibration: float | None = None) -> str:
    """CPU, cores, memory, kernel, Python, the software measured, the calibration figure
    (taken here unless given: a benchmark whose goal is a ratio of it passes the one it
    judges with) and the load average when the run began (these machines are shared)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [cpu_model(), f"{os.cpu_count()} cores", f"{mem:.0f} GiB", f"Linux {platform.release()}", f"Python {platform.python_version()}", *software]
    cal = calibration_ms() if calibration is None else calibration
    return ", ".join(parts) + f", calibration {cal:.1f} ms, loadavg at start {os.getloadavg()[0]:.2f}"


CALIBRATION_PAYLOAD = Path(__file__).resolve().parents[1] / "tests" / "data" / "real-world" / "metrics" / "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom"


def prometheus_parse_ms(text: str) -> float:
    """prometheus_client's full parse of `text`: the best of 7, in ms."""
    import timeit

    from prometheus_client.parser import text_string_to_metric_families

    timer = timeit.Timer(lambda: list(text_string_to_metric_families(text)))
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=7, number=number)) / number * 1000


def parse_calibration_ms() -> float:
    """The second calibration figure: prometheus_client's parse of the 45 KB vLLM fixture
    (tests/data/real-world/metrics), best of 7, in ms (bench_admission prints the same)."""
    return prometheus_parse_ms(CALIBRATION_PAYLOAD.read_text())
