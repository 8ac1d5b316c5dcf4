"""How late the exporter's event loop runs: the sign that one exporter watches more
backends than it can read (docs/limits.md, "Shards and HA pairs").

A task asks to wake every `tick` seconds and notes how much later than asked it woke.
`llm_exporter_event_loop_lag_seconds` is the largest lateness over the last `window`
seconds. Past what the loop can do, every read waits behind the others, reads time out and
backends read as `down` that are not: a lag of seconds means shard the fleet
(docs/scaling.md)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ..collector_base import SnapshotCollector


class LoopWatch:
    """A task that asks to wake every `tick` seconds and hands `note` how much later than
    asked it woke and how much CPU the loop's thread used meanwhile (time off the CPU is
    the machine's doing; time on it, this process' own). `LoopLag` here and the demo's
    stall watch (sim.stalls) are the two notes."""

    def __init__(self, tick: float):
        self.tick = tick
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{type(self).__name__}-ticks")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            asked, cpu = time.monotonic() + self.tick, time.thread_time()
            await asyncio.sleep(self.tick)
            now = time.monotonic()
            self.note(now, max(0.0, now - asked), time.thread_time() - cpu)

    def note(self, now: float, late: float, cpu_s: float = 0.0) -> None:
        raise NotImplementedError


class LoopLag(LoopWatch, SnapshotCollector):
    def __init__(self, tick: float = 0.25, window: float = 10.0):
        super().__init__(tick)
        self.window = window
        self._late: deque[tuple[float, float]] = deque()  # (woke at, seconds late), monotonic

    def note(self, now: float, late: float, cpu_s: float = 0.0) -> None:
        self._late.append((now, late))
        while self._late and self._late[0][0] < now - self.window:
            self._late.popleft()

    def seconds(self) -> float:
        return max((late for _, late in self._late), default=0.0)

    def families(self, describing: bool) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "llm_exporter_event_loop_lag_seconds",
            f"Largest lateness of the exporter's event loop over the last {self.window:g} s: seconds mean it watches more backends than it can read.",
        )
        if not describing:
            g.add_metric([], self.seconds())
        yield g
