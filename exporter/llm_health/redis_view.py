"""The exporter's Redis collector: GPU pools (leases) and admission routes (queue).

Emits (labels ``pool`` and ``route`` come from configuration, never from keys):

- ``llm_redis_up``: 1 if the last refresh read Redis, else 0 (then only the counters
  below are exported besides it);
- per pool: ``llm_gpu_pool_size``, ``llm_gpu_leases_held``, ``llm_gpu_free``,
  ``llm_gpu_waiters``, ``llm_gpu_lease_ttl_min_seconds`` and
  ``llm_gpu_lease_age_max_seconds`` (absent while no lease is held),
  ``llm_gpu_lease_releases_total{reason="del"|"expired"}`` (counted from keyspace events
  by a background subscriber; after a disconnection the missed ones are counted by
  comparing the leases held before and after the gap),
  ``llm_gpu_lease_drift{kind="lease_on_idle_backend"|"busy_without_lease"}``;
- per route: ``llm_admission_queue_depth``, ``llm_admission_queue_age_seconds`` (0 when
  empty), ``llm_admission_deadline_slack_seconds`` (absent when empty),
  ``llm_admission_past_deadline``, ``llm_admission_retried_requests``,
  ``llm_admission_token_duplication_ratio_max`` (absent until an id has token units).

``refresh()`` does all the I/O, once per exporter round, in a constant number of
pipelined round trips (1, or 2 when pools or routes come from Redis sets), whatever
the pool sizes and queue lengths: GET/PTTL/HMGET of the known lease keys (a short
read-only script per 500 GPUs, so the client sends 20 commands rather than 30,000 for
10,000 GPUs), O(log n) sorted-set reads per route, never KEYS. ``collect()`` only
renders the last snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from .errors import ConfigError
from .leases import (
    DEFAULT_LEASE_PREFIX,
    LeaseKeys,
    add_read_leases,
    keyevent_channels,
    parse_read_leases,
    read_leases_chunks,
    required_keyspace_command,
)
from .queue import (
    DEFAULT_QUEUE_PREFIX,
    DEFAULT_RETENTION_MS,
    GC_LUA,
    ROUTE_STATS_COMMANDS,
    QueueKeys,
    add_route_stats_commands,
    now_ms,
    parse_route_stats,
)

log = logging.getLogger(__name__)

# Engine health states that mean "work is in flight on this backend".
BUSY_STATES = frozenset({"busy", "stalled", "hung", "unknown"})
IDLE_STATE = "idle"
RELEASE_REASONS = ("del", "expired")
DRIFT_KINDS = ("lease_on_idle_backend", "busy_without_lease")
STATUS_LIST_CAP = 50  # GPU ids listed per drift kind in /status
FEED_IDLE_PING_S = 15.0  # the keyevent subscriber checks itself after this long without traffic


# ============================================================================ config


@dataclass(frozen=True)
class PoolConfig:
    """A GPU pool: fixed ``gpus``, the members of the Redis set ``set_key``, or
    (``discover``) the GPUs a bounded SCAN finds leased. ``backends`` maps a GPU id to
    the backend name of the exporter's config, for drift."""

    name: str
    gpus: tuple[str, ...] = ()
    set_key: str | None = None
    discover: bool = False
    backends: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    lease_keys: LeaseKeys = field(default_factory=LeaseKeys)
    queue_prefix: str = DEFAULT_QUEUE_PREFIX
    queue_retention_ms: int = DEFAULT_RETENTION_MS
    pools: tuple[PoolConfig, ...] = ()
    routes: tuple[str, ...] | None = None  # None: the queue's routes set
    routes_set_key: str | None = None
    timeout_s: float = 2.0
    reconnect_max_s: float = 5.0
    queue_gc: bool = True
    discover_max_keys: int = 10_000
    discover_interval_s: float = 300.0

    @property
    def queue_keys(self) -> QueueKeys:
        return QueueKeys(self.queue_prefix)

    @property
    def routes_key(self) -> str:
        return self.routes_set_key or self.queue_keys.routes()


_TOP_KEYS = {
    "url", "lease_prefix", "info_prefix", "fence_prefix", "waiters_prefix", "queue_prefix",
    "queue_retention_ms", "pools", "routes", "routes_set_key", "timeout_s",
    "reconnect_max_s", "queue_gc", "discover_max_keys", "discover_interval_s",
}
_POOL_KEYS = {"name", "gpus", "set_key", "discover", "backends"}


def _str(where: str, key: str, value: Any, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty_ok):
        raise ConfigError(where, key, f"must be a non-empty string, got {value!r}")
    return value


def _positive(where: str, key: str, value: Any, kind: type = float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(where, key, f"must be a positive number, got {value!r}")
    if kind is int and int(value) != value:
        raise ConfigError(where, key, f"must be a whole number, got {value!r}")
    return kind(value)


def _unique_strings(where: str, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(where, key, f"must be a non-empty list of strings, got {value!r}")
    seen: list[str] = []
    for i, item in enumerate(value):
        item = _str(where, f"{key}[{i}]", item)
        if item in seen:
            raise ConfigError(where, f"{key}[{i}]", f"{item!r} is listed twice")
        seen.append(item)
    return tuple(seen)


def parse_redis_config(section: Any, where: str) -> RedisConfig:
    """Parse the ``redis:`` section of the YAML config. Raises :class:`ConfigError`
    naming the key (``redis.pools[1].gpus`` ...). Shape::

        redis:
          url: redis://127.0.0.1:6379/0
          lease_prefix: "gpu:lease:"          # what the schedulers already use
          pools:
            - {name: a100, gpus: [gpu0, gpu1], backends: {gpu0: vllm-a}}
            - {name: x, set_key: "gpu:pool:x"}
          routes: [chat, batch]               # or omitted: the queue's routes set
    """
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(where, "redis", f"must be a mapping, got {type(section).__name__}")
    for key in section:
        if key not in _TOP_KEYS:
            raise ConfigError(where, f"redis.{key}", f"unknown key; expected one of {', '.join(sorted(_TOP_KEYS))}")
    kw: dict[str, Any] = {}
    if "url" in section:
        url = _str(where, "redis.url", section["url"])
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(where, "redis.url", f"must start with redis://, rediss:// or unix://, got {url!r}")
        kw["url"] = url
    try:
        kw["lease_keys"] = LeaseKeys(
            _str(where, "redis.lease_prefix", section.get("lease_prefix", DEFAULT_LEASE_PREFIX)),
            *(
                _str(where, f"redis.{k}", section[k]) if k in section else None
                for k in ("info_prefix", "fence_prefix", "waiters_prefix")
            ),
        )
    except ValueError as e:
        raise ConfigError(where, "redis.lease_prefix", str(e)) from None
    if "queue_prefix" in section:
        kw["queue_prefix"] = _str(where, "redis.queue_prefix", section["queue_prefix"])
    for key, kind in (
        ("queue_retention_ms", int), ("timeout_s", float), ("reconnect_max_s", float),
        ("discover_max_keys", int), ("discover_interval_s", float),
    ):
        if key in section:
            kw[key] = _positive(where, f"redis.{key}", section[key], kind)
    if "queue_gc" in section:
        if not isinstance(section["queue_gc"], bool):
            raise ConfigError(where, "redis.queue_gc", f"must be true or false, got {section['queue_gc']!r}")
        kw["queue_gc"] = section["queue_gc"]
    if "routes" in section:
        kw["routes"] = _unique_strings(where, "redis.routes", section["routes"])
    if "routes_set_key" in section:
        if "routes" in section:
            raise ConfigError(where, "redis.routes_set_key", "give either routes or routes_set_key, not both")
        kw["routes_set_key"] = _str(where, "redis.routes_set_key", section["routes_set_key"])
    kw["pools"] = _parse_pools(section.get("pools", []), where)
    return RedisConfig(**kw)


def _parse_pools(value: Any, where: str) -> tuple[PoolConfig, ...]:
    if not isinstance(value, list):
        raise ConfigError(where, "redis.pools", f"must be a list of pools, got {type(value).__name__}")
    pools: list[PoolConfig] = []
    for i, spec in enumerate(value):
        at = f"redis.pools[{i}]"
        if not isinstance(spec, dict):
            raise ConfigError(where, at, f"must be a mapping, got {type(spec).__name__}")
        for key in spec:
            if key not in _POOL_KEYS:
                raise ConfigError(where, f"{at}.{key}", f"unknown key; expected one of {', '.join(sorted(_POOL_KEYS))}")
        if "name" not in spec:
            raise ConfigError(where, f"{at}.name", "missing")
        name = _str(where, f"{at}.name", spec["name"])
        if any(p.name == name for p in pools):
            raise ConfigError(where, f"{at}.name", f"pool {name!r} is defined twice")
        sources = [k for k in ("gpus", "set_key", "discover") if k in spec]
        if len(sources) != 1:
            raise ConfigError(where, at, f"needs exactly one of gpus, set_key, discover; got {sources or 'none'}")
        gpus: tuple[str, ...] = ()
        set_key = None
        discover = False
        if "gpus" in spec:
            gpus = _unique_strings(where, f"{at}.gpus", spec["gpus"])
            for i, gpu in enumerate(gpus):
                if any(c.isspace() for c in gpu):
                    raise ConfigError(where, f"{at}.gpus[{i}]", f"GPU id {gpu!r} contains whitespace")
        elif "set_key" in spec:
            set_key = _str(where, f"{at}.set_key", spec["set_key"])
        else:
            if spec["discover"] is not True:
                raise ConfigError(where, f"{at}.discover", "must be true (or leave it out)")
            discover = True
        backends = spec.get("backends", {})
        if not isinstance(backends, dict):
            raise ConfigError(where, f"{at}.backends", f"must map GPU ids to backend names, got {backends!r}")
        for gpu, backend in backends.items():
            _str(where, f"{at}.backends", gpu)
            _str(where, f"{at}.backends.{gpu}", backend)
            if gpus and gpu not in gpus:
                raise ConfigError(where, f"{at}.backends.{gpu}", f"GPU {gpu!r} is not in {at}.gpus")
        pools.append(PoolConfig(name, gpus, set_key, discover, dict(backends)))
    return tuple(pools)


# ============================================================================ snapshot


@dataclass
class PoolSnapshot:
    size: int
    held: int
    waiters: int
    ttl_min_ms: int | None
    age_max_ms: int | None
    without_ttl: int
    drift: dict[str, list[str]]


@dataclass
class Snapshot:
    pools: dict[str, PoolSnapshot]
    routes: dict[str, Any]  # route -> RouteStats
    taken_at: float


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _s(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


# ============================================================================ the view


class RedisView:
    """Reads pools and routes from Redis once per exporter round; renders without I/O.

    Lifecycle: ``await start()`` (starts the keyevent subscriber; never raises when
    Redis is down), then ``await refresh(backend_states)`` every round, ``collect()``
    and ``status()`` at will, ``await stop()``.
    """

    def __init__(self, config: RedisConfig, *, redis: aioredis.Redis | None = None):
        self.config = config
        self.keys = config.lease_keys
        self.qkeys = config.queue_keys
        common: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": config.timeout_s,
            "socket_connect_timeout": config.timeout_s,
        }
        # One retry without backoff: a pooled connection that died with a Redis restart
        # is replaced at once; a Redis that is down fails the refresh fast.
        self.redis = redis or aioredis.Redis.from_url(config.url, retry=Retry(NoBackoff(), 1), **common)
        # The subscriber must see every disconnection (it repairs the gap), so no
        # transparent reconnects there; and no read timeout on an idle feed.
        self._sub_redis = aioredis.Redis.from_url(
            config.url, retry=Retry(NoBackoff(), 0), decode_responses=True,
            socket_connect_timeout=config.timeout_s, socket_timeout=None,
        )
        self.db = int(self.redis.connection_pool.connection_kwargs.get("db", 0) or 0)
        self._owns_redis = redis is None

        self._up = False
        self._error: str | None = "not refreshed yet"
        self._snapshot: Snapshot | None = None
        self._last_duration_s: float | None = None
        self.round_trips_last = 0
        self.commands_last = 0

        self._pool_gpus: dict[str, tuple[str, ...]] = {p.name: p.gpus for p in config.pools}
        self._chunk_cache: dict[str, tuple[tuple[str, ...], list[tuple[Any, str]]]] = {}
        self._gpu_pools: dict[str, list[str]] = {}
        self._rebuild_gpu_index()
        self._discover_due = 0.0
        self._routes: tuple[str, ...] = config.routes or ()

        self._releases = {p.name: dict.fromkeys(RELEASE_REASONS, 0) for p in config.pools}
        self._repaired = dict.fromkeys(RELEASE_REASONS, 0)
        # gpu -> (holder, token, expire_at_ms on the Redis clock): leases known held,
        # less those whose release event we have seen. Compared after a feed gap.
        self._baseline: dict[str, tuple[str, int | None, float]] = {}
        self._event_seq = 0
        self._recent_events: list[tuple[int, str]] = []
        self._sub_connected = False
        self._sub_epoch = 0
        self._gap_open = False
        self._gaps = 0
        self._sub_error: str | None = None
        self._sub_task: asyncio.Task[None] | None = None
        self._stopping = False
        # Test hook: awaited before every (re)subscription.
        self._before_subscribe: Any = None

        self._keyspace_flags: str | None = None
        self._keyspace_fix: str | None = None

        # Drift needs the previous round: leases and backend states.
        self._prev_held: dict[tuple[str, str], tuple[str, int | None]] = {}
        self._prev_states: dict[str, str] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._stopping = False
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await self._check_keyspace_events()
        if self._sub_task is None and self.config.pools:
            self._sub_task = asyncio.create_task(self._subscriber(), name="redis-view-keyevents")

    async def stop(self) -> None:
        self._stopping = True
        if self._sub_task is not None:
            self._sub_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sub_task
            self._sub_task = None
        await self._sub_redis.aclose()
        if self._owns_redis:
            await self.redis.aclose()

    async def _check_keyspace_events(self) -> None:
        try:
            reply = await self.redis.config_get("notify-keyspace-events")
        except ResponseError:  # CONFIG disabled: cannot tell
            return
        flags = _s(next(iter(reply.values()), "")) if reply else ""
        self._keyspace_flags = flags
        self._keyspace_fix = required_keyspace_command(flags)
        if self._keyspace_fix:
            log.warning(
                "Redis notify-keyspace-events is %r: lease releases cannot be counted from "
                "events (only after gaps). Run: %s", flags, self._keyspace_fix,
            )

    # ------------------------------------------------------------------ refresh

    @property
    def up(self) -> bool:
        return self._up

    async def refresh(self, backend_states: Mapping[str, str]) -> None:
        """Read Redis once (constant round trips) and replace the snapshot. Never raises
        for Redis trouble: ``llm_redis_up`` goes to 0 and the next round tries again."""
        started = time.perf_counter()
        try:
            self._snapshot = await self._read(dict(backend_states))
            self._up, self._error = True, None
        except (RedisError, OSError, TimeoutError) as e:
            self._up, self._error = False, f"{type(e).__name__}: {e}"
            log.warning("redis view: refresh failed: %s", self._error)
        except Exception as e:  # a bug must not take the exporter down either
            self._up, self._error = False, f"{type(e).__name__}: {e}"
            log.exception("redis view: refresh failed")
        self._last_duration_s = time.perf_counter() - started

    def _chunks(self, pool: str, gpus: tuple[str, ...]) -> list[tuple[Any, str]]:
        cached = self._chunk_cache.get(pool)
        if cached is None or cached[0] is not gpus:
            cached = (gpus, read_leases_chunks(gpus))
            self._chunk_cache[pool] = cached
        return cached[1]

    def _rebuild_gpu_index(self) -> None:
        self._indexed = dict(self._pool_gpus)
        index: dict[str, list[str]] = {}
        for pool, gpus in self._pool_gpus.items():
            for gpu in gpus:
                index.setdefault(gpu, []).append(pool)
        self._gpu_pools = index

    async def _resolve_members(self) -> int:
        """Pools from sets, routes from the routes set, discovery when due. Returns the
        round trips used (0 or 1, plus a bounded SCAN every discover_interval_s)."""
        round_trips = 0
        set_pools = [p for p in self.config.pools if p.set_key]
        routes_from_set = self.config.routes is None
        if set_pools or routes_from_set:
            pipe = self.redis.pipeline(transaction=False)
            for p in set_pools:
                pipe.smembers(p.set_key)
            if routes_from_set:
                pipe.smembers(self.config.routes_key)
            replies = await pipe.execute()
            round_trips += 1
            self.commands_last += len(replies)
            for p, members in zip(set_pools, replies):
                ids = sorted(_s(m) for m in members)
                # The read script splits ids on newlines: such ids cannot be leases of ours.
                self._pool_gpus[p.name] = tuple(g for g in ids if "\n" not in g)
            if routes_from_set:
                self._routes = tuple(sorted(_s(r) for r in replies[-1]))
        discover = [p for p in self.config.pools if p.discover]
        if discover and time.monotonic() >= self._discover_due:
            found: set[str] = set()
            cursor = 0
            while True:  # bounded: stops after discover_max_keys keys
                cursor, batch = await self.redis.scan(cursor, match=self.keys.lease_prefix + "*", count=1000)
                round_trips += 1
                self.commands_last += 1
                found.update(g for g in (self.keys.gpu_of(_s(k)) for k in batch) if g is not None)
                if not cursor or len(found) >= self.config.discover_max_keys:
                    break
            for p in discover:
                known = set(self._pool_gpus.get(p.name, ())) | found
                self._pool_gpus[p.name] = tuple(sorted(known)[: self.config.discover_max_keys])
            self._discover_due = time.monotonic() + self.config.discover_interval_s
        if self._pool_gpus != self._indexed:
            self._rebuild_gpu_index()
        return round_trips

    async def _read(self, backend_states: dict[str, str]) -> Snapshot:
        self.commands_last = 0
        round_trips = await self._resolve_members()
        pools = [(p, self._pool_gpus.get(p.name, ())) for p in self.config.pools]
        routes = self._routes

        # For the gap repair: where the event feed stood when we asked.
        seq_before, epoch_before = self._event_seq, self._sub_epoch
        feed_live_before = self._sub_connected

        wall = now_ms()  # queue and waiter times are the writers' clocks (Unix ms)
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()  # lease times are the Redis clock (written by the claim script)
        for p, gpus in pools:
            for _chunk, joined in self._chunks(p.name, gpus):
                add_read_leases(pipe, self.keys, joined)
            pipe.zcount(self.keys.waiters(p.name), wall, "+inf")
        gc_cutoff = wall - self.config.queue_retention_ms
        for route in routes:
            add_route_stats_commands(pipe, self.qkeys, route, wall)
            if self.config.queue_gc:
                pipe.eval(GC_LUA, 6, "", *self.qkeys.route_keys(route), gc_cutoff, 1000)
        replies = await pipe.execute(raise_on_error=False)
        round_trips += 1
        self.commands_last += len(replies)
        self.round_trips_last = round_trips

        def take(n: int) -> list[Any]:
            nonlocal at
            chunk = replies[at: at + n]
            at += n
            for r in chunk:
                if isinstance(r, Exception):
                    raise r
            return chunk

        at = 0
        sec, usec = take(1)[0]
        server_ms = int(sec) * 1000 + int(usec) // 1000
        pool_snaps: dict[str, PoolSnapshot] = {}
        held_now: dict[tuple[str, str], tuple[str, int | None]] = {}
        baseline: dict[str, tuple[str, int | None, float]] = {}
        for p, gpus in pools:
            chunks = self._chunks(p.name, gpus)
            leased: dict[str, Any] = {}
            for (chunk, _joined), reply in zip(chunks, take(len(chunks))):
                leased.update(parse_read_leases(chunk, reply))
            (waiters,) = take(1)
            ttl_min = age_oldest = None
            held_count = without_ttl = 0
            drift: dict[str, list[str]] = {k: [] for k in DRIFT_KINDS}
            for gpu in gpus:
                state = leased.get(gpu)
                backend = p.backends.get(gpu)
                backend_state = backend_states.get(backend) if backend else None
                if state is None:
                    if backend_state in BUSY_STATES:
                        drift["busy_without_lease"].append(gpu)
                    continue
                held_count += 1
                identity = (state.holder, state.token)
                held_now[(p.name, gpu)] = identity
                if state.ttl_ms is None:
                    without_ttl += 1
                    expire_at = float("inf")
                else:
                    ttl_min = state.ttl_ms if ttl_min is None else min(ttl_min, state.ttl_ms)
                    expire_at = server_ms + state.ttl_ms
                baseline[gpu] = (state.holder, state.token, expire_at)
                if state.claimed_ms is not None:
                    age = server_ms - state.claimed_ms
                    age_oldest = age if age_oldest is None else max(age_oldest, age)
                # "Idle for a whole round": the same lease was there last round and the
                # backend was idle then and now.
                if (
                    backend_state == IDLE_STATE
                    and self._prev_states.get(backend) == IDLE_STATE  # type: ignore[arg-type]
                    and self._prev_held.get((p.name, gpu)) == identity
                ):
                    drift["lease_on_idle_backend"].append(gpu)
            pool_snaps[p.name] = PoolSnapshot(
                size=len(gpus), held=held_count, waiters=int(waiters), ttl_min_ms=ttl_min,
                age_max_ms=age_oldest, without_ttl=without_ttl, drift=drift,
            )
        route_stats: dict[str, Any] = {}
        for route in routes:
            route_stats[route] = parse_route_stats(take(ROUTE_STATS_COMMANDS), wall)
            if self.config.queue_gc:
                (gc_reply,) = replies[at: at + 1]
                at += 1
                if isinstance(gc_reply, Exception):  # e.g. a read-only replica: reading still works
                    log.warning("redis view: queue GC on %s failed: %s", route, gc_reply)

        self._prev_held = held_now
        self._prev_states = backend_states
        # Replace the gap baseline only if the feed was live the whole time: else the
        # releases of the gap would vanish from it before they are counted.
        if feed_live_before and self._sub_connected and self._sub_epoch == epoch_before:
            seen_since = {gpu for seq, gpu in self._recent_events if seq > seq_before}
            self._baseline = {g: v for g, v in baseline.items() if g not in seen_since}
        self._recent_events = []  # the next refresh only looks at events after its own start
        return Snapshot(pool_snaps, route_stats, time.time())

    # ------------------------------------------------------------------ keyevents

    def _on_event(self, channel: str, key: str) -> None:
        gpu = self.keys.gpu_of(key)
        if gpu is None:
            return
        pools = self._gpu_pools.get(gpu)
        if not pools:
            return
        reason = channel.rsplit(":", 1)[-1]
        if reason not in RELEASE_REASONS:
            return
        for pool in pools:
            self._releases.setdefault(pool, dict.fromkeys(RELEASE_REASONS, 0))[reason] += 1
        self._baseline.pop(gpu, None)
        self._event_seq += 1
        self._recent_events.append((self._event_seq, gpu))

    async def _repair_gap(self) -> None:
        """Count the releases the feed missed: leases of the baseline that are gone (or
        held by another claim) now; ``expired`` if their TTL had passed, else ``del``.
        Runs BEFORE resubscribing, so nothing is counted twice (a release in the short
        window between this read and the subscription is missed instead)."""
        baseline = dict(self._baseline)
        if not baseline:
            return
        gpus = list(baseline)
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        for gpu in gpus:
            pipe.get(self.keys.lease(gpu))
            pipe.hget(self.keys.info(gpu), "token")
        replies = await pipe.execute()
        sec, usec = replies[0]
        server_ms = int(sec) * 1000 + int(usec) // 1000
        for i, gpu in enumerate(gpus):
            holder, token, expire_at = baseline[gpu]
            cur_holder, cur_token = replies[1 + 2 * i], replies[2 + 2 * i]
            if cur_holder == holder and (token is None or cur_token == str(token)):
                continue
            reason = "expired" if expire_at <= server_ms else "del"
            for pool in self._gpu_pools.get(gpu, ()):
                self._releases.setdefault(pool, dict.fromkeys(RELEASE_REASONS, 0))[reason] += 1
            self._repaired[reason] += 1
            self._baseline.pop(gpu, None)

    async def _subscriber(self) -> None:
        liveness = f"llm-health:view:{uuid.uuid4().hex}"
        channels = (*keyevent_channels(self.db), liveness)
        backoff = 0.05
        while not self._stopping:
            pubsub = self._sub_redis.pubsub()
            try:
                if self._before_subscribe is not None:
                    await self._before_subscribe()
                if self._gap_open:
                    await self._repair_gap()
                    with contextlib.suppress(ResponseError):
                        await self._check_keyspace_events()
                await pubsub.subscribe(*channels)
                confirmed = 0
                while confirmed < len(channels):
                    msg = await pubsub.get_message(timeout=self.config.timeout_s)
                    if msg is None:
                        raise TimeoutError("keyevent subscription not confirmed")
                    if msg["type"] == "subscribe":
                        confirmed += 1
                self._gap_open = False
                self._sub_connected = True
                self._sub_epoch += 1
                self._sub_error = None
                backoff = 0.05
                awaiting_pong = False
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=FEED_IDLE_PING_S)
                    if msg is None:
                        # Silence: a dead peer without a reset would block us forever. Send
                        # ourselves a message; if it does not come back, the feed is broken.
                        if awaiting_pong:
                            raise TimeoutError("keyevent feed: our own liveness message did not come back")
                        await self.redis.publish(liveness, "1")
                        awaiting_pong = True
                        continue
                    awaiting_pong = False
                    if msg["type"] == "message":
                        self._on_event(_s(msg["channel"]), _s(msg["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # connection lost, Redis down, a bug: retry, never die
                if self._sub_connected:
                    self._gaps += 1
                self._sub_connected = False
                self._gap_open = True
                self._sub_error = f"{type(e).__name__}: {e}"
                log.warning("redis view: keyevent feed lost (%s); reconnecting", self._sub_error)
            finally:
                self._sub_connected = False
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.reconnect_max_s)

    # ------------------------------------------------------------------ render

    def collect(self) -> Iterator[Metric]:
        """Metric families of the last snapshot. No I/O."""
        up = GaugeMetricFamily("llm_redis_up", "1 if the last refresh read Redis, 0 if it failed.")
        up.add_metric([], 1.0 if self._up else 0.0)
        yield up

        releases = CounterMetricFamily(
            "llm_gpu_lease_releases",
            "GPU leases that ended, by reason: del (released) or expired (TTL ran out: a "
            "holder that crashed or failed to renew). Counted from keyspace events by a "
            "background subscriber; releases missed while it was disconnected are counted "
            "after it reconnects.",
            labels=["pool", "reason"],
        )
        for pool, counts in sorted(self._releases.items()):
            for reason in RELEASE_REASONS:
                releases.add_metric([pool, reason], float(counts[reason]))
        yield releases

        snap = self._snapshot
        if not self._up or snap is None:
            return

        def gauge(name: str, doc: str, label: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[label])

        size = gauge("llm_gpu_pool_size", "GPUs in the pool (from configuration or its Redis set).", "pool")
        held = gauge("llm_gpu_leases_held", "GPUs of the pool with a lease key.", "pool")
        free = gauge("llm_gpu_free", "GPUs of the pool without a lease key.", "pool")
        waiters = gauge("llm_gpu_waiters", "Callers waiting for a GPU of the pool (deadline not passed).", "pool")
        ttl_min = gauge(
            "llm_gpu_lease_ttl_min_seconds",
            "Smallest remaining TTL of the pool's leases; absent when none is held.", "pool")
        age_max = gauge(
            "llm_gpu_lease_age_max_seconds",
            "Age of the pool's oldest lease (claim time from the lease's side hash); absent "
            "when none is held or no lease has a claim time.", "pool")
        drift = GaugeMetricFamily(
            "llm_gpu_lease_drift",
            "GPUs whose lease disagrees with the engine: lease_on_idle_backend (the same "
            "lease held over two rounds while the backend was idle in both; needs the "
            "previous round), busy_without_lease (backend busy, stalled, hung or unknown "
            "with no lease: a job that never claimed its GPU).",
            labels=["pool", "kind"],
        )
        for name, p in sorted(snap.pools.items()):
            size.add_metric([name], p.size)
            held.add_metric([name], p.held)
            free.add_metric([name], p.size - p.held)
            waiters.add_metric([name], p.waiters)
            if p.ttl_min_ms is not None:
                ttl_min.add_metric([name], p.ttl_min_ms / 1000)
            if p.age_max_ms is not None:
                age_max.add_metric([name], max(p.age_max_ms, 0) / 1000)
            for kind in DRIFT_KINDS:
                drift.add_metric([name, kind], len(p.drift[kind]))
        yield from (size, held, free, waiters, ttl_min, age_max, drift)

        depth = gauge("llm_admission_queue_depth", "Requests waiting on the route.", "route")
        age = gauge(
            "llm_admission_queue_age_seconds",
            "Age of the oldest waiting request (a resent id keeps its first enqueue time); 0 when empty.",
            "route")
        slack = gauge(
            "llm_admission_deadline_slack_seconds",
            "Smallest deadline slack of the waiting requests (negative: past its deadline); "
            "absent when empty.", "route")
        past = gauge("llm_admission_past_deadline", "Waiting requests past their deadline.", "route")
        retried = gauge("llm_admission_retried_requests", "Waiting requests with retry_count >= 1.", "route")
        dup = gauge(
            "llm_admission_token_duplication_ratio_max",
            "Largest token units of one request id (all attempts) over the units of one "
            "attempt, over the ids of the retention window; absent until an id has units.",
            "route")
        for route, s in sorted(snap.routes.items()):
            depth.add_metric([route], s.depth)
            age.add_metric([route], max(s.oldest_age_ms or 0, 0) / 1000)
            if s.smallest_slack_ms is not None:
                slack.add_metric([route], s.smallest_slack_ms / 1000)
            past.add_metric([route], s.past_deadline)
            retried.add_metric([route], s.retried)
            if s.token_duplication_ratio_max is not None:
                dup.add_metric([route], s.token_duplication_ratio_max)
        yield from (depth, age, slack, past, retried, dup)

    def describe(self) -> Iterator[Metric]:
        """Nothing: keeps prometheus_client from calling collect() at registration."""
        return iter(())

    def status(self) -> dict[str, Any]:
        """For the JSON /status page. Times in ms: ``queue_age_ms``, ``deadline_slack_ms``."""
        out: dict[str, Any] = {
            "up": self._up,
            "error": self._error,
            "url": _redact(self.config.url),
            "refresh_duration_ms": None if self._last_duration_s is None else round(self._last_duration_s * 1000, 3),
            "round_trips": self.round_trips_last,
            "commands": self.commands_last,
            "keyspace_events": {
                "flags": self._keyspace_flags,
                "ok": self._keyspace_fix is None if self._keyspace_flags is not None else None,
                "fix": self._keyspace_fix,
            },
            "subscriber": {
                "connected": self._sub_connected,
                "gaps": self._gaps,
                "error": self._sub_error,
                "repaired_releases": dict(self._repaired),
            },
            "pools": {},
            "routes": {},
        }
        snap = self._snapshot
        for pool in self.config.pools:
            entry: dict[str, Any] = {"releases": dict(self._releases.get(pool.name, {}))}
            p = snap.pools.get(pool.name) if snap else None
            if p is not None:
                entry.update(
                    size=p.size,
                    leases_held=p.held,
                    free=p.size - p.held,
                    waiters=p.waiters,
                    lease_ttl_min_ms=p.ttl_min_ms,
                    lease_age_max_ms=p.age_max_ms,
                    leases_without_ttl=p.without_ttl,
                    drift={
                        kind: {"count": len(gpus), "gpus": gpus[:STATUS_LIST_CAP]}
                        for kind, gpus in p.drift.items()
                    },
                )
            out["pools"][pool.name] = entry
        if snap:
            for route, s in snap.routes.items():
                out["routes"][route] = {
                    "queue_depth": s.depth,
                    "queue_age_ms": s.oldest_age_ms or 0,
                    "deadline_slack_ms": s.smallest_slack_ms,
                    "past_deadline": s.past_deadline,
                    "retried_requests": s.retried,
                    "token_duplication_ratio_max": s.token_duplication_ratio_max,
                }
        out["stale"] = not self._up and snap is not None
        return out
