"""The restart policy: which alerts to act on, idempotency, and the restart budget.
Pure: no I/O, time passed in.

* only firing `LLMBackendHung` (by `backend`) and `VLLMEngineHung` (by `instance`) for a
  configured backend of kind engine are accepted;
* one action per backend at a time: any alert for a backend being acted on is a
  duplicate (two engines of one server, or both alerts for the same hang);
* a (fingerprint, startsAt) that led to a restart (or a dry-run one) is a duplicate for
  `KEY_TTL`; one that was refused (not hung, cooldown, budget) is judged again when
  Alertmanager repeats it;
* the budget: at most `max_restarts` per backend within `window`; after the k-th restart
  in the window the next one waits `cooldown * backoff**(k-1)` from the end of the last.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from .webhook import Alert

ACTED_ON = ("LLMBackendHung", "VLLMEngineHung")
REFUSALS = (
    "not_hung",
    "budget_spent",
    "cooldown",
    "duplicate",
    "unauthorised",
    "unknown_backend",
    "malformed",
    "proxy",
    "resolved",
    "state_unavailable",  # shared state (Redis) could not be read or written: acting could double a restart
)
OUTCOMES = ("recovered", "not_recovered", "failed", "timeout", "error", "dry_run")
KEY_TTL = 24 * 3600.0  # how long an acted-on (fingerprint, startsAt) is remembered
MAX_KEYS = 10000


class Target(Protocol):
    """What the policy needs of a configured backend (config.restarter.Target)."""

    @property
    def name(self) -> str: ...
    @property
    def instance(self) -> str: ...
    @property
    def kind(self) -> str: ...


T = TypeVar("T", bound=Target)


@dataclass(frozen=True)
class Budget:
    """At most `max_restarts` per backend within `window`; after the k-th restart in the
    window the next one waits `cooldown * backoff**(k-1)` from the end of the last."""

    max_restarts: int = 3
    window: float = 3600.0
    cooldown: float = 300.0
    backoff: float = 2.0


@dataclass
class RestartRecord:
    started: float
    ended: float | None = None


def budget_verdict(budget: Budget, restarts: Sequence[RestartRecord], now: float) -> tuple[str | None, float]:
    """(None, 0) if a restart may run now, else (`budget_spent` or `cooldown`, seconds to wait).

    Restarts count against the budget from when they started; the cooldown runs from when
    the last one ended (a restart that takes 10 minutes to reload weights does not use up
    its own cooldown) and grows by `backoff` with each restart still in the window."""
    recent = [r for r in restarts if now - r.started < budget.window]
    if len(recent) >= budget.max_restarts:
        return "budget_spent", min(r.started for r in recent) + budget.window - now
    if recent:
        last = max(recent, key=lambda r: r.started)
        gap = budget.cooldown * budget.backoff ** (len(recent) - 1)
        wait = (last.ended if last.ended is not None else last.started) + gap - now
        if wait > 0:
            return "cooldown", wait
    return None, 0.0


@dataclass(frozen=True)
class Admission:
    alert: Alert
    decision: str  # "accepted", "ignored" (not an alert this receiver acts on), or a refusal reason
    backend: str | None = None
    detail: str = ""


class Policy(Generic[T]):
    """Which alerts to act on, idempotency, and the restart budget. Pure: time is passed in.

    * only firing `LLMBackendHung` (by `backend`) and `VLLMEngineHung` (by `instance`) for a
      configured backend of kind engine are accepted;
    * one action per backend at a time: any alert for a backend being acted on is a
      duplicate (two engines of one server, or both alerts for the same hang);
    * a (fingerprint, startsAt) that led to a restart (or a dry-run one) is a duplicate for
      `KEY_TTL`; one that was refused (not hung, cooldown, budget) is judged again when
      Alertmanager repeats it;
    * `claim` spends the budget (`budget_verdict`); refused for `budget_spent`, the backend
      is `exhausted` until the window has room again.
    """

    def __init__(self, targets: Sequence[T], budget: Budget, key_ttl: float = KEY_TTL, max_keys: int = MAX_KEYS):
        self.targets = {t.name: t for t in targets}
        self.by_instance = {t.instance: t for t in targets}
        self.budget = budget
        self.key_ttl = key_ttl
        self.max_keys = max_keys
        self.done: OrderedDict[tuple[str, str], float] = OrderedDict()  # key -> when acted on
        self.in_flight: dict[str, tuple[str, str]] = {}  # backend -> key being acted on
        self.restarts: dict[str, list[RestartRecord]] = {t.name: [] for t in targets}
        self._exhausted: set[str] = set()

    def update(self, targets: Sequence[T], budget: Budget) -> None:
        """New configuration: what is known of backends that stay is kept."""
        self.targets = {t.name: t for t in targets}
        self.by_instance = {t.instance: t for t in targets}
        self.budget = budget
        self.restarts = {t.name: self.restarts.get(t.name, []) for t in targets}

    def target_for(self, alert: Alert) -> T | None:
        if alert.alertname == "LLMBackendHung":
            return self.targets.get(alert.labels.get("backend", ""))
        if alert.alertname == "VLLMEngineHung":
            return self.by_instance.get(alert.labels.get("instance", ""))
        return None

    def _prune(self, now: float) -> None:
        while self.done and (len(self.done) > self.max_keys or now - next(iter(self.done.values())) > self.key_ttl):
            self.done.popitem(last=False)

    def classify(self, alert: Alert) -> Admission | T:
        """The target an alert is about, or why it is not one to act on (no state read)."""
        if alert.alertname not in ACTED_ON:
            return Admission(alert, "ignored", None, f"{alert.alertname} is not an alert the restarter acts on")
        if alert.status != "firing":
            return Admission(alert, "resolved", None, "resolved alerts are not acted on")
        target = self.target_for(alert)
        if target is None:
            label = "backend" if alert.alertname == "LLMBackendHung" else "instance"
            return Admission(alert, "unknown_backend", None, f"no configured backend with {label}={alert.labels.get(label, '')!r}")
        if target.kind == "proxy":
            return Admission(alert, "proxy", target.name, "a proxy is never restarted: its backends are checked and restarted directly")
        return target

    def admit(self, alert: Alert, now: float) -> Admission:
        self._prune(now)
        target = self.classify(alert)
        if isinstance(target, Admission):
            return target
        if alert.key in self.done:
            return Admission(alert, "duplicate", target.name, "this alert (fingerprint, startsAt) was already acted on")
        if target.name in self.in_flight:
            same = self.in_flight[target.name] == alert.key
            why = "this alert is being acted on" if same else "another alert for this backend is being acted on"
            return Admission(alert, "duplicate", target.name, why)
        self.in_flight[target.name] = alert.key
        return Admission(alert, "accepted", target.name)

    def verdict(self, backend: str, now: float) -> tuple[str | None, float]:
        return budget_verdict(self.budget, self.restarts[backend], now)

    def claim(self, backend: str, now: float) -> tuple[str | None, float]:
        """Spend one restart of the budget if it allows one now; else the refusal."""
        refusal, wait = self.verdict(backend, now)
        if refusal == "budget_spent":
            self._exhausted.add(backend)
        if refusal:
            return refusal, wait
        self._exhausted.discard(backend)
        self.restarts[backend].append(RestartRecord(now))
        # Records older than the window never count again.
        self.restarts[backend] = [r for r in self.restarts[backend] if now - r.started < self.budget.window]
        return None, 0.0

    def finish(self, backend: str, key: tuple[str, str], restarted: bool, now: float) -> None:
        """The action for `key` ended; `restarted`: a restart ran (or would have, dry run)."""
        if self.in_flight.get(backend) == key:
            del self.in_flight[backend]
        if restarted:
            self.done[key] = now
            self.done.move_to_end(key)
            records = self.restarts[backend]
            if records and records[-1].ended is None:
                records[-1].ended = now

    def exhausted(self, backend: str, now: float) -> bool:
        """A verified hang was refused for budget and the window still has no room."""
        return backend in self._exhausted and self.verdict(backend, now)[0] == "budget_spent"

    def restarts_in_window(self, backend: str, now: float) -> int:
        return sum(1 for r in self.restarts[backend] if now - r.started < self.budget.window)
