"""GPU leases in Redis: claim, renew, release, wait for a free GPU, reconcile.

The data contract is in docs/redis-schema.md. In short:

- ``<lease_prefix><gpu>`` (default ``gpu:lease:<gpu>``) holds the holder id, set with
  ``SET NX PX``: the format every existing scheduler already reads and writes.
- ``<info_prefix><gpu>`` (default ``gpu:leaseinfo:<gpu>``) is a side hash with what an
  old-style holder id cannot carry: fencing token, claim time, job id, TTL. Same TTL as
  the lease, written in the same Lua script, so both vanish at the same instant.
- ``<fence_prefix><gpu>`` (default ``gpu:fence:<gpu>``) is the fencing counter, INCR'd
  in the claim script: each claim gets a larger token than every claim before it.
- ``<waiters_prefix><pool>`` (default ``gpu:waiters:<pool>``) is a sorted set of the
  callers blocked in `LeaseClient.wait_for_gpu`, scored by their deadline (ms).

Waiting is event driven (keyspace notifications ``del`` and ``expired``): subscribe
first, then claim, then retry on every event, the order that cannot lose a release. A
slow fallback re-check covers pub/sub's fire-and-forget delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from redis import asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from .connection import TRANSIENT, db_of, server_ms, text
from .feed import RESUBSCRIBED, KeyeventFeed, required_keyspace_command
from .heartbeat import Heartbeat
from .keys import LeaseKeys
from .records import KeyspaceEventsOff, Lease, LeaseLost, LeaseState, Pool, ReconcileReport, parse_lease
from .scripts import ADD_WAITER_LUA, CHECK_FENCE_LUA, CLAIM_LUA, DELETE_IF_HOLDER_LUA, RELEASE_LUA, RENEW_LUA

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TTL_MS = 30_000
DEFAULT_FALLBACK_INTERVAL_S = 1.0


class LeaseClient:
    """Lease operations on one Redis database.

    ``redis`` should be created with ``decode_responses=True`` or not; both work.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        keys: LeaseKeys | None = None,
        ttl_ms: int = DEFAULT_TTL_MS,
        fallback_interval_s: float = DEFAULT_FALLBACK_INTERVAL_S,
    ):
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        self.redis = redis
        self.keys = keys or LeaseKeys()
        self.ttl_ms = ttl_ms
        self.fallback_interval_s = fallback_interval_s
        self.db = db_of(redis)
        self._claim = redis.register_script(CLAIM_LUA)
        self._renew = redis.register_script(RENEW_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._check_fence = redis.register_script(CHECK_FENCE_LUA)
        self._delete_if_holder = redis.register_script(DELETE_IF_HOLDER_LUA)
        self._add_waiter = redis.register_script(ADD_WAITER_LUA)
        self._notifications_ok = False
        self._feed = KeyeventFeed(redis, self.keys, self.db)

    @classmethod
    def from_url(cls, url: str, *, socket_timeout: float = 5.0, **kwargs: Any) -> LeaseClient:
        """A client with read and connect timeouts on its connections: a black-holed
        connection fails a call instead of blocking it (the heartbeat also bounds each
        renewal by the lease's validity)."""
        redis = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        return cls(redis, **kwargs)

    async def aclose(self) -> None:
        await self._feed.aclose()
        await self.redis.aclose()

    # ------------------------------------------------------------ claim / renew / release

    async def claim(self, gpu: str, holder: str, *, ttl_ms: int | None = None, job_id: str = "") -> Lease | None:
        """``SET NX PX`` the lease of one GPU; None if someone holds it. Exactly one of
        any number of concurrent callers wins."""
        return await self.claim_any([gpu], holder, ttl_ms=ttl_ms, job_id=job_id, start=0)

    async def claim_any(
        self,
        gpus: Sequence[str],
        holder: str,
        *,
        ttl_ms: int | None = None,
        job_id: str = "",
        start: int | None = None,
        via: str = "claim",
    ) -> Lease | None:
        """Claim the first free GPU of ``gpus`` in one round trip (one Lua script),
        starting at index ``start`` (random by default, to spread concurrent claimers)."""
        if not gpus:
            return None
        ttl = int(ttl_ms or self.ttl_ms)
        if start is None:
            start = random.randrange(len(gpus))
        keys = [self.keys.lease(g) for g in gpus] + [self.keys.info(g) for g in gpus] + [self.keys.fence(g) for g in gpus]
        sent = time.monotonic()  # the lease is surely valid until sent + TTL (heartbeat)
        got = await self._claim(keys=keys, args=[holder, ttl, job_id, start])
        if not got:
            return None
        index, token, now = int(got[0]), int(got[1]), int(got[2])
        return Lease(gpus[index], holder, token, ttl, now, job_id, via, sent_at=sent)

    async def renew(self, lease: Lease, ttl_ms: int | None = None) -> bool:
        """Extend the lease; refused (False) unless this claim still holds it."""
        ttl = int(ttl_ms or lease.ttl_ms)
        ok = await self._renew(
            keys=[self.keys.lease(lease.gpu), self.keys.info(lease.gpu)],
            args=[lease.holder, lease.token, ttl],
        )
        return bool(ok)

    async def release(self, lease: Lease) -> bool:
        """Delete the lease; refused (False) unless this claim still holds it."""
        ok = await self._release(
            keys=[self.keys.lease(lease.gpu), self.keys.info(lease.gpu)],
            args=[lease.holder, lease.token],
        )
        return bool(ok)

    async def check_fence(self, gpu: str, token: int) -> bool:
        """For the GPU worker: True only if ``token`` is the fencing token of the lease
        held on ``gpu`` right now. A holder whose lease expired (and was perhaps claimed
        again, with a larger token) is refused. Workers that also remember the largest
        token they have served can refuse older ones without asking Redis."""
        ok = await self._check_fence(keys=[self.keys.lease(gpu), self.keys.info(gpu)], args=[int(token)])
        return bool(ok)

    async def read(self, gpu: str) -> LeaseState | None:
        """The lease on ``gpu`` as Redis has it, None if free."""
        return (await self.read_many([gpu]))[gpu]

    async def read_many(self, gpus: Sequence[str]) -> dict[str, LeaseState | None]:
        """The leases of ``gpus`` in one pipelined round trip (never KEYS or SCAN)."""
        pipe = self.redis.pipeline(transaction=False)
        for g in gpus:
            pipe.get(self.keys.lease(g))
            pipe.pttl(self.keys.lease(g))
            pipe.hmget(self.keys.info(g), "holder", "token", "claimed_ms", "job_id")
        replies = await pipe.execute()
        out: dict[str, LeaseState | None] = {}
        for i, g in enumerate(gpus):
            out[g] = parse_lease(g, replies[3 * i], replies[3 * i + 1], replies[3 * i + 2])
        return out

    # ------------------------------------------------------------ heartbeat

    def heartbeat(
        self,
        lease: Lease,
        *,
        interval_s: float | None = None,
        on_lost: Callable[[], Any] | None = None,
    ) -> Heartbeat:
        """Start renewing ``lease`` (default every TTL/3). Stop it with ``await hb.stop()``."""
        return Heartbeat(self.renew, lease, interval_s or lease.ttl_ms / 3000, on_lost)

    async def run_leased(
        self,
        lease: Lease,
        job: Coroutine[Any, Any, T] | Awaitable[T],
        *,
        interval_s: float | None = None,
        release: bool = True,
    ) -> T:
        """Run ``job`` while a heartbeat keeps ``lease`` alive. If a renewal fails the
        job's task is cancelled and :class:`LeaseLost` is raised: a job must not go on
        writing on a GPU it may no longer own. The lease is released at the end unless
        ``release=False``."""
        task = asyncio.ensure_future(job)
        hb = self.heartbeat(lease, interval_s=interval_s, on_lost=task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if hb.lost.is_set() and not (current and current.cancelling()):
                raise LeaseLost(lease, hb.reason or "lost") from None
            raise
        finally:
            await hb.stop()
            if release and not hb.lost.is_set():
                with contextlib.suppress(*TRANSIENT, RedisError):
                    await self.release(lease)

    # ------------------------------------------------------------ keyspace events

    async def check_notifications(self) -> str:
        """Verify that Redis publishes ``del`` and ``expired`` keyevents; return the
        flags. Raises :class:`KeyspaceEventsOff` naming the exact ``CONFIG SET`` to run.
        Where CONFIG is disabled (managed Redis) it cannot check: it logs and returns ''."""
        try:
            reply = await self.redis.config_get("notify-keyspace-events")
        except ResponseError as e:
            log.warning("cannot read notify-keyspace-events (%s); make sure it includes Egx", e)
            return ""
        flags = text(next(iter(reply.values()), "")) if reply else ""
        command = required_keyspace_command(flags)
        if command:
            raise KeyspaceEventsOff(flags, command)
        self._notifications_ok = True
        return flags

    # ------------------------------------------------------------ waiting

    async def _register_waiter(self, pool: Pool, waiter: str, deadline_ms: int) -> None:
        now = int(time.time() * 1000)
        await self._add_waiter(keys=[self.keys.waiters(pool.name)], args=[waiter, deadline_ms, now, max(1, deadline_ms - now) + 60_000])

    async def _claim_cancel_safe(self, gpus: Sequence[str], holder: str, **kw: Any) -> Lease | None:
        """A claim whose result is not lost if the caller is cancelled while Redis runs
        it: a lease won at that moment is released before the cancellation goes on."""
        fut = asyncio.ensure_future(self.claim_any(gpus, holder, **kw))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                won = await fut
                if won is not None:
                    await self.release(won)
            raise

    async def wait_for_gpu(
        self,
        pool: Pool,
        holder: str,
        timeout: float,
        *,
        ttl_ms: int | None = None,
        job_id: str = "",
        fallback_interval_s: float | None = None,
        after_first_miss: Callable[[], Awaitable[Any]] | None = None,
    ) -> Lease | None:
        """Claim a free GPU of ``pool``, waiting up to ``timeout`` seconds; None on timeout.

        Order: join the keyevent feed (subscribed to ``del`` and ``expired``, confirmed
        by Redis) FIRST, then try to claim, then wait on the feed and try again on every
        event for one of the pool's lease keys (another waiter may win it). A release
        between the first claim and the wait is therefore already queued for us. Every
        ``fallback_interval_s`` (default 1 s) it re-checks all GPUs anyway, because
        pub/sub drops what a disconnected subscriber misses. ``after_first_miss`` is a
        test hook run after the first claim found every GPU busy.

        The waiters of one client share one pub/sub connection (see :class:`KeyeventFeed`);
        the last one to leave unsubscribes and closes it. A waiter whose first claim
        failed is listed in ``<waiters_prefix><pool>`` (scored by its deadline, Unix ms)
        until it returns. Timeout and cancellation remove it and its subscription.
        """
        if not self._notifications_ok:
            await self.check_notifications()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        fallback = self.fallback_interval_s if fallback_interval_s is None else fallback_interval_s
        waiter = f"{holder}:{uuid.uuid4().hex[:12]}"
        waiters_key = self.keys.waiters(pool.name)
        claim_kw = {"ttl_ms": ttl_ms, "job_id": job_id}
        queue: asyncio.Queue[Any] | None = None
        registered = False
        try:
            try:
                queue = await self._feed.join(set(pool.gpus), deadline)
            except TimeoutError:
                return None
            lease = await self._claim_cancel_safe(pool.gpus, holder, **claim_kw)
            if lease is not None:
                return lease
            # Listed only once it really waits (the feed is already joined, so the
            # order of these two does not matter for the race).
            await self._register_waiter(pool, waiter, int((time.time() + timeout) * 1000))
            registered = True
            if after_first_miss is not None:
                await after_first_miss()
            next_fallback = loop.time() + fallback
            while True:
                now = loop.time()
                if now >= deadline:
                    return None
                if now >= next_fallback:
                    lease = await self._claim_cancel_safe(pool.gpus, holder, via="fallback", **claim_kw)
                    if lease is not None:
                        return lease
                    next_fallback = loop.time() + fallback
                    continue
                try:
                    async with asyncio.timeout(min(deadline, next_fallback) - now):
                        event = await queue.get()
                except TimeoutError:
                    continue
                if event is RESUBSCRIBED:
                    # The feed was down: its events are lost. Re-check everything.
                    lease = await self._claim_cancel_safe(pool.gpus, holder, via="resubscribe", **claim_kw)
                else:
                    gpu, reason = event
                    lease = await self._claim_cancel_safe([gpu], holder, start=0, via=reason, **claim_kw)
                if lease is not None:
                    return lease
        finally:
            await self._cleanup_wait(queue, waiters_key, waiter if registered else None)

    async def _cleanup_wait(self, queue: asyncio.Queue[Any] | None, waiters_key: str, waiter: str | None) -> None:
        # Runs after a cancellation too; each step on its own so a broken connection
        # does not leave the other undone.
        if queue is not None:
            with contextlib.suppress(Exception):
                await self._feed.leave(queue)
        if waiter is not None:
            with contextlib.suppress(Exception):
                await self.redis.zrem(waiters_key, waiter)

    # ------------------------------------------------------------ pools

    async def pool_from_set(self, name: str, set_key: str) -> Pool:
        """A pool whose members are the GPU ids in the Redis set ``set_key``."""
        members = await self.redis.smembers(set_key)
        return Pool(name, sorted(text(m) for m in members))

    async def discover_gpus(self, *, limit: int = 10_000, count: int = 1000) -> list[str]:
        """GPU ids that have a lease right now, found by a SCAN that stops after
        ``limit`` keys. For seeding a pool set, not for the hot path."""
        found: list[str] = []
        async for key in self.redis.scan_iter(match=self.keys.lease_prefix + "*", count=count):
            gpu = self.keys.gpu_of(text(key))
            if gpu is not None:
                found.append(gpu)
            if len(found) >= limit:
                break
        return sorted(set(found))

    # ------------------------------------------------------------ reconcile

    async def reconcile(
        self,
        pool: Pool,
        ask_worker: Callable[[str], Awaitable[str | None]],
        *,
        grace_ms: int = 5_000,
        worker_timeout_s: float = 5.0,
        concurrency: int = 64,
    ) -> ReconcileReport:
        """Correct Redis from what the workers say they are doing: events for speed,
        reconciliation for correctness.

        ``ask_worker(gpu)`` returns the holder id or job id the GPU is running, or None
        when it is idle. For each GPU:

        - lease held, worker idle: the lease is deleted (only if it still holds the same
          holder: a claim made meanwhile is never touched), unless it is younger than
          ``grace_ms`` (a job that has been claimed but not started yet);
        - no lease, worker busy: reported in ``busy_without_lease`` (a batch job
          that never claimed its GPU); nothing is written, the scheduler decides;
        - lease held by someone other than what the worker runs: reported in ``mismatched``;
        - worker did not answer: reported in ``unreachable``, nothing changed.
        """
        report = ReconcileReport()
        sem = asyncio.Semaphore(concurrency)

        async def ask(gpu: str) -> tuple[str, str | None, str | None]:
            async with sem:
                try:
                    doing = await asyncio.wait_for(ask_worker(gpu), worker_timeout_s)
                    return gpu, doing, None
                except Exception as e:  # a worker's failure is data here, not a crash
                    return gpu, None, repr(e)

        answers = await asyncio.gather(*(ask(g) for g in pool.gpus))
        # Read the leases after the answers: a lease claimed while we asked is then seen.
        states = await self.read_many(pool.gpus)
        server_now = await server_ms(self.redis)
        for gpu, doing, error in answers:
            state = states[gpu]
            if error is not None:
                report.unreachable.append((gpu, error))
                continue
            if state is None:
                if doing:
                    report.busy_without_lease.append((gpu, doing))
                else:
                    report.consistent += 1
                continue
            if doing is None:
                if state.claimed_ms is not None and server_now - state.claimed_ms < grace_ms:
                    report.kept_young.append((gpu, state.holder))
                    continue
                deleted = await self._delete_if_holder(keys=[self.keys.lease(gpu), self.keys.info(gpu)], args=[state.holder])
                if deleted:
                    report.deleted.append((gpu, state.holder))
                    log.warning("reconcile: deleted lease on %s held by %s; the worker is idle", gpu, state.holder)
                continue
            if doing in (state.holder, state.job_id):
                report.consistent += 1
            else:
                report.mismatched.append((gpu, state.holder, doing))
        return report
