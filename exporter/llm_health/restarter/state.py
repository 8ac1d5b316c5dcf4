"""What the restart authority remembers: the one action per backend, the alerts acted on,
the restart budget and cooldown, and evidence handed from one alert to the action of
another.

Two stores with one interface:

* `MemoryState` (no `redis:` section): in this process only. A restarter that restarts
  forgets its budget, its cooldowns and the alerts it acted on (Alertmanager's next
  repeat of an alert already acted on is then judged again: re-verified, and restarted
  only if the backend is still hung), and two replicas would each have a budget.
* `shared_state.RedisState` (`redis:` section): in Redis, with the lease library's own
  primitives, shared by every replica and kept across restarts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config.restarter import Target
from ..core.restart_policy import Admission, Budget, Policy
from ..core.webhook import Alert


@dataclass(frozen=True)
class BudgetView:
    restarts_in_window: int
    refusal: str | None  # what a restart asked for now would get: None, budget_spent, cooldown
    wait: float  # seconds until one would be allowed
    exhausted: bool


class RestartState(Protocol):
    mode: str

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def update(self, targets: Sequence[Target], budget: Budget) -> None: ...
    async def admit(self, alert: Alert) -> Admission: ...
    async def claim(self, backend: str) -> tuple[str | None, float]: ...
    async def still_ours(self, backend: str) -> bool: ...
    async def finish(self, backend: str, key: tuple[str, str], restarted: bool) -> None: ...
    async def budget(self, backend: str) -> BudgetView: ...
    def exhausted(self, backend: str) -> bool: ...
    async def offer_evidence(self, backend: str, evidence: str, hold: float) -> None: ...
    async def wait_evidence(self, backend: str, timeout: float) -> str | None: ...


class Handoff:
    """Evidence offered for a backend whose action is holding (waiting for it), in this process."""

    def __init__(self) -> None:
        self.offered: dict[str, str] = {}
        self.events: dict[str, asyncio.Event] = {}

    def offer(self, backend: str, evidence: str) -> None:
        self.offered[backend] = evidence
        self.events.setdefault(backend, asyncio.Event()).set()

    def take(self, backend: str) -> str | None:
        self.events.pop(backend, None)
        return self.offered.pop(backend, None)

    async def wait(self, backend: str, timeout: float) -> bool:
        event = self.events.setdefault(backend, asyncio.Event())
        if event.is_set():
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True


class MemoryState:
    """The restart policy in this process's memory (`core.restart_policy.Policy`)."""

    mode = "memory"

    def __init__(self, targets: Sequence[Target], budget: Budget, clock: Callable[[], float]):
        self.policy: Policy[Target] = Policy(targets, budget)
        self.clock = clock
        self.handoff = Handoff()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def update(self, targets: Sequence[Target], budget: Budget) -> None:
        self.policy.update(targets, budget)

    async def admit(self, alert: Alert) -> Admission:
        return self.policy.admit(alert, self.clock())

    async def claim(self, backend: str) -> tuple[str | None, float]:
        return self.policy.claim(backend, self.clock())

    async def still_ours(self, backend: str) -> bool:
        return backend in self.policy.in_flight

    async def finish(self, backend: str, key: tuple[str, str], restarted: bool) -> None:
        self.handoff.take(backend)
        self.policy.finish(backend, key, restarted, self.clock())

    async def budget(self, backend: str) -> BudgetView:
        now = self.clock()
        refusal, wait = self.policy.verdict(backend, now)
        return BudgetView(self.policy.restarts_in_window(backend, now), refusal, wait, self.policy.exhausted(backend, now))

    def exhausted(self, backend: str) -> bool:
        return self.policy.exhausted(backend, self.clock())

    async def offer_evidence(self, backend: str, evidence: str, hold: float) -> None:
        self.handoff.offer(backend, evidence)

    async def wait_evidence(self, backend: str, timeout: float) -> str | None:
        await self.handoff.wait(backend, timeout)
        return self.handoff.take(backend)
