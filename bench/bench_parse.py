"""Benchmark: the targeted parser (`llm_health.core.exposition.parse`) against prometheus_client's
full parse (`text_string_to_metric_families`) on the real /metrics payloads.

    python -m bench.bench_parse [METRICS_DIR] [--repeat N] [--number N]

METRICS_DIR defaults to tests/data/real-world/metrics. For each payload
it first checks that both parsers give the same values for the wanted names, then times
prometheus_client's full parse and ours with three name sets: the set of the payload's own
engine profile, the ~20 names a vLLM profile asks for, and the union of every engine's names.
Times are the best of several repeats.

The goal (at least 40x faster than prometheus_client, same values) is judged per engine on
its own payloads in the "own" column (the engine's own name set), on the smallest ratio,
one goal line per engine. Every ratio is printed to one decimal, and the goal is judged on
that printed figure, so the line and its verdict cannot disagree at the boundary.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import timeit
from pathlib import Path

from tests.fixtures.prom_reference import reference

from bench._goal import goal_line
from bench._machine import machine_line
from llm_health.core import engines

ROOT = Path(__file__).resolve().parents[1]


DEFAULT_DIR = ROOT / "tests" / "data" / "real-world" / "metrics"

VLLM_SET = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_swapped",
        "vllm:iteration_tokens_total_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cpu_cache_usage_perc",
        "vllm:engine_sleep_state",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "process_start_time_seconds",
    }
)
# The "own" column: vLLM payloads with the set above, every other registered engine's
# with what its profile asks for (core.engines).
ENGINE_SETS = {
    "vllm": VLLM_SET,
    **{p.name: p.wanted for p in engines.PROFILES if p.prefix != engines.VLLM_V1.prefix},
}
UNION_SET = frozenset().union(*ENGINE_SETS.values())
GOAL_RATIO = 40.0


def _same(a: dict, b: dict) -> bool:
    key = lambda d: {n: [(lab, "NaN" if math.isnan(v) else v) for lab, v in s] for n, s in d.items()}  # noqa: E731
    return key(a) == key(b)


def shown(ratio: float) -> str:
    """A ratio as every row and goal line prints it; the goal is judged on this text."""
    return f"{ratio:.1f}x"


def best_seconds(fn, repeat: int = 7, number: int = 0) -> float:
    """Best time of one call: `repeat` runs of `number` calls (0: as many as take ~0.2 s)."""
    timer = timeit.Timer(fn)
    if number <= 0:
        number, _ = timer.autorange()
    return min(timer.repeat(repeat=repeat, number=number)) / number


def main(argv: list[str]) -> int:
    from importlib.metadata import version

    from prometheus_client.parser import text_string_to_metric_families

    from llm_health.core.exposition import parse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--repeat", type=int, default=7, help="timed repeats, the best kept (default 7)")
    ap.add_argument("--number", type=int, default=0, help="calls per repeat (default: as many as take about 0.2 s)")
    args = ap.parse_args(argv[1:])
    if args.repeat < 1 or args.number < 0:
        ap.error("--repeat must be at least 1 and --number at least 0")
    directory: Path = args.metrics_dir
    files = sorted(directory.glob("*.prom"))
    if not files:
        print(f"no *.prom files in {directory}", file=sys.stderr)
        return 1

    print(f"machine: {machine_line()}")
    print(f"python {platform.python_version()} ({platform.python_implementation()}), prometheus_client {version('prometheus-client')}")
    print(
        f"name sets: vllm = {len(VLLM_SET)} names, union of all engines = {len(UNION_SET)} names, "
        "own = the set of the payload's engine; frozensets, as engines.py passes them"
    )
    print(f"times: best of {args.repeat} repeats; ratio = prometheus_client ms / ours ms; hits = samples returned")
    print()
    width = max(len(p.name) for p in files)
    header = f"{'file':<{width}} {'bytes':>6} {'samples':>7} {'prom ms':>7}"
    for label in ("own", "vllm", "union"):
        header += f" | {label + ' ms':>8} {'hits':>4} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    ratios: dict[str, list[float]] = {"own": [], "vllm": [], "union": []}
    judged: dict[str, list[tuple[float, str]]] = {}  # engine -> (ratio with its own set, file)
    for path in files:
        text = path.read_text(encoding="utf-8")
        engine = next(e for e in ENGINE_SETS if path.name.startswith(e))
        own = ENGINE_SETS[engine]
        sets = {"own": own, "vllm": VLLM_SET, "union": UNION_SET}
        expected = reference(text)
        hits = {}
        for label, names in sets.items():  # the values must agree before anything is timed
            got = parse(text, names)
            if not _same(got, {n: s for n, s in expected.items() if n in names}):
                print(f"MISMATCH in {path.name} with the {label} set", file=sys.stderr)
                return 2
            hits[label] = sum(map(len, got.values()))

        prom = best_seconds(lambda t=text: list(text_string_to_metric_families(t)), args.repeat, args.number)
        row = f"{path.name:<{width}} {len(text.encode()):>6} {sum(map(len, expected.values())):>7} {prom * 1e3:>7.3f}"
        for label, names in sets.items():
            ours = best_seconds(lambda n=names, t=text: parse(t, n), args.repeat, args.number)
            ratios[label].append(prom / ours)
            if label == "own":
                judged.setdefault(engine, []).append((prom / ours, path.name))
            row += f" | {ours * 1e3:>8.4f} {hits[label]:>4} {shown(prom / ours):>6}"
        print(row, flush=True)
    print("-" * len(header))
    for label, values in ratios.items():
        geo = math.exp(sum(map(math.log, values)) / len(values))
        print(f"{label:>5} set, all {len(values)} payloads: geometric mean ratio {shown(geo)}, minimum {shown(min(values))}")
    print()
    for engine, rows in sorted(judged.items(), key=lambda kv: kv[0] != "vllm"):
        values = [r for r, _ in rows]
        geo = math.exp(sum(map(math.log, values)) / len(values))
        low, where = min(rows)
        printed = shown(low)
        print(f"{engine} payloads, own column: geometric mean {shown(geo)}, minimum {printed} ({where})")
        print(
            goal_line(
                f"{engine} payloads ({len(rows)}), own column ({engine} name set), each at least {GOAL_RATIO:g}x faster than prometheus_client",
                f"minimum {printed} ({where}), geometric mean {shown(geo)}",
                float(printed.rstrip("x")) >= GOAL_RATIO,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
