"""The base of every collector in the package: fresh metric families from a snapshot on
each collect, no I/O inside `collect()` (the sources are awaited first, then rendered),
and a real `describe()`, so a registry refuses two collectors that export one name."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class SnapshotCollector(Collector):
    """Subclasses implement `families(describing)` on what they hold. With `describing`
    true they yield every family they can ever export (samples do not matter), even
    before the first snapshot exists."""

    def families(self, describing: bool) -> Iterable[Metric]:
        raise NotImplementedError

    def collect(self) -> Iterable[Metric]:
        return self.families(describing=False)

    def describe(self) -> Iterable[Metric]:
        return [Metric(f.name, f.documentation, f.type, f.unit) for f in self.families(describing=True)]
