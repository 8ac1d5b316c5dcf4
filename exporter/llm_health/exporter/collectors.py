"""The exporter's series as prometheus_client families, from the backends' snapshots with
no I/O: the path `/probe` answers from, and the one `/metrics` takes for a format that
exporter.fast_exposition does not write (it serves the configured backends from the text each
round rendered). Both read the same `fast_exposition.FAMILIES` and `fast_exposition.samples`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from .. import __version__
from ..collector_base import SnapshotCollector
from .fast_exposition import FAMILIES, expand, samples
from .slots import Slot


def backend_families(slots: Iterable[Slot]) -> list[Metric]:
    """Metric families for these slots, from their snapshots (no I/O)."""
    families: list[GaugeMetricFamily | CounterMetricFamily] = [
        (CounterMetricFamily if f.type == "counter" else GaugeMetricFamily)(f.name, f.help, labels=list(f.labels)) for f in FAMILIES
    ]
    for slot in slots:
        for family, labels, value in samples(slot):
            for series, v in expand(family, labels, value):
                families[family].add_metric(list(series), v)
    return list(families)


class BackendsCollector(SnapshotCollector):
    """The series of every backend the callable returns (configured ones, or one /probe target)."""

    def __init__(self, slots: Callable[[], Iterable[Slot]]):
        self.slots = slots

    def families(self, describing: bool) -> Iterator[Metric]:
        yield from backend_families(() if describing else self.slots())


class BuildInfoCollector(SnapshotCollector):
    def families(self, describing: bool) -> Iterator[Metric]:
        build = GaugeMetricFamily("llm_exporter_build_info", "llm-health version.", labels=["version"])
        build.add_metric([__version__], 1.0)
        yield build
