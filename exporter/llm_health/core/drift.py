"""What a GPU pool looks like in one round, and where its leases disagree with the engines.

Pure: the exporter's Redis view reads the leases and the backend states, then asks
`pool_snapshot` what they add up to. Two kinds of drift:

* `lease_on_idle_backend`: the same lease (holder and fencing token) was held last round
  and this round while the GPU's backend was idle in both: a holder that forgot to
  release, or a partitioned worker that thinks it still runs;
* `busy_without_lease`: the backend has work in flight (busy, stalled, hung or unknown)
  and its GPU has no lease: a job that never claimed its GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .states import IN_FLIGHT, State

DRIFT_KINDS = ("lease_on_idle_backend", "busy_without_lease")

Identity = tuple[str, int | None]  # (holder, fencing token): one claim


class HeldLease(Protocol):
    @property
    def holder(self) -> str: ...
    @property
    def token(self) -> int | None: ...
    @property
    def ttl_ms(self) -> int | None: ...
    @property
    def claimed_ms(self) -> int | None: ...


@dataclass
class PoolSnapshot:
    size: int
    held: int
    waiters: int
    ttl_min_ms: int | None
    age_max_ms: int | None
    without_ttl: int
    drift: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in DRIFT_KINDS})


@dataclass
class PoolRound:
    """A pool's snapshot, the claims held now (for the next round's drift) and, per held
    GPU, (holder, token, expiry on the Redis clock) for counting releases missed while
    the keyevent feed was down."""

    snapshot: PoolSnapshot
    held: dict[str, Identity]
    expiry: dict[str, tuple[str, int | None, float]]


def pool_snapshot(
    gpus: Sequence[str],
    leased: Mapping[str, HeldLease],
    waiters: int,
    backends: Mapping[str, str],
    states: Mapping[str, str],
    prev_states: Mapping[str, str],
    prev_held: Mapping[str, Identity],
    server_ms: int,
) -> PoolRound:
    """`leased`: the GPUs with a lease now; `backends`: GPU -> backend name; `states`,
    `prev_states`: backend -> health state this round and last; `prev_held`: GPU -> the
    claim held last round; `server_ms`: the Redis clock."""
    snap = PoolSnapshot(size=len(gpus), held=0, waiters=int(waiters), ttl_min_ms=None, age_max_ms=None, without_ttl=0)
    held: dict[str, Identity] = {}
    expiry: dict[str, tuple[str, int | None, float]] = {}
    for gpu in gpus:
        lease = leased.get(gpu)
        backend = backends.get(gpu)
        state = states.get(backend) if backend else None
        if lease is None:
            if state in IN_FLIGHT:
                snap.drift["busy_without_lease"].append(gpu)
            continue
        snap.held += 1
        identity = (lease.holder, lease.token)
        held[gpu] = identity
        if lease.ttl_ms is None:
            snap.without_ttl += 1
            expire_at = float("inf")
        else:
            snap.ttl_min_ms = lease.ttl_ms if snap.ttl_min_ms is None else min(snap.ttl_min_ms, lease.ttl_ms)
            expire_at = server_ms + lease.ttl_ms
        expiry[gpu] = (lease.holder, lease.token, expire_at)
        if lease.claimed_ms is not None:
            age = server_ms - lease.claimed_ms
            snap.age_max_ms = age if snap.age_max_ms is None else max(snap.age_max_ms, age)
        # "Idle for a whole round": the same claim was there last round and the backend
        # was idle then and now.
        if backend and state == State.IDLE and prev_states.get(backend) == State.IDLE and prev_held.get(gpu) == identity:
            snap.drift["lease_on_idle_backend"].append(gpu)
    return PoolRound(snap, held, expiry)
