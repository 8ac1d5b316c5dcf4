"""The state `/probe` keeps: one slot (monitor, memory, HTTP session) per target and kind,
least recently used first, bounded both in targets and in the engine units their memory
holds, so that no caller can make the exporter keep more than the configured amount."""

from __future__ import annotations

import time
from collections import OrderedDict

from ..config.exporter import Backend, Timing
from .slots import Slot, make_slot, run_round


class ProbeTargets:
    def __init__(self, max_targets: int, max_engines: int):
        self.max_targets = max_targets
        self.max_engines = max_engines
        self.slots: OrderedDict[tuple[str, str], Slot] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def engine_units(self) -> int:
        return sum(s.engine_units for s in self.slots.values())

    def slot(self, target: str, kind: str, timing: Timing) -> Slot:
        """The target's slot, made if new; the most recently used from now on."""
        key = (target, kind)
        slot = self.slots.get(key)
        if slot is None:
            slot = make_slot(Backend(name=target, url=target, kind=kind, timing=timing))
            self.slots[key] = slot
        self.slots.move_to_end(key)
        return slot

    async def round(self, slot: Slot) -> None:
        """One round for the slot, or the one another caller ran while this one waited
        (an HA pair of Prometheus servers scraping the same target at once)."""
        asked = time.monotonic()
        # A round under way when this caller asks reads the target as freshly as its own
        # would: wait for it and answer from it, rather than read the target a second time.
        shared = slot.lock.locked()
        async with slot.lock:
            if not shared and (slot.round_started is None or slot.round_started < asked):
                slot.round_started = time.monotonic()
                await run_round(slot)

    async def trim(self, keep: Slot) -> None:
        """Drop the least recently used slots (never `keep`) until both bounds hold."""
        while len(self.slots) > self.max_targets or (self.engine_units > self.max_engines and len(self.slots) > 1):
            # The oldest slot no caller is using right now.
            found = next(((k, s) for k, s in self.slots.items() if s is not keep and not s.lock.locked()), None)
            if found is None:
                break
            key, oldest = found
            del self.slots[key]
            self.evicted += 1
            await oldest.close()

    async def close(self) -> None:
        for slot in self.slots.values():
            await slot.close()
        self.slots.clear()
