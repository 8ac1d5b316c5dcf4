"""The restart authority's memory in Redis (`redis:` in the restarter's config): shared by
every replica, kept when a restarter restarts. Needs the `redis` extra.

Keys (prefix `llm-health:restarter:` by default; docs/redis-schema.md):

* `<prefix>lease:<backend>` (with `leaseinfo:` and `fence:`): the lease library's lease,
  one per backend: the replica holding it is the only one acting on that backend. It is
  renewed while the action runs and released when it ends; a replica that dies mid-action
  leaves it to expire (`lease_ttl`).
* `<prefix>restarts:<backend>`: sorted set, one member per restart, scored by its start
  (Redis clock, ms); `<prefix>ended:<backend>`: hash, restart id -> end (ms). The budget
  and cooldown are computed from these with `core.restart_policy.budget_verdict`, by the
  lease holder only, with the Redis clock (replicas' clocks never compared).
* `<prefix>done:<backend>:<sha256 of fingerprint and startsAt>`: an alert that led to a
  restart, `SET NX` with a TTL of a day: a duplicate for every replica.
* `<prefix>exhausted:<backend>`: set while a verified hang was refused for budget, for
  as long as the window has no room.
* `<prefix>evidence:<backend>`: an LLMBackendHung's evidence handed to the replica whose
  action for a VLLMEngineHung is waiting for it (`raw_alert_hold`).

A replica that cannot read or write Redis refuses to act (`state_unavailable`): without
the shared state it could double a restart or overspend the budget. Alertmanager repeats
the alert, and it is judged again once Redis answers.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ..config.restarter import SharedState, Target
from ..core.restart_policy import KEY_TTL, Admission, Budget, Policy, RestartRecord, budget_verdict
from ..core.webhook import Alert
from ..store.deployment import connect
from ..store.errors import ERRORS, NotReplicated
from ..store.heartbeat import Heartbeat
from ..store.keys import LeaseKeys
from ..store.leases import LeaseClient
from ..store.records import Lease
from .state import BudgetView, Handoff

log = logging.getLogger("llm_health.restarter")

# ERRORS (store.errors): any Redis trouble; the state is unavailable, never a crash.
POLL = 0.25  # seconds between looks for handed-over evidence
ALREADY_ACTED_ON = "this alert (fingerprint, startsAt) was already acted on"  # a duplicate's detail


@dataclass
class _Held:
    key: tuple[str, str]
    lease: Lease
    heartbeat: Heartbeat
    restart_id: str | None = None


class RedisState:
    mode = "redis"

    def __init__(self, targets: Sequence[Target], budget: Budget, config: SharedState):
        self.policy: Policy[Target] = Policy(targets, budget)  # only its pure checks are used
        self.config = config
        self.prefix = config.key_prefix
        # One server, Sentinel or Cluster (store.deployment); on Cluster every key of a
        # backend carries it as a hash tag, so one MULTI or script can touch them all.
        self.deployment = connect(config.url, socket_timeout=config.timeout)
        self.leases = LeaseClient(self.deployment, keys=LeaseKeys(lease_prefix=self.prefix + "lease:"))
        self.redis = self.leases.redis
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.held: dict[str, _Held] = {}
        self.handoff = Handoff()
        self._exhausted: dict[str, float] = {}  # backend -> monotonic time until which it is (cache for /metrics)

    # --- keys -----------------------------------------------------------------------------
    def _k(self, what: str, backend: str) -> str:
        return f"{self.prefix}{what}:{self.deployment.tag(backend)}"

    def _done_key(self, backend: str, key: tuple[str, str]) -> str:
        digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:32]
        return f"{self.prefix}done:{self.deployment.tag(backend)}:{digest}"

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self.redis.ping()
            for note in await self.deployment.startup_warnings():
                log.warning("shared state: %s", note)
        except ERRORS as exc:  # not fatal: the restarter refuses to act until Redis answers
            log.warning("shared state: Redis does not answer yet (%s); alerts are refused as state_unavailable until it does", type(exc).__name__)

    async def close(self) -> None:
        for backend in list(self.held):
            await self._let_go(backend)
        await self.leases.aclose()

    def update(self, targets: Sequence[Target], budget: Budget) -> None:
        self.policy.update(targets, budget)

    # --- admission ----------------------------------------------------------------------------
    async def admit(self, alert: Alert) -> Admission:
        target = self.policy.classify(alert)
        if isinstance(target, Admission):
            return target
        name = target.name
        held = self.held.get(name)
        if held is not None:
            why = "this alert is being acted on" if held.key == alert.key else "another alert for this backend is being acted on"
            return Admission(alert, "duplicate", name, why)
        try:
            if await self.redis.exists(self._done_key(name, alert.key)):
                return Admission(alert, "duplicate", name, ALREADY_ACTED_ON)
            # A holder id per admission: a claim is idempotent for its holder (a retry
            # gets the same lease back), so two deliveries at once must not share one.
            holder = f"{self.holder}:{uuid.uuid4().hex[:8]}"
            lease = await self.leases.claim(name, holder, ttl_ms=int(self.config.lease_ttl * 1000), job_id=alert.fingerprint)
        except ERRORS as exc:
            return Admission(alert, "state_unavailable", name, f"shared state (Redis) unavailable: {type(exc).__name__}")
        if lease is None:
            return Admission(alert, "duplicate", name, "another restarter replica is acting on this backend")
        # Looked at again under the lease: a replica ending its action writes the done key
        # (confirmed) before it releases the lease, so one that finished between the first
        # look and the claim is seen here, and its alert is not acted on twice.
        try:
            done = await self.redis.exists(self._done_key(name, alert.key))
        except ERRORS as exc:
            done = None
            why = f"shared state (Redis) unavailable: {type(exc).__name__}"
        if done is None or done:
            with contextlib.suppress(*ERRORS):
                await self.leases.release(lease)
            if done is None:
                return Admission(alert, "state_unavailable", name, why)
            return Admission(alert, "duplicate", name, ALREADY_ACTED_ON)
        hb = self.leases.heartbeat(lease)
        self.held[name] = _Held(alert.key, lease, hb)
        return Admission(alert, "accepted", name)

    async def still_ours(self, backend: str) -> bool:
        held = self.held.get(backend)
        if held is None or held.heartbeat.lost.is_set():
            return False
        try:
            return await self.leases.check_fence(backend, held.lease.token)
        except ERRORS:
            return False

    # --- budget ------------------------------------------------------------------------------
    async def _records(self, backend: str) -> tuple[list[RestartRecord], float]:
        """The restarts in the budget's window (start, and end once recorded) and the Redis clock now, in seconds."""
        now_ms = await self.deployment.server_ms(self._k("restarts", backend))
        window_ms = int(self.policy.budget.window * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(self._k("restarts", backend), now_ms - window_ms, "+inf", withscores=True)
        pipe.hgetall(self._k("ended", backend))
        members, ended = await pipe.execute()
        records = [RestartRecord(score / 1000, int(ended[m]) / 1000 if m in ended else None) for m, score in members]
        return records, now_ms / 1000

    async def claim(self, backend: str) -> tuple[str | None, float]:
        if not await self.still_ours(backend):
            return "state_unavailable", 0.0
        try:
            records, now = await self._records(backend)
            refusal, wait = budget_verdict(self.policy.budget, records, now)
            if refusal == "budget_spent":
                await self.redis.set(self._k("exhausted", backend), "1", px=max(1, int(wait * 1000)))
                self._exhausted[backend] = time.monotonic() + wait
            if refusal:
                return refusal, wait
            held = self.held[backend]
            held.restart_id = f"{int(now * 1000)}-{held.lease.token}"
            window_ms = int(self.policy.budget.window * 1000)
            restarts = self._k("restarts", backend)
            # One MULTI, then WAIT on the same connection: the restart counts against the
            # budget only once a replica has it, so a failover cannot reset the budget.
            await self.deployment.run_confirmed(
                restarts,
                [
                    ("MULTI",),
                    ("ZADD", restarts, int(now * 1000), held.restart_id),
                    ("ZREMRANGEBYSCORE", restarts, "-inf", int(now * 1000) - window_ms),
                    ("PEXPIRE", restarts, window_ms + 60_000),
                    ("DEL", self._k("exhausted", backend)),
                    ("EXEC",),
                ],
            )
            self._exhausted.pop(backend, None)
        except NotReplicated as exc:
            log.warning("%s: the budget claim reached no replica (%s): not acting, a failover could forget it", backend, exc)
            # Undone: a restart that does not happen must not spend the budget once the
            # replicas catch up (best effort: left in, it only refuses a restart early).
            ours = self.held.get(backend)
            if ours is not None and ours.restart_id is not None:
                with contextlib.suppress(*ERRORS):
                    await self.redis.zrem(self._k("restarts", backend), ours.restart_id)
                ours.restart_id = None
            return "state_unavailable", 0.0
        except ERRORS as exc:
            log.warning("%s: shared state unavailable while claiming the budget: %s", backend, type(exc).__name__)
            return "state_unavailable", 0.0
        return None, 0.0

    async def budget(self, backend: str) -> BudgetView:
        records, now = await self._records(backend)
        refusal, wait = budget_verdict(self.policy.budget, records, now)
        pttl = await self.redis.pttl(self._k("exhausted", backend))
        exhausted = pttl is not None and pttl > 0 and refusal == "budget_spent"
        if exhausted:
            self._exhausted[backend] = time.monotonic() + pttl / 1000
        else:
            self._exhausted.pop(backend, None)
        return BudgetView(len(records), refusal, wait, exhausted)

    def exhausted(self, backend: str) -> bool:
        return self._exhausted.get(backend, 0.0) > time.monotonic()

    # --- the end of an action ---------------------------------------------------------------------
    async def finish(self, backend: str, key: tuple[str, str], restarted: bool) -> None:
        held = self.held.get(backend)
        self.handoff.take(backend)
        try:
            commands: list[tuple[object, ...]] = [("DEL", self._k("evidence", backend))]
            if restarted:
                now_ms = await self.deployment.server_ms(self._k("restarts", backend))
                commands.append(("SET", self._done_key(backend, key), "1", "PX", int(KEY_TTL * 1000)))
                if held is not None and held.restart_id is not None:
                    window_ms = int(self.policy.budget.window * 1000)
                    commands.append(("HSET", self._k("ended", backend), held.restart_id, str(now_ms)))
                    commands.append(("PEXPIRE", self._k("ended", backend), window_ms + 60_000))
            # The done key makes every later delivery of this alert a duplicate: it
            # must survive a failover (WAIT).
            await self.deployment.run_confirmed(self._k("evidence", backend), commands, confirm=restarted)
        except ERRORS as exc:
            log.warning("%s: could not record the end of the action in Redis: %s", backend, type(exc).__name__)
        await self._let_go(backend)

    async def _let_go(self, backend: str) -> None:
        held = self.held.pop(backend, None)
        if held is None:
            return
        await held.heartbeat.stop()
        if not held.heartbeat.lost.is_set():
            with contextlib.suppress(*ERRORS):
                await self.leases.release(held.lease)

    # --- evidence handed from one alert to another's action ----------------------------------------
    async def offer_evidence(self, backend: str, evidence: str, hold: float) -> None:
        self.handoff.offer(backend, evidence)
        with contextlib.suppress(*ERRORS):
            await self.redis.set(self._k("evidence", backend), evidence, px=max(1, int(hold * 1000)))

    async def wait_evidence(self, backend: str, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while True:
            local = self.handoff.take(backend)
            if local is not None:
                return local
            with contextlib.suppress(*ERRORS):
                shared = await self.redis.getdel(self._k("evidence", backend))
                if shared is not None:
                    return str(shared)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self.handoff.wait(backend, min(POLL, left))
