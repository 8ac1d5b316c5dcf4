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

from .codes import LeaseArgumentError
from .connection import text
from .deployment import Deployment, connect, wrap
from .errors import ERRORS, NotReplicated, retryable, suppress_retryable
from .feed import FEED_LINGER_S, RESUBSCRIBED, KeyeventFeed, required_keyspace_command
from .heartbeat import Heartbeat
from .keys import LeaseKeys
from .lease_reconcile import reconcile
from .lease_scripts import ADD_WAITER_LUA, CHECK_FENCE_LUA, CLAIM_LUA, RELEASE_LUA, RENEW_LUA
from .records import KeyspaceEventsOff, Lease, LeaseLost, LeaseState, Pool, ReconcileReport, parse_lease
from .target import TargetError

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TTL_MS = 30_000
DEFAULT_FALLBACK_INTERVAL_S = 1.0
NOT_REPLICATED_RETRY_S = 0.1  # a waiter whose claim failed retryably (store.errors.retryable: NOREPLICAS, ...) tries again this soon


class LeaseTargetError(LeaseArgumentError, TargetError):
    """A Redis URL `LeaseClient.from_url` cannot use: the message names the part that is
    wrong (never the password), as `store.target.TargetError`'s does."""


class LeaseClient:
    """Lease operations on one Redis database: one server, Sentinel or Cluster.

    Give it a :class:`~llm_health.store.deployment.Deployment` (``from_url`` makes one
    from any Redis URL), or a redis-py ``Redis`` or ``RedisCluster`` client, created with
    ``decode_responses=True`` or not; both work. On Cluster the keys take the Cluster
    layout (``gpu:lease:{gpu0}``, docs/redis-schema.md).
    """

    def __init__(
        self,
        redis: Any,
        *,
        keys: LeaseKeys | None = None,
        ttl_ms: int = DEFAULT_TTL_MS,
        fallback_interval_s: float = DEFAULT_FALLBACK_INTERVAL_S,
        feed_linger_s: float = FEED_LINGER_S,
    ):
        if ttl_ms <= 0:
            raise LeaseArgumentError(f"ttl_ms must be positive, not {ttl_ms}")
        self.deployment = redis if isinstance(redis, Deployment) else wrap(redis)
        self.redis = self.deployment.client
        self.keys = self.deployment.lease_keys(keys)
        self.ttl_ms = ttl_ms
        self.fallback_interval_s = fallback_interval_s
        self.db = self.deployment.db
        self._notifications_ok = False
        self._feed = KeyeventFeed(self.deployment, self.keys, linger_s=feed_linger_s)
        self.not_replicated = 0  # claims and renewals undone because no replica had them

    @classmethod
    def from_url(cls, url: str, *, socket_timeout: float = 5.0, **kwargs: Any) -> LeaseClient:
        """A client with read and connect timeouts on its connections: a black-holed
        connection fails a call instead of blocking it (the heartbeat also bounds each
        renewal by the lease's validity). ``url``: any form of `store.target`; one it
        cannot use raises `LeaseTargetError`, a `LeaseError` and a `TargetError` both."""
        try:
            deployment = connect(url, socket_timeout=socket_timeout)
        except TargetError as e:
            raise LeaseTargetError(str(e)) from None
        return cls(deployment, **kwargs)

    async def aclose(self) -> None:
        await self._feed.aclose()
        await self.deployment.aclose()

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
        unlist: tuple[str, str] | None = None,
    ) -> Lease | None:
        """Claim the first free GPU of ``gpus`` in one round trip (one Lua script), from index
        ``start`` (random by default); ``unlist`` (wait_for_gpu's waiters key and waiter,
        not on Cluster): a winning claim also takes the waiter off the list."""
        if not gpus:
            return None
        ttl = int(ttl_ms or self.ttl_ms)
        if start is None:
            start = random.randrange(len(gpus))
        sent = time.monotonic()  # the lease is surely valid until sent + TTL (heartbeat)
        if not self.deployment.one_keyspace:  # Cluster: each GPU's keys in a slot of their own
            got = await self._claim_cluster(gpus, holder, ttl, job_id, start)
        else:
            keys = [self.keys.lease(g) for g in gpus] + [self.keys.info(g) for g in gpus] + [self.keys.fence(g) for g in gpus]
            args: list[Any] = [holder, ttl, job_id, start]
            if unlist is not None:
                keys.append(unlist[0])
                args.append(unlist[1])
            got = await self._claim_script(keys, args)
        if not got:
            return None
        index, token, now = int(got[0]), int(got[1]), int(got[2])
        if not self.deployment.one_keyspace:
            index, _ = got[3]
        return Lease(gpus[index], holder, token, ttl, now, job_id, via, sent_at=sent)

    async def _claim_script(self, keys: list[str], args: list[Any]) -> Any:
        """The claim script, counted only once a replica has it (Deployment.wait_replicas):
        a claim the primary applied but no replica acknowledged is released again and
        reported as NotReplicated, never returned. A claim whose reply was lost is safe
        to send again: the script gives a holder the lease it already has."""
        try:
            return await self.deployment.script(CLAIM_LUA, keys, args)
        except NotReplicated as e:
            self.not_replicated += 1
            got = e.replies[0] if e.replies else None
            if got:
                n = len(keys) // 3
                j = int(got[0])
                with contextlib.suppress(*ERRORS):
                    await self.deployment.script(RELEASE_LUA, [keys[j], keys[n + j]], [args[0], int(got[1])], confirm=False)
            raise

    async def _claim_cluster(self, gpus: Sequence[str], holder: str, ttl: int, job_id: str, start: int) -> Any:
        """Cluster: each GPU's keys are in its own slot, so "the first free GPU of N" is
        one script per GPU, tried in order from ``start``: first the GPUs this holder
        already holds (the idempotent retry), then those a pipelined read found free,
        then the rest (freed since the read)."""
        order = [gpus[(i + start) % len(gpus)] for i in range(len(gpus))]
        if len(order) == 1:  # the script alone gives a holder its own lease back: no read
            holders: list[Any] = [None]
        else:
            pipe = self.redis.pipeline(transaction=False)
            for g in order:
                pipe.get(self.keys.lease(g))
            holders = [text(h) for h in await pipe.execute()]
        mine = [g for g, h in zip(order, holders) if h == holder]
        free = [g for g, h in zip(order, holders) if h is None]
        rest = [g for g in order if g not in mine and g not in free]
        for g in (*mine, *free, *rest):
            got = await self._claim_script([self.keys.lease(g), self.keys.info(g), self.keys.fence(g)], [holder, ttl, job_id, 0])
            if got:
                return [*got, (gpus.index(g), g)]
        return None

    async def renew(self, lease: Lease, ttl_ms: int | None = None) -> bool:
        """Extend the lease; refused (False) unless this claim still holds it. A renewal
        no replica acknowledged raises NotReplicated (the heartbeat retries it)."""
        ttl = int(ttl_ms or lease.ttl_ms)
        try:
            ok = await self.deployment.script(RENEW_LUA, [self.keys.lease(lease.gpu), self.keys.info(lease.gpu)], [lease.holder, lease.token, ttl])
        except NotReplicated:
            self.not_replicated += 1
            raise
        return bool(ok)

    async def release(self, lease: Lease) -> bool:
        """Delete the lease; refused (False) unless this claim still holds it."""
        ok = await self.deployment.script(RELEASE_LUA, [self.keys.lease(lease.gpu), self.keys.info(lease.gpu)], [lease.holder, lease.token], confirm=False)
        return bool(ok)

    async def check_fence(self, gpu: str, token: int) -> bool:
        """For the GPU worker: True only if ``token`` is the fencing token of the lease
        held on ``gpu`` right now. A holder whose lease expired (and was perhaps claimed
        again, with a larger token) is refused. Workers that also remember the largest
        token they have served can refuse older ones without asking Redis."""
        ok = await self.deployment.script(CHECK_FENCE_LUA, [self.keys.lease(gpu), self.keys.info(gpu)], [int(token)], confirm=False)
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
                with contextlib.suppress(*ERRORS):
                    await self.release(lease)

    # ------------------------------------------------------------ keyspace events

    async def check_notifications(self) -> str:
        """Verify that Redis publishes ``del`` and ``expired`` keyevents; return the
        flags. Raises :class:`KeyspaceEventsOff` naming the exact ``CONFIG SET`` to run.
        Where CONFIG is disabled (managed Redis) it cannot check: it logs and returns ''."""
        found = await self.deployment.config_get("notify-keyspace-events")
        if not found:
            log.warning("cannot read notify-keyspace-events (CONFIG refused); make sure it includes Egx on every primary")
            return ""
        for where, flags in found.items():
            command = required_keyspace_command(flags)
            if command:
                raise KeyspaceEventsOff(flags, command, where if len(found) > 1 else None)
        self._notifications_ok = True
        return next(iter(found.values()))

    # ------------------------------------------------------------ waiting

    async def _register_waiter(self, pool: Pool, waiter: str, deadline_ms: int) -> None:
        now = int(time.time() * 1000)
        await self.deployment.script(
            ADD_WAITER_LUA, [self.keys.waiters(pool.name)], [waiter, deadline_ms, now, max(1, deadline_ms - now) + 60_000], confirm=False
        )

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

        The waiters of one client share one pub/sub connection (:class:`KeyeventFeed`),
        subscribed until ``feed_linger_s`` (10 s) after the last one left. A waiter whose
        first claim failed is listed in ``<waiters_prefix><pool>`` (scored by its deadline,
        Unix ms) until it returns (the winning claim takes it off, but on Cluster)."""
        if not self._notifications_ok:
            await self.check_notifications()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        fallback = self.fallback_interval_s if fallback_interval_s is None else fallback_interval_s
        waiter = f"{holder}:{uuid.uuid4().hex[:12]}"
        waiters_key = self.keys.waiters(pool.name)
        claim_kw: dict[str, Any] = {"ttl_ms": ttl_ms, "job_id": job_id}
        queue: asyncio.Queue[Any] | None = None
        registered = False
        try:
            try:
                queue = await self._feed.join(set(pool.gpus), deadline)
            except TimeoutError:
                # The feed never came up in time (a primary failing over): still look once,
                # so no waiter times out beside a free GPU.
                with suppress_retryable():
                    return await self._claim_cancel_safe(pool.gpus, holder, via="deadline", **claim_kw)
                return None
            try:
                lease = await self._claim_cancel_safe(pool.gpus, holder, **claim_kw)
            except Exception as e:
                if not retryable(e):
                    raise
                log.warning("claim for %s failed, again in %.1fs: %r", holder, NOT_REPLICATED_RETRY_S, e)
                lease, first_not_replicated = None, True
            else:
                first_not_replicated = False
            if lease is not None:
                return lease
            # Listed only once it really waits (the feed is already joined, so the
            # order of these two does not matter for the race).
            with suppress_retryable():  # the list is for observers; waiting goes on
                await self._register_waiter(pool, waiter, int((time.time() + timeout) * 1000))
                registered = True
            if registered and self.deployment.one_keyspace:  # the list shares the claim's slot
                claim_kw["unlist"] = (waiters_key, waiter)

            async def claim(gpus: Sequence[str], **kw: Any) -> Lease | None:
                # (A claim undone as NotReplicated leaves the waiter off the list until it returns.)
                nonlocal registered
                won = await self._claim_cancel_safe(gpus, holder, **kw, **claim_kw)
                registered = registered and (won is None or "unlist" not in claim_kw)
                return won

            if after_first_miss is not None:
                await after_first_miss()
            next_fallback = loop.time() + (min(fallback, NOT_REPLICATED_RETRY_S) if first_not_replicated else fallback)
            while True:
                now = loop.time()
                if now >= deadline:
                    # One last look: a release whose event was lost in the last fallback
                    # interval must not let us time out beside a free GPU.
                    with suppress_retryable():
                        return await claim(pool.gpus, via="deadline")
                    return None
                if now >= next_fallback:
                    try:
                        lease = await claim(pool.gpus, via="fallback")
                    except Exception as e:
                        if not retryable(e):
                            raise
                        log.warning("claim for %s failed, again in %.1fs: %r", holder, NOT_REPLICATED_RETRY_S, e)
                        lease, next_fallback = None, loop.time() + min(fallback, NOT_REPLICATED_RETRY_S)
                    else:
                        next_fallback = loop.time() + fallback
                    if lease is not None:
                        return lease
                    continue
                try:
                    async with asyncio.timeout(min(deadline, next_fallback) - now):
                        event = await queue.get()
                except TimeoutError:
                    continue
                try:
                    if event is RESUBSCRIBED:
                        # The feed was down: its events are lost. Re-check everything.
                        lease = await claim(pool.gpus, via="resubscribe")
                    else:
                        gpu, reason = event
                        lease = await claim([gpu], start=0, via=reason)
                except Exception as e:  # undone, or not sent: try all again soon (a failover settling)
                    if not retryable(e):
                        raise
                    log.warning("claim for %s failed, again in %.1fs: %r", holder, NOT_REPLICATED_RETRY_S, e)
                    next_fallback = min(next_fallback, loop.time() + NOT_REPLICATED_RETRY_S)
                    continue
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
        async for key in self.redis.scan_iter(match=self.keys.lease_prefix + "*", count=count):  # every primary on Cluster
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
        return await reconcile(
            self.read_many, self.deployment, self.keys, pool, ask_worker, grace_ms=grace_ms, worker_timeout_s=worker_timeout_s, concurrency=concurrency
        )
