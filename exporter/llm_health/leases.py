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
  callers blocked in :meth:`LeaseClient.wait_for_gpu`, scored by their deadline (ms).

Waiting is event driven (keyspace notifications ``del`` and ``expired``), subscribe
first, then claim, then retry on every event: the order that cannot lose a release
(report 2). A slow fallback re-check covers pub/sub's fire-and-forget delivery.

Single Redis instance (or one primary): the scripts touch several keys, so in Redis
Cluster all of a pool's keys would need one hash tag, e.g. ``lease_prefix: "{gpu}:lease:"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_LEASE_PREFIX = "gpu:lease:"
DEFAULT_TTL_MS = 30_000
DEFAULT_FALLBACK_INTERVAL_S = 1.0

# What the waiters need from notify-keyspace-events: E (keyevent channels) plus
# g (generic commands: del) and x (expired), or A which includes g and x.
NEEDED_KEYSPACE_FLAGS = "Egx"

_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class LeaseKeys:
    """Key names of the lease schema. Only ``lease_prefix`` must match the schedulers
    already running; the others are derived from it unless given."""

    lease_prefix: str = DEFAULT_LEASE_PREFIX
    info_prefix: str | None = None
    fence_prefix: str | None = None
    waiters_prefix: str | None = None

    def __post_init__(self) -> None:
        if not self.lease_prefix:
            raise ValueError("lease_prefix must not be empty")
        if self.lease_prefix.endswith("lease:"):
            ns = self.lease_prefix[: -len("lease:")]
            derived = (ns + "leaseinfo:", ns + "fence:", ns + "waiters:")
        else:
            # "gpulease_" -> "gpuleaseinfo:"; a prefix without a separator at its end
            # ("lease") derives names that start with it and is rejected below.
            base = self.lease_prefix.rstrip(":_-/.")
            derived = (base + "info:", base + "fence:", base + "waiters:")
        for name, value in zip(("info_prefix", "fence_prefix", "waiters_prefix"), derived):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("info_prefix", "fence_prefix", "waiters_prefix"):
            value = getattr(self, name)
            if not value:
                raise ValueError(f"{name} must not be empty")
            if value.startswith(self.lease_prefix):
                raise ValueError(
                    f"{name} {value!r} starts with lease_prefix {self.lease_prefix!r}, so its "
                    f"keys would look like leases; set {name} explicitly "
                    f"(a lease_prefix ending in 'lease:' derives safe ones)"
                )

    def lease(self, gpu: str) -> str:
        return self.lease_prefix + gpu

    def info(self, gpu: str) -> str:
        return self.info_prefix + gpu  # type: ignore[operator]

    def fence(self, gpu: str) -> str:
        return self.fence_prefix + gpu  # type: ignore[operator]

    def waiters(self, pool: str) -> str:
        return self.waiters_prefix + pool  # type: ignore[operator]

    def gpu_of(self, key: str) -> str | None:
        """The GPU id of a lease key, None for any other key."""
        if key.startswith(self.lease_prefix):
            return key[len(self.lease_prefix):]
        return None


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
    (woken by that keyspace event), ``fallback`` (slow re-check) or ``resubscribe``."""

    gpu: str
    holder: str
    token: int
    ttl_ms: int
    claimed_ms: int
    job_id: str = ""
    via: str = "claim"


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


class LeaseLost(Exception):
    """The lease could not be renewed: someone else may hold the GPU now."""

    def __init__(self, lease: Lease, reason: str):
        self.lease, self.reason = lease, reason
        super().__init__(f"lease on {lease.gpu} (token {lease.token}) lost: {reason}")


class KeyspaceEventsOff(RuntimeError):
    """Redis does not publish the keyspace events the waiters need."""

    def __init__(self, current: str, command: str):
        self.current, self.command = current, command
        super().__init__(
            f"Redis notify-keyspace-events is {current!r}; waiting for a GPU needs "
            f"E (keyevent channel) with g (del) and x (expired), or A. Run: {command} "
            f"(it keeps the flags already set; put the same in redis.conf to survive a restart)"
        )


def required_keyspace_command(current: str) -> str | None:
    """The ``CONFIG SET`` that adds what is missing to ``current``, None if nothing is."""
    missing = ""
    if "E" not in current:
        missing += "E"
    if "A" not in current:
        missing += "".join(f for f in "gx" if f not in current)
    if not missing:
        return None
    return f"CONFIG SET notify-keyspace-events {current}{missing}"


def keyevent_channels(db: int) -> tuple[str, str]:
    return (f"__keyevent@{db}__:del", f"__keyevent@{db}__:expired")


def _without_retries(redis: aioredis.Redis) -> aioredis.Redis:
    """A client on the same server and settings as ``redis`` whose connections never
    retry: a pub/sub reader must see each disconnection to know events were lost."""
    pool = redis.connection_pool
    kwargs = {
        k: v
        for k, v in pool.connection_kwargs.items()
        if not k.startswith(("maint_notifications", "orig_")) and k != "himport_registry"
    }
    kwargs["retry"] = Retry(NoBackoff(), 0)
    return aioredis.Redis(connection_pool=type(pool)(connection_class=pool.connection_class, **kwargs))


def _db_of(redis: aioredis.Redis) -> int:
    return int(redis.connection_pool.connection_kwargs.get("db", 0) or 0)


def _s(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


# --------------------------------------------------------------------------- Lua

# KEYS: n lease keys, then n info keys, then n fence keys.
# ARGV: holder, ttl_ms, job_id, first index to try (0-based).
# Claims the first free GPU, trying from ARGV[4] round the list. The fencing token is
# INCR'd and the side hash written in the same script, so no reader ever sees a lease
# of ours without its token. Time comes from the Redis clock, the same for every claimer.
CLAIM_LUA = """
local n = #KEYS / 3
local start = tonumber(ARGV[4]) or 0
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
for i = 0, n - 1 do
  local j = ((i + start) % n) + 1
  if redis.call('SET', KEYS[j], ARGV[1], 'NX', 'PX', ARGV[2]) then
    local token = redis.call('INCR', KEYS[2 * n + j])
    redis.call('HSET', KEYS[n + j], 'holder', ARGV[1], 'token', token, 'job_id', ARGV[3],
               'claimed_ms', now, 'ttl_ms', ARGV[2])
    redis.call('PEXPIRE', KEYS[n + j], ARGV[2])
    return {j - 1, token, now}
  end
end
return false
"""

# KEYS: lease, info. ARGV: holder, token, ttl_ms. Extends both only for the holder of
# this very claim (same id AND same fencing token: a holder id reused by a later claim
# of the same worker does not count).
RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[2] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], 'ttl_ms', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""

# KEYS: lease, info. ARGV: holder, token.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""

# KEYS: lease, info. ARGV: token. 1 if the token is the one of the lease held now.
CHECK_FENCE_LUA = """
local holder = redis.call('GET', KEYS[1])
if not holder then return 0 end
if redis.call('HGET', KEYS[2], 'holder') ~= holder then return 0 end
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 0 end
return 1
"""

# KEYS: waiters zset. ARGV: waiter id, its deadline (Unix ms), now (Unix ms), TTL wanted.
# Drops the waiters whose deadline has passed (they died without their cleanup), lists
# this one, and only ever extends the key's TTL (a short waiter must not expire a long
# one's entry): nothing stays behind once every deadline has passed.
ADD_WAITER_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1
"""

# KEYS: lease, info. ARGV: holder expected. Deletes the lease only if it still holds
# that holder (reconcile must not delete a lease claimed since it looked).
DELETE_IF_HOLDER_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


# --------------------------------------------------------------------------- heartbeat


class Heartbeat:
    """Renews a lease every ``interval_s`` until stopped. When a renewal is refused, or
    no renewal could be confirmed within the TTL (Redis unreachable), the lease counts
    as lost: ``lost`` is set and ``on_lost`` is called (e.g. ``job_task.cancel``)."""

    def __init__(
        self,
        client: LeaseClient,
        lease: Lease,
        interval_s: float,
        on_lost: Callable[[], Any] | None = None,
    ):
        self.client, self.lease, self.interval_s, self.on_lost = client, lease, interval_s, on_lost
        self.lost = asyncio.Event()
        self.reason: str | None = None
        self.renewals = 0
        self.task = asyncio.create_task(self._run(), name=f"lease-heartbeat-{lease.gpu}")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # Renewals are sent before the TTL runs out; the lease is surely valid until
        # (time the last confirmed renewal was *sent*) + TTL.
        valid_until = loop.time() + self.lease.ttl_ms / 1000
        while True:
            await asyncio.sleep(self.interval_s)
            sent = loop.time()
            try:
                ok = await self.client.renew(self.lease)
            except _TRANSIENT + (RedisError,) as e:
                if loop.time() >= valid_until:
                    return self._lose(f"no renewal confirmed within the TTL ({e!r})")
                log.warning("lease %s: renewal failed, retrying: %r", self.lease.gpu, e)
                continue
            if not ok:
                return self._lose("renewal refused: the lease expired or another holder has it")
            self.renewals += 1
            valid_until = sent + self.lease.ttl_ms / 1000

    def _lose(self, reason: str) -> None:
        self.reason = reason
        self.lost.set()
        log.warning("lease on %s lost: %s", self.lease.gpu, reason)
        if self.on_lost is not None:
            self.on_lost()

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


# --------------------------------------------------------------------------- reconcile


@dataclass
class ReconcileReport:
    """What :meth:`LeaseClient.reconcile` found and changed (lists of GPU ids with detail)."""

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


# --------------------------------------------------------------------------- keyevent feed

RESUBSCRIBED = object()  # queued to every waiter after the feed was lost and re-made
FEED_IDLE_PING_S = 15.0  # a feed silent this long sends itself a message; none back in as long: broken


async def subscribe_confirmed(pubsub: Any, channels: Sequence[str], deadline: float) -> None:
    """SUBSCRIBE and wait until Redis confirms every channel: only from then on are
    events guaranteed to reach us, so only then may a waiter try its first claim."""
    await pubsub.subscribe(*channels)
    loop = asyncio.get_running_loop()
    confirmed = 0
    while confirmed < len(channels):
        left = deadline - loop.time()
        if left <= 0:
            raise TimeoutError("keyevent subscription not confirmed before the deadline")
        msg = await pubsub.get_message(timeout=left)
        if msg is not None and msg.get("type") == "subscribe":
            confirmed += 1


class KeyeventFeed:
    """One pub/sub connection, subscribed to the ``del`` and ``expired`` keyevent
    channels while at least one waiter of the client is waiting.

    Each lease event goes, as ``(gpu, reason)``, to ONE local waiter whose pool has that
    GPU: the longest-waiting one with nothing queued, else the longest-waiting one. One
    claim per process per release is enough: if it fails, another process holds the GPU
    and no other local waiter could have won it. Waking every local waiter instead
    would send N claims per release (a thundering herd). A waiter that leaves with
    events still queued hands them on. If the connection breaks it is made again and
    every waiter gets RESUBSCRIBED (then all re-check: events were lost)."""

    def __init__(self, redis: aioredis.Redis, keys: LeaseKeys, db: int, reconnect_max_s: float = 1.0):
        self.redis, self.keys = redis, keys
        # The feed must SEE every broken connection (its events are lost then): redis-py's
        # retries would reconnect and resubscribe behind our back, so none on this one.
        self._sub_redis = _without_retries(redis)
        # The keyevent channels, and one of our own for liveness checks.
        self.liveness_channel = f"llm-health:feed:{uuid.uuid4().hex}"
        self.channels = (*keyevent_channels(db), self.liveness_channel)
        self.reconnect_max_s = reconnect_max_s
        self.waiters: dict[asyncio.Queue[Any], set[str]] = {}
        self._pubsub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._live = asyncio.Event()
        self._lock = asyncio.Lock()

    async def join(self, gpus: set[str], deadline: float) -> asyncio.Queue[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.waiters[queue] = gpus
        try:
            async with self._lock:
                if self._task is None or self._task.done():
                    await self._open(deadline)
            left = deadline - asyncio.get_running_loop().time()
            async with asyncio.timeout(max(left, 0.001)):
                await self._live.wait()  # the feed may be re-subscribing after a break
        except BaseException:
            await self.leave(queue)
            raise
        return queue

    async def leave(self, queue: asyncio.Queue[Any]) -> None:
        self.waiters.pop(queue, None)
        while not queue.empty():  # events it did not get to: hand them on
            event = queue.get_nowait()
            if event is not RESUBSCRIBED:
                self._dispatch(*event)
        if self.waiters:
            return
        async with self._lock:
            if self.waiters:  # someone joined meanwhile: keep the feed
                return
            task, pubsub = self._task, self._pubsub
            self._task = self._pubsub = None
            self._live.clear()
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await self._close(pubsub)

    @staticmethod
    async def _close(pubsub: Any) -> None:
        if pubsub is None:
            return
        with contextlib.suppress(Exception):
            await pubsub.unsubscribe()
        with contextlib.suppress(Exception):
            await pubsub.aclose()

    async def aclose(self) -> None:
        await self._sub_redis.aclose()

    async def _open(self, deadline: float) -> None:
        pubsub = self._sub_redis.pubsub()
        try:
            await subscribe_confirmed(pubsub, self.channels, deadline)
        except BaseException:
            await self._close(pubsub)
            raise
        self._pubsub = pubsub
        self._live.set()
        self._task = asyncio.create_task(self._read(), name="lease-keyevent-feed")

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.05
        awaiting_pong = False
        while True:
            try:
                msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=FEED_IDLE_PING_S)
                if msg is None:
                    # Silence: a dead peer without a reset would block us forever. Send
                    # ourselves a message; if it does not come back, the feed is broken.
                    if awaiting_pong:
                        raise TimeoutError("keyevent feed: our own liveness message did not come back")
                    await self.redis.publish(self.liveness_channel, "1")
                    awaiting_pong = True
                    continue
                awaiting_pong = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the connection broke: its events are lost
                log.warning("lease keyevent feed lost (%r); resubscribing", e)
                self._live.clear()
                while True:
                    await self._close(self._pubsub)
                    self._pubsub = None
                    if not self.waiters:
                        return
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.reconnect_max_s)
                    pubsub = self._sub_redis.pubsub()
                    try:
                        await subscribe_confirmed(pubsub, self.channels, loop.time() + 5.0)
                    except asyncio.CancelledError:
                        await self._close(pubsub)
                        raise
                    except Exception:
                        await self._close(pubsub)
                        continue
                    self._pubsub = pubsub
                    self._live.set()
                    backoff = 0.05
                    awaiting_pong = False
                    for queue in list(self.waiters):
                        queue.put_nowait(RESUBSCRIBED)
                    break
                continue
            if msg is None or msg.get("type") != "message":
                continue
            gpu = self.keys.gpu_of(_s(msg["data"]))
            if gpu is None:
                continue
            self._dispatch(gpu, _s(msg["channel"]).rsplit(":", 1)[-1])

    def _dispatch(self, gpu: str, reason: str) -> None:
        fallback: asyncio.Queue[Any] | None = None
        for queue, gpus in self.waiters.items():  # in join order: longest waiting first
            if gpu in gpus:
                if queue.empty():
                    queue.put_nowait((gpu, reason))
                    return
                if fallback is None:
                    fallback = queue
        if fallback is not None:
            fallback.put_nowait((gpu, reason))


# --------------------------------------------------------------------------- client


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
        self.db = _db_of(redis)
        self._claim = redis.register_script(CLAIM_LUA)
        self._renew = redis.register_script(RENEW_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._check_fence = redis.register_script(CHECK_FENCE_LUA)
        self._delete_if_holder = redis.register_script(DELETE_IF_HOLDER_LUA)
        self._add_waiter = redis.register_script(ADD_WAITER_LUA)
        self._notifications_ok = False
        self._feed = KeyeventFeed(redis, self.keys, self.db)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> LeaseClient:
        return cls(aioredis.Redis.from_url(url, decode_responses=True), **kwargs)

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
        keys = (
            [self.keys.lease(g) for g in gpus]
            + [self.keys.info(g) for g in gpus]
            + [self.keys.fence(g) for g in gpus]
        )
        got = await self._claim(keys=keys, args=[holder, ttl, job_id, start])
        if not got:
            return None
        index, token, now = int(got[0]), int(got[1]), int(got[2])
        return Lease(gpus[index], holder, token, ttl, now, job_id, via)

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
        ok = await self._check_fence(
            keys=[self.keys.lease(gpu), self.keys.info(gpu)], args=[int(token)]
        )
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
        return Heartbeat(self, lease, interval_s or lease.ttl_ms / 3000, on_lost)

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
                with contextlib.suppress(*_TRANSIENT, RedisError):
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
        flags = _s(next(iter(reply.values()), "")) if reply else ""
        command = required_keyspace_command(flags)
        if command:
            raise KeyspaceEventsOff(flags, command)
        self._notifications_ok = True
        return flags

    # ------------------------------------------------------------ waiting

    async def _register_waiter(self, pool: Pool, waiter: str, deadline_ms: int) -> None:
        now = int(time.time() * 1000)
        await self._add_waiter(
            keys=[self.keys.waiters(pool.name)], args=[waiter, deadline_ms, now, max(1, deadline_ms - now) + 60_000]
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
        return Pool(name, sorted(_s(m) for m in members))

    async def discover_gpus(self, *, limit: int = 10_000, count: int = 1000) -> list[str]:
        """GPU ids that have a lease right now, found by a SCAN that stops after
        ``limit`` keys. For seeding a pool set, not for the hot path."""
        found: list[str] = []
        async for key in self.redis.scan_iter(match=self.keys.lease_prefix + "*", count=count):
            gpu = self.keys.gpu_of(_s(key))
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
        """Correct Redis from what the workers say they are doing (report 2: events for
        speed, reconciliation for correctness).

        ``ask_worker(gpu)`` returns the holder id or job id the GPU is running, or None
        when it is idle. For each GPU:

        - lease held, worker idle: the lease is deleted (only if it still holds the same
          holder: a claim made meanwhile is never touched), unless it is younger than
          ``grace_ms`` (a job that has been claimed but not started yet);
        - no lease, worker busy: reported in ``busy_without_lease`` (report 1's batch job
          that never set its busy flag); nothing is written, the scheduler decides;
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
        server_now = await self._server_ms()
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
                deleted = await self._delete_if_holder(
                    keys=[self.keys.lease(gpu), self.keys.info(gpu)], args=[state.holder]
                )
                if deleted:
                    report.deleted.append((gpu, state.holder))
                    log.warning("reconcile: deleted lease on %s held by %s; the worker is idle", gpu, state.holder)
                continue
            if doing in (state.holder, state.job_id):
                report.consistent += 1
            else:
                report.mismatched.append((gpu, state.holder, doing))
        return report

    async def _server_ms(self) -> int:
        sec, usec = await self.redis.time()
        return int(sec) * 1000 + int(usec) // 1000


def parse_lease(gpu: str, value: Any, pttl: Any, info: Sequence[Any]) -> LeaseState | None:
    """Build a :class:`LeaseState` from GET, PTTL and HMGET(holder, token, claimed_ms,
    job_id). The side hash only counts when its holder is the lease's holder: an
    old-style scheduler's lease has no hash, or a leftover one of someone else."""
    if value is None:
        return None
    holder = _s(value)
    ttl = int(pttl) if pttl is not None else -2
    ttl_ms = ttl if ttl >= 0 else None
    info_holder, token, claimed, job = (_s(x) for x in info) if info else (None,) * 4
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


# ARGV: lease prefix, info prefix, then the GPU ids of one chunk joined by newlines.
# Returns, for each HELD lease only, six fields: index (1-based), holder, PTTL, info
# holder, token, claimed_ms ('' if absent). It reads only the keys it is given (never
# SCAN). The ids travel as one string because encoding 20,000 separate arguments per
# refresh was most of the exporter's cost; the keys are therefore not declared, which is
# fine on one Redis (in Cluster, give the pool's keys one hash tag). One script per
# chunk of READ_CHUNK GPUs keeps each one short (Redis runs scripts one at a time),
# and a pipeline of chunks costs one round trip however large the pool.
READ_LEASES_LUA = """
local out = {}
local i = 0
for gpu in string.gmatch(ARGV[3], '[^\\n]+') do
  i = i + 1
  local key = ARGV[1] .. gpu
  local v = redis.call('GET', key)
  if v then
    local info = redis.call('HMGET', ARGV[2] .. gpu, 'holder', 'token', 'claimed_ms')
    out[#out + 1] = i
    out[#out + 1] = v
    out[#out + 1] = redis.call('PTTL', key)
    out[#out + 1] = info[1] or ''
    out[#out + 1] = info[2] or ''
    out[#out + 1] = info[3] or ''
  end
end
return out
"""
READ_CHUNK = 500


def read_leases_chunks(gpus: Sequence[str]) -> list[tuple[Sequence[str], str]]:
    """The GPUs in chunks, each with its ids joined for READ_LEASES_LUA."""
    out = []
    for i in range(0, len(gpus), READ_CHUNK):
        chunk = gpus[i: i + READ_CHUNK]
        out.append((chunk, "\n".join(chunk)))
    return out


def add_read_leases(pipe: Any, keys: LeaseKeys, joined: str) -> None:
    """Queue the read of one chunk of GPUs (see READ_LEASES_LUA) on a pipeline."""
    pipe.eval(READ_LEASES_LUA, 0, keys.lease_prefix, keys.info_prefix, joined)


def parse_read_leases(chunk: Sequence[str], reply: Sequence[Any]) -> dict[str, LeaseState]:
    """The held leases of one chunk, by GPU id."""
    out: dict[str, LeaseState] = {}
    if reply and isinstance(reply[1], bytes):
        reply = [_s(x) for x in reply]
    for j in range(0, len(reply), 6):
        gpu = chunk[int(reply[j]) - 1]
        holder, pttl, info_holder, token, claimed = reply[j + 1: j + 6]
        ttl_ms = int(pttl) if int(pttl) >= 0 else None
        if info_holder != holder:  # old-style lease, or a leftover side hash of someone else
            out[gpu] = LeaseState(gpu, holder, ttl_ms)
        else:
            out[gpu] = LeaseState(gpu, holder, ttl_ms, int(token) if token else None, int(claimed) if claimed else None)
    return out
