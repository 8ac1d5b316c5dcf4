"""How late the demo's event loop runs: a machine under load or a long pause delays
every task of the process at once. A lease heartbeat late by more than its TTL loses the
lease, and a request queued through a stall can reach the gate older than its slack and
be refused, rightly. The demo's verdict asks this watch whether a stall explains such a
count, so a correct product does not fail on a stalled machine, and says so.

Only starvation is noted: the part of a stall in which the loop's thread was off the CPU
(the process was not scheduled: other processes, a paused VM), a second or more of it.
The part in which the thread was running is this process' own code blocking the loop, a
product defect the verdict must not excuse; it counts in `longest_s` only."""

from __future__ import annotations

from collections import deque

from ..exporter.lag import LoopWatch

TICK_S = 0.05  # the sleep whose lateness is measured
NOTED_S = 1.0  # stalls with at least this much starvation are kept, with when they happened


def starved_s(late_s: float, cpu_s: float) -> float:
    """Of a tick `late_s` late in which the loop's thread ran `cpu_s` of CPU, the seconds
    it was off the CPU when it should have run (the expected sleep is not in `late_s`)."""
    return max(0.0, late_s - cpu_s)


class StallWatch(LoopWatch):
    def __init__(self, noted_s: float = NOTED_S) -> None:
        super().__init__(TICK_S)
        self.noted_s = noted_s
        self.longest_s = 0.0
        self.noted: deque[tuple[float, float]] = deque(maxlen=256)  # (start, end), monotonic

    def note(self, now: float, late: float, cpu_s: float = 0.0) -> None:
        self.longest_s = max(self.longest_s, late)
        if starved_s(late, cpu_s) >= self.noted_s:
            self.noted.append((now - late, now))

    def stalled_between(self, start: float, end: float) -> bool:
        """True if a noted stall overlapped [start, end] (monotonic seconds)."""
        return any(s <= end and e >= start for s, e in self.noted)
