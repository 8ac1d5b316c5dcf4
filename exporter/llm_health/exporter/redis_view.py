"""The exporter's view of Redis: GPU pools (leases) and admission routes (queue).

`refresh()` does all the I/O, once per exporter round, in a constant number of
pipelined round trips (1, or 2 when pools or routes come from Redis sets), whatever
the pool sizes and queue lengths: GET/PTTL/HMGET of the known lease keys (a short
read-only script per 500 GPUs, so the client sends 20 commands rather than 30,000 for
10,000 GPUs), O(log n) sorted-set reads per route, never KEYS. What it read is rendered
by `redis_collector` without I/O.

Lease releases are counted from keyspace events by a background subscriber; releases
missed while it was disconnected are counted after it reconnects, by comparing the
leases held before the gap with those held after.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from ..config.redis import RedisConfig
from ..core.drift import Identity, PoolSnapshot, pool_snapshot
from ..store.connection import text
from ..store.deployment import connect, wrap
from ..store.errors import ERRORS
from ..store.feed import RELEASE_REASONS, required_keyspace_command
from ..store.queue import ROUTE_STATS_COMMANDS, RouteStats, add_route_stats_commands, now_ms, parse_route_stats
from ..store.scripts import GC_LUA

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    pools: dict[str, PoolSnapshot]
    routes: dict[str, RouteStats]
    taken_at: float


class RedisView:
    """Reads pools and routes from Redis once per exporter round.

    Lifecycle: `await start()` (starts the keyevent subscriber; never raises when Redis
    is down), then `await refresh(backend_states)` every round, `await stop()`.
    """

    def __init__(self, config: RedisConfig, *, redis: Any = None):
        self.config = config
        # One server, Sentinel or Cluster, from the URL (store.deployment). One retry: a
        # pooled connection that died with a Redis restart is replaced at once; a Redis
        # that is down fails the refresh fast.
        self.deployment = wrap(redis) if redis is not None else connect(config.url, socket_timeout=config.timeout_s, retries=1)
        self.redis = self.deployment.client
        self.keys = self.deployment.lease_keys(config.lease_keys)
        self.bulk = self.deployment.bulk_reads(self.keys)  # the kind's batch reads (store.bulk)
        self.qkeys = self.deployment.queue_keys(config.queue_prefix)
        self._owns_redis = redis is None
        self.db = self.deployment.db

        self.up = False
        self.error: str | None = "not refreshed yet"
        self.snapshot: Snapshot | None = None
        self.last_duration_s: float | None = None
        self.round_trips_last = 0
        self.commands_last = 0

        self._pool_gpus: dict[str, tuple[str, ...]] = {p.name: p.gpus for p in config.pools}
        self._indexed: dict[str, tuple[str, ...]] = {}
        self._gpu_pools: dict[str, list[str]] = {}
        self._rebuild_gpu_index()
        self._discover_due = 0.0
        self._routes: tuple[str, ...] = config.routes or ()

        self.releases = {p.name: dict.fromkeys(RELEASE_REASONS, 0) for p in config.pools}
        self.repaired = dict.fromkeys(RELEASE_REASONS, 0)
        # gpu -> (holder, token, expire_at_ms on the Redis clock): leases known held,
        # less those whose release event we have seen. Compared after a feed gap.
        self._baseline: dict[str, tuple[str, int | None, float]] = {}
        self._event_seq = 0
        self._recent_events: list[tuple[int, str]] = []
        self._sub_epoch = 0
        self._gap_open = False
        self.gaps = 0
        self.sub_error: str | None = None
        # Test hook: awaited before every (re)subscription.
        self._before_subscribe: Any = None
        self.subscriber = self.deployment.keyevent_subscriber(
            self._on_event,
            name="redis-view-keyevents",
            on_subscribed=self._subscribed,
            on_lost=self._lost,
            before_subscribe=self._prepare_subscription,
            reconnect_max_s=config.reconnect_max_s,
            confirm_timeout_s=config.timeout_s,
        )

        self.keyspace_flags: str | None = None
        # Rounds whose publication of the engine queue ages did not land (whole or part).
        self.publish_failures = 0
        self.keyspace_fix: str | None = None

        # Drift needs the previous round: leases and backend states.
        self._prev_held: dict[str, dict[str, Identity]] = {}
        self._prev_states: dict[str, str] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        try:
            await self._check_keyspace_events()
            for note in await self.deployment.startup_warnings():
                log.warning("redis view: %s", note)
        except ERRORS:
            pass
        if self.config.pools:
            self.subscriber.start()

    async def stop(self) -> None:
        await self.subscriber.aclose()
        if self._owns_redis:
            await self.deployment.aclose()

    @property
    def _sub_connected(self) -> bool:
        return self.subscriber.connected

    async def _check_keyspace_events(self) -> None:
        found = await self.deployment.config_get("notify-keyspace-events")
        if not found:  # CONFIG disabled: cannot tell
            return
        # Every primary must publish them (Cluster): report the first that does not.
        flags = next((f for f in found.values() if required_keyspace_command(f)), next(iter(found.values())))
        self.keyspace_flags = flags
        self.keyspace_fix = required_keyspace_command(flags)
        if self.keyspace_fix:
            log.warning(
                "Redis notify-keyspace-events is %r: lease releases cannot be counted from events (only after gaps). Run: %s",
                flags,
                self.keyspace_fix,
            )

    # ------------------------------------------------------------------ refresh

    async def refresh(
        self,
        backend_states: Mapping[str, str],
        engine_ages: Mapping[str, int | None] | None = None,
        ttl_ms: int = 3000,
        waiting: Mapping[str, str | None] | None = None,
    ) -> None:
        """Read Redis once (constant round trips) and replace the snapshot; in the same
        pipeline, publish each backend's engine queue age (`engine_ages`, ms or None while
        unknown) under QueueKeys.engine_age and its waiting and running counts (`waiting`, "W R READ_MS S")
        under QueueKeys.engine_waiting: SET with an expiry of `ttl_ms`, or DEL while
        unknown (absent means unknown, never 0). Never raises for Redis trouble:
        `llm_redis_up` goes to 0 (and a publish that did not land is counted in
        `publish_failures`) and the next round tries again."""
        started = time.perf_counter()
        ages: dict[str, str | int | None] = {self.qkeys.engine_age(b): a for b, a in (engine_ages or {}).items()}
        ages.update((self.qkeys.engine_waiting(b), w) for b, w in (waiting or {}).items())
        try:
            self.snapshot = await self._read(dict(backend_states), ages, ttl_ms)
            self.up, self.error = True, None
        except ERRORS as e:
            self.up, self.error = False, f"{type(e).__name__}: {e}"
            self.publish_failures += 1 if ages else 0
            log.warning("redis view: refresh failed: %s", self.error)
        except Exception as e:  # a bug must not take the exporter down either
            self.up, self.error = False, f"{type(e).__name__}: {e}"
            self.publish_failures += 1 if ages else 0
            log.exception("redis view: refresh failed")
        self.last_duration_s = time.perf_counter() - started

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
                pipe.smembers(str(p.set_key))
            if routes_from_set:
                pipe.smembers(self.config.routes_set_key or self.qkeys.routes())
            replies = await pipe.execute()
            round_trips += 1
            self.commands_last += len(replies)
            for p, members in zip(set_pools, replies):
                ids = sorted(text(m) for m in members)
                # The read script splits ids on newlines: such ids cannot be leases of ours.
                self._pool_gpus[p.name] = tuple(g for g in ids if "\n" not in g)
            if routes_from_set:
                self._routes = tuple(sorted(text(r) for r in replies[-1]))
        discover = [p for p in self.config.pools if p.discover]
        if discover and time.monotonic() >= self._discover_due:
            # bounded: stops after discover_max_keys keys (Cluster: over every primary)
            found, trips = await self.bulk.scan_ids(self.keys.lease_prefix + "*", self.keys.gpu_of, self.config.discover_max_keys)
            round_trips += trips
            self.commands_last += trips
            for p in discover:
                known = set(self._pool_gpus.get(p.name, ())) | found
                self._pool_gpus[p.name] = tuple(sorted(known)[: self.config.discover_max_keys])
            self._discover_due = time.monotonic() + self.config.discover_interval_s
        if self._pool_gpus != self._indexed:
            self._rebuild_gpu_index()
        return round_trips

    async def _read(self, backend_states: dict[str, str], ages: dict[str, str | int | None] | None = None, ttl_ms: int = 3000) -> Snapshot:
        """`ages`: the published keys (engine ages and waiting counts) and their values."""
        self.commands_last = 0
        round_trips = await self._resolve_members()
        pools = [(p, self._pool_gpus.get(p.name, ())) for p in self.config.pools]
        routes = self._routes

        # For the gap repair: where the event feed stood when we asked.
        seq_before, epoch_before = self._event_seq, self._sub_epoch
        feed_live_before = self.subscriber.connected

        wall = now_ms()  # queue and waiter times are the writers' clocks (Unix ms)
        await self.bulk.prepare()
        pipe = self.redis.pipeline(transaction=False)
        self.bulk.add_time(pipe)  # lease times are the Redis clock (written by the claim script)
        lease_replies = []
        for p, gpus in pools:
            lease_replies.append(self.bulk.add_leases(pipe, p.name, gpus))
            pipe.zcount(self.keys.waiters(p.name), wall, "+inf")
        gc_cutoff = wall - self.config.queue_retention_ms
        for route in routes:
            add_route_stats_commands(pipe, self.qkeys, route, wall)
            if self.config.queue_gc:  # KEYS[1] is unused; the routes key keeps it in the queue's slot
                pipe.eval(GC_LUA, 6, self.qkeys.routes(), *self.qkeys.route_keys(route), gc_cutoff, 1000)
        ages = ages or {}
        for key, value in ages.items():  # last in the batch: the reads above keep their places
            if value is None:
                pipe.delete(key)
            else:
                pipe.set(key, str(value), px=ttl_ms)
        replies = await pipe.execute(raise_on_error=False)
        round_trips += 1
        published = replies[len(replies) - len(ages) :] if ages else []
        failed = [r for r in published if isinstance(r, Exception)]
        if failed:
            self.publish_failures += 1
            log.warning("redis view: publishing %d engine queue age(s) failed: %s", len(failed), failed[0])
        self.commands_last += len(replies)
        self.round_trips_last = round_trips

        at = 0

        def take(n: int) -> list[Any]:
            nonlocal at
            chunk = replies[at : at + n]
            at += n
            for r in chunk:
                if isinstance(r, Exception):
                    raise r
            return chunk

        sec, usec = take(1)[0]
        server_ms = int(sec) * 1000 + int(usec) // 1000
        pool_snaps: dict[str, PoolSnapshot] = {}
        held_now: dict[str, dict[str, Identity]] = {}
        baseline: dict[str, tuple[str, int | None, float]] = {}
        for (p, gpus), n in zip(pools, lease_replies):
            leased = self.bulk.parse_leases(p.name, gpus, take(n))
            (waiters,) = take(1)
            found = pool_snapshot(gpus, leased, int(waiters), p.backends, backend_states, self._prev_states, self._prev_held.get(p.name, {}), server_ms)
            pool_snaps[p.name] = found.snapshot
            held_now[p.name] = found.held
            baseline.update(found.expiry)
        route_stats: dict[str, RouteStats] = {}
        for route in routes:
            route_stats[route] = parse_route_stats(take(ROUTE_STATS_COMMANDS), wall)
            if self.config.queue_gc:
                (gc_reply,) = replies[at : at + 1]
                at += 1
                if isinstance(gc_reply, Exception):  # e.g. a read-only replica: reading still works
                    log.warning("redis view: queue GC on %s failed: %s", route, gc_reply)

        self._prev_held = held_now
        self._prev_states = backend_states
        # Replace the gap baseline only if the feed was live the whole time: else the
        # releases of the gap would vanish from it before they are counted.
        if feed_live_before and self.subscriber.connected and self._sub_epoch == epoch_before:
            seen_since = {gpu for seq, gpu in self._recent_events if seq > seq_before}
            self._baseline = {g: v for g, v in baseline.items() if g not in seen_since}
        self._recent_events = []  # the next refresh only looks at events after its own start
        return Snapshot(pool_snaps, route_stats, time.time())

    # ------------------------------------------------------------------ keyevents

    def _on_event(self, reason: str, key: str) -> None:
        gpu = self.keys.gpu_of(key)
        if gpu is None:
            return
        pools = self._gpu_pools.get(gpu)
        if not pools:
            return
        for pool in pools:
            self.releases.setdefault(pool, dict.fromkeys(RELEASE_REASONS, 0))[reason] += 1
        self._baseline.pop(gpu, None)
        self._event_seq += 1
        self._recent_events.append((self._event_seq, gpu))

    async def _prepare_subscription(self) -> None:
        if self._before_subscribe is not None:
            await self._before_subscribe()
        if self._gap_open:
            await self._repair_gap()
            try:
                await self._check_keyspace_events()
            except ResponseError:
                pass

    def _subscribed(self, first: bool) -> None:
        self._gap_open = False
        self._sub_epoch += 1
        self.sub_error = None

    def _lost(self, exc: BaseException) -> None:
        if self._sub_epoch and not self._gap_open:
            self.gaps += 1
        self._gap_open = True
        self.sub_error = f"{type(exc).__name__}: {exc}"

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
        for gpu in gpus:
            pipe.get(self.keys.lease(gpu))
            pipe.hget(self.keys.info(gpu), "token")
        replies = [None, *await pipe.execute()]
        server_ms = await self.deployment.server_ms()
        for i, gpu in enumerate(gpus):
            holder, token, expire_at = baseline[gpu]
            cur_holder, cur_token = replies[1 + 2 * i], replies[2 + 2 * i]
            if cur_holder == holder and (token is None or cur_token == str(token)):
                continue
            reason = "expired" if expire_at <= server_ms else "del"
            for pool in self._gpu_pools.get(gpu, ()):
                self.releases.setdefault(pool, dict.fromkeys(RELEASE_REASONS, 0))[reason] += 1
            self.repaired[reason] += 1
            self._baseline.pop(gpu, None)
