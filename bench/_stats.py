"""The percentile the benchmarks report: the value at rank floor(q/100 * n) of the sorted
values (the last one at most)."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]
