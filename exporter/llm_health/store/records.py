"""What the lease library hands out and reads back: pools, leases held, lease states."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .codes import LeaseError
from .connection import text


@dataclass(frozen=True)
class Pool:
    """A named set of GPU ids (from configuration or a Redis set)."""

    name: str
    gpus: tuple[str, ...]

    def __init__(self, name: str, gpus: Sequence[str]):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "gpus", tuple(gpus))


@dataclass(frozen=True)
class Lease:
    """A lease this process holds. ``token`` is the fencing token of this claim.
    ``via`` says how it was obtained: ``claim`` (first try), ``del`` or ``expired``
    (woken by that keyspace event), ``fallback`` (slow re-check) or ``resubscribe``.
    ``sent_at`` is this process's monotonic clock when the claim was sent: the lease is
    surely valid until ``sent_at`` plus its TTL, whatever the network did afterwards."""

    gpu: str
    holder: str
    token: int
    ttl_ms: int
    claimed_ms: int
    job_id: str = ""
    via: str = "claim"
    sent_at: float = 0.0


@dataclass(frozen=True)
class LeaseState:
    """What Redis says about one GPU. ``token``/``claimed_ms``/``job_id`` are None for a
    lease written by an old-style scheduler (no side hash, or one of another holder)."""

    gpu: str
    holder: str
    ttl_ms: int | None  # None: the lease has no TTL (never expires: a bug somewhere)
    token: int | None = None
    claimed_ms: int | None = None
    job_id: str | None = None


class LeaseLost(LeaseError):
    """The lease could not be renewed: someone else may hold the GPU now."""

    def __init__(self, lease: Lease, reason: str):
        self.lease, self.reason = lease, reason
        super().__init__(f"lease on {lease.gpu} (token {lease.token}) lost: {reason}")


class KeyspaceEventsOff(LeaseError, RuntimeError):
    """Redis does not publish the keyspace events the waiters need."""

    def __init__(self, current: str, command: str, where: str | None = None):
        self.current, self.command, self.where = current, command, where
        on = f" on {where} (run it on every primary)" if where else ""
        super().__init__(
            f"Redis notify-keyspace-events is {current!r}{on}; waiting for a GPU needs "
            f"E (keyevent channel) with g (del) and x (expired), or A. Run: {command} "
            f"(it keeps the flags already set; put the same in redis.conf to survive a restart)"
        )


def parse_lease(gpu: str, value: Any, pttl: Any, info: Sequence[Any]) -> LeaseState | None:
    """Build a :class:`LeaseState` from GET, PTTL and HMGET(holder, token, claimed_ms,
    job_id). The side hash only counts when its holder is the lease's holder: an
    old-style scheduler's lease has no hash, or a leftover one of someone else."""
    if value is None:
        return None
    holder = text(value)
    ttl = int(pttl) if pttl is not None else -2
    ttl_ms = ttl if ttl >= 0 else None
    info_holder, token, claimed, job = (text(x) for x in info) if info else (None,) * 4
    if info_holder != holder:
        return LeaseState(gpu, holder, ttl_ms)
    return LeaseState(
        gpu,
        holder,
        ttl_ms,
        int(token) if token else None,
        int(claimed) if claimed else None,
        job if job is not None else None,
    )


@dataclass
class ReconcileReport:
    """What `LeaseClient.reconcile` found and changed (lists of GPU ids with detail)."""

    deleted: list[tuple[str, str]] = field(default_factory=list)  # (gpu, holder) leases nobody held
    busy_without_lease: list[tuple[str, str]] = field(default_factory=list)  # (gpu, what the worker does)
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)  # (gpu, lease holder, worker says)
    kept_young: list[tuple[str, str]] = field(default_factory=list)  # idle worker, lease within grace
    unreachable: list[tuple[str, str]] = field(default_factory=list)  # (gpu, error)
    consistent: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.deleted)

    def as_dict(self) -> dict[str, Any]:
        return {
            "deleted": [list(x) for x in self.deleted],
            "busy_without_lease": [list(x) for x in self.busy_without_lease],
            "mismatched": [list(x) for x in self.mismatched],
            "kept_young": [list(x) for x in self.kept_young],
            "unreachable": [list(x) for x in self.unreachable],
            "consistent": self.consistent,
        }
