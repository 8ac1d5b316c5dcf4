"""Admission queue records in Redis: per request id, what the admission gate needs to see
a resent id as a retry and to put age before deadline.

Per request id, a hash ``<prefix>req:<id>``: route, tenant, ``enqueued_ms``,
``deadline_ms`` (absolute, Unix ms), ``retry_count``, ``attempts``, ``token_units``
(all attempts together), ``attempt_units_max`` (the largest single attempt),
``http_status`` (of the last upstream attempt), ``state`` (queued, running, done).

Per route, sorted sets, so that the exporter reads everything in O(log n):

- ``<prefix>route:<route>:enqueued`` waiting ids scored by ``enqueued_ms``: depth
  (ZCARD), oldest age (first member);
- ``<prefix>route:<route>:deadline`` waiting ids scored by ``deadline_ms``: smallest
  slack (first member), past-deadline count (ZCOUNT -inf now);
- ``<prefix>route:<route>:retried`` waiting ids with ``retry_count >= 1``;
- ``<prefix>route:<route>:dup`` ids of the retention window scored by their token
  duplication ratio (``token_units / attempt_units_max``): the max is the last member;
- ``<prefix>route:<route>:live`` every id of the window scored by
  ``max(deadline_ms, last write)``: what the garbage collection walks.

Nothing grows without bound: a record expires ``retention_ms`` after
``max(deadline, last write)``; ids whose window has passed are removed from the
route's sets by a bounded GC that runs inside every enqueue (and the exporter's
refresh). A resent id keeps its first ``enqueued_ms`` and ``deadline_ms``: a retry
inherits the age of the request it copies, which is what the age-first rule needs.

Times are the writer's clock (the gate's), Unix milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import MovedError, NoScriptError

from .connection import text
from .deployment import Deployment, connect, wrap
from .keys import DEFAULT_QUEUE_PREFIX, DEFAULT_RETENTION_MS, QueueKeys
from .policy import Figures, Verdict
from .scripts import DECIDE_LUA, ENQUEUE_LUA, GC_LIMIT, GC_LUA, LEAVE_QUEUE_LUA, RECORD_ATTEMPT_LUA

# How an attempt left the route's in-flight set (AdmissionQueue.leave_call, scripts.LEAVE_QUEUE_LUA).
ENDED, GAVE_UP = 1, 2


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class QueueRecord:
    request_id: str
    route: str
    tenant: str
    enqueued_ms: int
    deadline_ms: int
    retry_count: int = 0
    attempts: int = 0
    token_units: int = 0
    attempt_units_max: int = 0
    http_status: int | None = None
    state: str = "queued"

    @property
    def is_retry(self) -> bool:
        return self.retry_count >= 1

    def age_ms(self, now: int | None = None) -> int:
        return (now if now is not None else now_ms()) - self.enqueued_ms

    def slack_ms(self, now: int | None = None) -> int:
        return self.deadline_ms - (now if now is not None else now_ms())

    @property
    def token_duplication_ratio(self) -> float:
        """Token units of all attempts over those of one (the largest) attempt: 4.0 is
        an id whose tokens were spent four times."""
        return self.token_units / self.attempt_units_max if self.attempt_units_max else 0.0

    @classmethod
    def from_hash(cls, request_id: str, flat: Sequence[Any] | dict[Any, Any]) -> QueueRecord | None:
        if not flat:
            return None
        if isinstance(flat, dict):
            h = {text(k): text(v) for k, v in flat.items()}
        else:
            items = [text(x) for x in flat]
            h = dict(zip(items[0::2], items[1::2]))
        status = h.get("http_status") or ""
        return cls(
            request_id=request_id,
            route=h.get("route", ""),
            tenant=h.get("tenant", ""),
            enqueued_ms=int(h.get("enqueued_ms") or 0),
            deadline_ms=int(h.get("deadline_ms") or 0),
            retry_count=int(h.get("retry_count") or 0),
            attempts=int(h.get("attempts") or 0),
            token_units=int(h.get("token_units") or 0),
            attempt_units_max=int(h.get("attempt_units_max") or 0),
            http_status=int(status) if status else None,
            state=h.get("state", ""),
        )


@dataclass(frozen=True)
class RouteStats:
    """What the exporter exports per route; ``None`` where there is nothing to measure."""

    depth: int
    oldest_age_ms: int | None
    smallest_slack_ms: int | None
    past_deadline: int
    retried: int
    token_duplication_ratio_max: float | None


class AdmissionQueue:
    """Queue records of the admission gate. Every write is one Lua script (atomic,
    one round trip); reads are plain commands."""

    def __init__(
        self,
        redis: Any,
        *,
        prefix: str = DEFAULT_QUEUE_PREFIX,
        retention_ms: int = DEFAULT_RETENTION_MS,
        clock: Callable[[], int] = now_ms,
    ):
        """``clock`` returns the writer's time in Unix ms (tests pass a fake one)."""
        if retention_ms <= 0:
            raise ValueError("retention_ms must be positive")
        # A Deployment, or a redis-py Redis/RedisCluster client; on Cluster the whole
        # queue shares one hash tag (QueueKeys.tagged).
        self.deployment = redis if isinstance(redis, Deployment) else wrap(redis)
        self.redis = redis = self.deployment.client
        self.keys = self.deployment.queue_keys(prefix)
        self.retention_ms = retention_ms
        self.clock = clock
        self._enqueue = redis.register_script(ENQUEUE_LUA)
        self._leave = redis.register_script(LEAVE_QUEUE_LUA)
        self._attempt = redis.register_script(RECORD_ATTEMPT_LUA)
        self._gc = redis.register_script(GC_LUA)
        self._decide = redis.register_script(DECIDE_LUA)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> AdmissionQueue:
        return cls(connect(url), **kwargs)

    async def pipeline(self) -> Any:
        """A pipeline for the queue's commands. On Cluster the whole queue is one hash tag
        (one slot) and redis-py's cluster pipeline refuses EVALSHA: a plain pipeline on the
        primary owning that slot (the slot map is asked again after a failover: `execute`)."""
        return await self.deployment.pipeline_for(self.keys.routes())

    async def execute(self, pipe: Any) -> list[Any]:
        """Run a pipeline holding EVALSHAs and reads (every command safe to send again: the
        attempt script is idempotent by attempt id). On a Redis that lost its scripts
        (NOSCRIPT: a restart, a failover) load them and run it again. On Cluster, a MOVED
        (nothing ran: one slot) runs it again on the slot's primary now."""
        commands = list(pipe.command_stack)
        try:
            try:
                return list(await pipe.execute())
            except MovedError:
                if not await self.deployment.refresh_topology():  # no slot map: MOVED is an answer
                    raise
                pipe = await self.pipeline()
                pipe.command_stack = list(commands)
                return list(await pipe.execute())
        except NoScriptError:
            await self.load_scripts()
            again = await self.pipeline()
            again.command_stack = list(commands)
            return list(await again.execute())

    async def aclose(self) -> None:
        await self.deployment.aclose()

    # Each script's (keys, args), in one place: the methods below run them one at a time,
    # the gate queues them on a pipeline (`pipe_*`).
    def enqueue_call(self, request_id: str, route: str, tenant: str, deadline_ms: int, enqueued_ms: int, now: int) -> tuple[list[Any], list[Any]]:
        keys = [self.keys.record(request_id), *self.keys.route_keys(route), self.keys.routes()]
        return keys, [request_id, route, tenant, int(deadline_ms), int(enqueued_ms), now, self.retention_ms, GC_LIMIT]

    def leave_call(
        self, request_id: str, route: str, state: str, http_status: int | None, now: int, only_if_waiting: bool = False, ended: int = 0
    ) -> tuple[list[Any], list[Any]]:
        """``ended``: ENDED where an attempt the door sent on ended, GAVE_UP where its client
        went away before the answer (listed for the door's coverage, scripts.DECIDE_LUA),
        0 for a refusal (never sent on)."""
        keys = [self.keys.record(request_id), *self.keys.route_keys(route)[:3], *self.keys.route_inflight(route)]
        return keys, [request_id, state, "" if http_status is None else int(http_status), now, int(only_if_waiting), ended]

    def attempt_call(
        self,
        request_id: str,
        route: str,
        token_units: int,
        http_status: int | None,
        retry_count: int | None,
        now: int,
        attempt_id: str = "",
        tenant_key: str | None = None,
    ) -> tuple[list[Any], list[Any]]:
        """With ``attempt_id`` the write is idempotent (sent again after a timeout, it counts
        once); with ``tenant_key`` the units are charged to it in the same script."""
        keys = [self.keys.record(request_id), *self.keys.route_keys(route)]
        args = [
            request_id,
            int(token_units),
            "" if http_status is None else int(http_status),
            now,
            self.retention_ms,
            "" if retry_count is None else int(retry_count),
            attempt_id,
            int(token_units) if tenant_key else 0,
        ]
        if tenant_key:
            keys.append(tenant_key)
        return keys, args

    # On a pipeline, by SHA (no SCRIPT EXISTS round trip per pipeline, as redis-py's
    # Script objects make); after a Redis restart the pipeline fails with NOSCRIPT, and
    # the caller runs `load_scripts()` and the pipeline again.
    def pipe_leave(self, pipe: Any, request_id: str, route: str, state: str, http_status: int | None, now: int, ended: int = 0) -> None:
        """A finish's leave, its reply 1 (not read)."""
        keys, args = self.leave_call(request_id, route, state, http_status, now, ended=ended)
        self._pipelined(pipe, self._leave, (keys, [*args, "1"]))

    def pipe_attempt(self, pipe: Any, call: tuple[list[Any], list[Any]]) -> None:
        """An attempt's end (``call``: `attempt_call`'s keys and arguments), its reply 1, not
        the record (not read)."""
        keys, args = call
        self._pipelined(pipe, self._attempt, (keys, [*args, "1"]))

    def pipe_decide(
        self,
        pipe: Any,
        request_id: str,
        route: str,
        tenant: str,
        deadline_ms: int,
        now: int,
        *,
        tenant_key: str | None,
        fingerprint: tuple[str, int, int] | None,
        backends: Sequence[str],
        retries: int = 0,
        budget: float | None = None,
        policy: Sequence[str],
    ) -> None:
        """A door's one script (scripts.DECIDE_LUA): the route's stats, a retry without an
        id matched to its first copy, the enqueue, the tenant's spend (``tenant_key``), a
        first copy listed under its retry fingerprint (``fingerprint``: the key, the
        request's retry count, its match_until in Unix ms), the backends' engine ages and the
        door's own figure of them, the id taken off the waiting set and put in the route's
        in-flight set, and the decision (``policy``: store.policy.policy_args; ``retries``:
        the count the request's headers say; ``budget``: the tenant's, None where it has
        none). Read it with `parse_decide`: a matched retry's id is its first copy's."""
        keys, args = self.enqueue_call(request_id, route, tenant, deadline_ms, now, now)
        args += [
            "1" if tenant_key else "0",
            str(fingerprint[1]) if fingerprint else "",
            int(fingerprint[2]) if fingerprint else 0,
            self.keys.record(""),
            len(backends),
            str(int(retries)),
            "" if budget is None else repr(float(budget)),
            *policy,
        ]
        if tenant_key:
            keys.append(tenant_key)
        if fingerprint:
            keys.append(fingerprint[0])
        keys.extend(self.keys.engine_age(b) for b in backends)
        if backends:
            keys.extend(self.keys.engine_waiting(b) for b in backends)
            keys.extend(self.keys.route_inflight(route))
        self._pipelined(pipe, self._decide, (keys, args))

    async def load_scripts(self) -> None:
        for script in (self._enqueue, self._leave, self._attempt, self._gc, self._decide):
            await self.redis.script_load(script.script)

    @staticmethod
    def _pipelined(pipe: Any, script: Any, call: tuple[list[Any], list[Any]]) -> None:
        keys, args = call
        pipe.evalsha(script.sha, len(keys), *keys, *args)

    async def enqueue(
        self,
        request_id: str,
        route: str,
        tenant: str,
        deadline_ms: int,
        enqueued_ms: int | None = None,
    ) -> QueueRecord:
        """Queue ``request_id`` on ``route``. An id already known (within the retention
        window) is a resent copy: its ``retry_count`` goes up by one and it keeps its
        first enqueue time and deadline. The returned record says which (``is_retry``)."""
        now = self.clock()
        keys, args = self.enqueue_call(request_id, route, tenant, deadline_ms, now if enqueued_ms is None else enqueued_ms, now)
        flat = await self._enqueue(keys=keys, args=args)
        record = QueueRecord.from_hash(request_id, flat)
        assert record is not None
        return record

    async def _route_of(self, request_id: str) -> str | None:
        route = await self.redis.hget(self.keys.record(request_id), "route")
        return text(route) if route is not None else None

    async def _leave_queue(self, request_id: str, route: str | None, state: str, http_status: int | None, only_if_waiting: bool) -> QueueRecord | None:
        route = route if route is not None else await self._route_of(request_id)
        if route is None:
            return None
        keys, args = self.leave_call(request_id, route, state, http_status, self.clock(), only_if_waiting)
        flat = await self._leave(keys=keys, args=args)
        return QueueRecord.from_hash(request_id, flat) if flat else None

    async def dequeue(self, request_id: str, route: str | None = None) -> QueueRecord | None:
        """The id leaves the waiting queue to be served (state ``running``); None if unknown.
        Passing ``route`` saves a round trip."""
        return await self._leave_queue(request_id, route, "running", None, False)

    async def pop_oldest(self, route: str) -> QueueRecord | None:
        """Take the oldest waiting id of ``route`` (state ``running``); None if empty.
        Concurrent callers never get the same id."""
        while True:
            ids = await self.redis.zrange(self.keys.route(route, "enqueued"), 0, 0)
            if not ids:
                return None
            record = await self._leave_queue(text(ids[0]), route, "running", None, True)
            if record is not None:
                return record
            # Someone else took it (or its record expired): drop a dangling id, try the next.
            await self.redis.zrem(self.keys.route(route, "enqueued"), text(ids[0]))

    async def complete(self, request_id: str, http_status: int | None = None, route: str | None = None) -> QueueRecord | None:
        """The id is finished (state ``done``); its record stays until the retention
        window ends so that a resent copy is still recognised as a retry."""
        return await self._leave_queue(request_id, route, "done", http_status, False)

    async def record_attempt(
        self,
        request_id: str,
        *,
        token_units: int = 0,
        http_status: int | None = None,
        retry_count: int | None = None,
        route: str | None = None,
    ) -> QueueRecord | None:
        """Count one upstream attempt of ``request_id``: its token units (added to the id's
        total), the HTTP status it got, and optionally the retry count the client or
        sidecar reports (kept if larger). None if the id is unknown."""
        if token_units < 0:
            raise ValueError("token_units must not be negative")
        route = route if route is not None else await self._route_of(request_id)
        if route is None:
            return None
        keys, args = self.attempt_call(request_id, route, token_units, http_status, retry_count, self.clock())
        flat = await self._attempt(keys=keys, args=args)
        return QueueRecord.from_hash(request_id, flat) if flat else None

    async def read(self, request_id: str) -> QueueRecord | None:
        """The record of an id, None if never seen or expired. The gate calls this to
        recognise a resent id as a retry before admitting it."""
        return QueueRecord.from_hash(request_id, await self.redis.hgetall(self.keys.record(request_id)))

    async def gc(self, route: str, now: int | None = None, limit: int = 1000) -> int:
        """Remove ids whose retention window has passed from ``route``'s sets; returns
        how many (at most ``limit``)."""
        cutoff = (now if now is not None else self.clock()) - self.retention_ms
        # KEYS[1] is unused by the script; the routes key keeps every key in the queue's slot (Cluster).
        return int(await self._gc(keys=[self.keys.routes(), *self.keys.route_keys(route)], args=[cutoff, limit]))

    async def routes(self) -> list[str]:
        return sorted(text(r) for r in await self.redis.smembers(self.keys.routes()))

    async def route_stats(self, route: str, now: int | None = None) -> RouteStats:
        """The exporter's numbers for one route, in one round trip."""
        t = now if now is not None else self.clock()
        pipe = self.redis.pipeline(transaction=False)
        add_route_stats_commands(pipe, self.keys, route, t)
        return parse_route_stats(await pipe.execute(), t)


ROUTE_STATS_COMMANDS = 6


def add_route_stats_commands(pipe: Any, keys: QueueKeys, route: str, now: int) -> None:
    """Queue the ROUTE_STATS_COMMANDS reads of one route on a pipeline: all O(1) or O(log n)."""
    enq, dl, retried, _live, dup = keys.route_keys(route)
    pipe.zcard(enq)
    pipe.zrange(enq, 0, 0, withscores=True)
    pipe.zrange(dl, 0, 0, withscores=True)
    pipe.zcount(dl, "-inf", now)
    pipe.zcard(retried)
    pipe.zrange(dup, -1, -1, withscores=True)


def parse_route_stats(replies: Sequence[Any], now: int) -> RouteStats:
    depth, oldest, tightest, past, retried, dup = replies[:ROUTE_STATS_COMMANDS]
    return RouteStats(
        depth=int(depth),
        oldest_age_ms=now - int(oldest[0][1]) if oldest else None,
        smallest_slack_ms=int(tightest[0][1]) - now if tightest else None,
        past_deadline=int(past),
        retried=int(retried),
        token_duplication_ratio_max=float(dup[0][1]) if dup else None,
    )


def engine_queue_age(values: list[Any]) -> int | None:
    """The engine queue age of a route from its backends' published figures (ms): the
    youngest known one, since a least-loaded balancer sends a new request to the shortest
    queue; None when none is known (absent or expired, never 0). A value that is not a
    non-negative integer is unknown."""
    known = []
    for v in values:
        text = v.decode() if isinstance(v, bytes) else v
        if isinstance(text, str) and text.isdigit() and len(text) <= 15:
            known.append(int(text))
    return min(known) if known else None


@dataclass(frozen=True)
class Decided:
    """`AdmissionQueue.pipe_decide`'s reply, read."""

    record: QueueRecord
    stats: RouteStats
    spent: float  # the tenant's spend this minute (0 when none)
    ages: list[Any]  # the backends' published engine ages (None where absent)
    door_age_ms: int | None  # the door's own figure (core.queue_age.door_age), None: unknown
    door_covers: bool  # the door sent everything the engines held (core.queue_age.door_covers)
    ahead: int | None = None  # the requests that must end before this one starts (core.queue_age.door_ahead), None: unknown
    slots: int | None = None  # the backends' sequences, the most each ran at once (core.queue_age.QueueAges.slots), None: unknown
    verdict: Verdict | None = None  # the decision (store.policy)
    figures: Figures | None = None  # what it was made on


def parse_decide(request_id: str, reply: Sequence[Any], now: int) -> Decided:
    """`AdmissionQueue.pipe_decide`'s reply: the record as enqueued (under the id the script
    used: ``request_id``, or the first copy a retry without an id was matched to), the
    route's stats as the request found them, the tenant's spend this minute (0 when none),
    the engine ages and the door's own figure."""
    stats, flat, spent, ages, used, door, covers, ahead, slots, verdict, figures = reply
    if used is not None:
        request_id = text(used)

    def score(value: Any) -> int | None:
        return int(float(value)) if value not in (b"", "", None) else None

    oldest, tightest, dup = score(stats[1]), score(stats[2]), stats[5]
    route_stats = RouteStats(
        depth=int(stats[0]),
        oldest_age_ms=now - oldest if oldest is not None else None,
        smallest_slack_ms=tightest - now if tightest is not None else None,
        past_deadline=int(stats[3]),
        retried=int(stats[4]),
        token_duplication_ratio_max=float(dup) if dup not in (b"", "", None) else None,
    )
    route, tenant, enqueued, deadline, retries, attempts, units, most, status, state = flat
    record = QueueRecord(
        request_id,
        text(route),
        text(tenant),
        int(enqueued),
        int(deadline),
        int(retries),
        int(attempts),
        int(units),
        int(most),
        int(status) if status else None,
        text(state),
    )
    door_ms = int(door) if door is not None and door is not False else None

    def count(value: Any) -> int | None:
        return int(value) if value is not None and value is not False else None

    got = (count(ahead), count(slots), Verdict.read(verdict), Figures.read(figures))
    return Decided(record, route_stats, float(spent or 0), list(ages or []), door_ms, bool(covers), *got)
