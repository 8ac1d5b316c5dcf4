"""The one door to Redis: one server, Sentinel or Cluster, behind one interface.

Every Redis user of the package (lease client and heartbeat, waiters, reconcile, the
queue and the gate, the exporter's view, the restarter's shared state) gets its client
here, from the URL alone (`store.target`), and asks this module for the three things
that differ between deployments:

- `client`: the redis-py client for ordinary commands and pipelines (`Redis`, a
  Sentinel-managed `Redis` that follows the primary, or `RedisCluster` that follows
  slot moves);
- `run_confirmed(key, commands)`: commands sent on ONE connection to the primary that
  owns `key`, followed there by `WAIT` when the deployment has replicas to wait for: a
  write counts only once a replica has it (`NotReplicated` otherwise, with the replies,
  so the caller can undo it). On Cluster this follows `MOVED`, `ASK` (with `ASKING` on
  the same connection), `TRYAGAIN` and failovers itself; a script's `NOSCRIPT` (a
  primary that lost its script cache in a failover) is answered by sending the body;
- `keyevent_subscriber(...)`: the `del`/`expired` keyevent feed, which is node-local:
  one subscription on one server; on Sentinel one that leaves a server that is no longer
  the primary; on Cluster one per primary, following topology changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis import asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import AskError, ClusterDownError, MovedError, NoScriptError, ResponseError, SlotNotCoveredError, TryAgainError

from .bulk import BulkReads, ClusterBulkReads
from .cluster_events import ClusterKeyevents
from .connection import FEED_CLIENT_NAME, TRANSIENT, text
from .errors import ERRORS, NotReplicated, retryable
from .feed import KeyeventSubscriber
from .keys import LeaseKeys, QueueKeys
from .target import ALL_REPLICAS, RedisTarget, parse_target

log = logging.getLogger(__name__)

REPLICAS_RECHECK_S = 5.0  # wait_replicas=all: how often Sentinel is asked for the replicas
CLUSTER_REDIRECTS = 16  # MOVED/ASK/TRYAGAIN hops one confirmed write may follow


def sha1(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


class Deployment:
    """A connected Redis deployment. Make one with :func:`connect`."""

    def __init__(self, target: RedisTarget, client: Any, *, node_kwargs: dict[str, Any], sentinel: Sentinel | None = None):
        self.target = target
        self.kind = target.kind
        self.client = client
        self.db = target.db
        self.wait_replicas = target.wait_replicas
        self._replicas = 1  # wait_replicas=all: the last count Sentinel gave
        self._replicas_at = 0.0
        self.wait_timeout_ms = target.wait_timeout_ms
        self.sentinel = sentinel
        self._node_kwargs = node_kwargs
        self._nodes: dict[tuple[str, int], aioredis.Redis] = {}
        self.failovers_seen = 0  # Cluster: topology changes followed; Sentinel: primaries changed

    # ------------------------------------------------------------------ key layout

    @property
    def cluster(self) -> bool:
        return self.kind == "cluster"

    def tag(self, part: str) -> str:
        """``part`` as a hash tag on Cluster (its keys share a slot), as is elsewhere."""
        return "{" + part + "}" if self.cluster else part

    def lease_keys(self, keys: LeaseKeys | None = None) -> LeaseKeys:
        keys = keys or LeaseKeys()
        return keys.tagged() if self.cluster else keys

    def bulk_reads(self, keys: LeaseKeys) -> BulkReads:
        """The exporter view's batch reads of leases, TIME and key scans, as this kind needs."""
        return (ClusterBulkReads if self.cluster else BulkReads)(keys, self.client)

    def queue_keys(self, prefix: str) -> QueueKeys:
        keys = QueueKeys(prefix)
        return keys.tagged() if self.cluster else keys

    def describe(self) -> str:
        return self.target.describe()

    # ------------------------------------------------------------------ writes that count

    async def run_confirmed(self, key: str, commands: Sequence[Sequence[Any]], *, confirm: bool = True) -> list[Any]:
        """Send ``commands`` on one connection to the primary owning ``key`` and, when
        ``confirm`` and the deployment waits for replicas, ``WAIT`` after them. Returns
        their replies; raises the first error reply, or NotReplicated."""
        wanted = await self.replicas_wanted() if confirm else 0
        wait = wanted > 0
        cmds = [tuple(c) for c in commands]
        if wait:
            cmds.append(("WAIT", wanted, self.wait_timeout_ms))
        replies = await self._send(key, cmds)
        if any(isinstance(r, NoScriptError) for r in replies):
            # The primary has no copy of a script (a failover, a restart): send the bodies.
            cmds = [self._as_eval(c) for c in cmds]
            replies = await self._send(key, cmds)
        if wait and isinstance(replies[-1], ResponseError) and str(replies[-1]).startswith("UNBLOCKED"):
            # The server stopped being a primary while WAIT blocked (a failover demoted
            # it): nothing was confirmed, the same as no replica acknowledging.
            replies[-1] = 0
        for r in replies:
            if isinstance(r, Exception):
                if retryable(r):
                    # NOREPLICAS, READONLY, ... from a server that may no longer be the
                    # primary (after `SENTINEL FAILOVER` the old one stays a primary with
                    # no replica for ~10 s): the caller's retry must reach the new one.
                    await self.follow_primary()
                raise r
        if wait:
            acked = int(replies[-1])
            replies = replies[:-1]
            if acked < wanted:
                # Sentinel: after `SENTINEL FAILOVER` the old primary lives on, demoted only
                # seconds later, and pooled connections to it still take writes; no replica
                # follows it any more. Leave it so the caller's retry reaches the new one.
                await self.follow_primary()
                self._replicas_at = 0.0  # ask Sentinel again: a replica may have gone
                raise NotReplicated(acked, wanted, self.wait_timeout_ms, replies)
        return replies

    async def replicas_wanted(self) -> int:
        """How many replicas a confirmed write waits for. `wait_replicas=all` (the Sentinel
        default): every replica Sentinel lists as up, asked again every 5 s and after a
        write that too few acknowledged. With one of two, a forced failover can promote the
        replica that did not have a claim, while the old primary still counts the other
        (the chaos test saw acknowledged claims lost and tokens go backwards)."""
        if self.wait_replicas != ALL_REPLICAS:
            return self.wait_replicas
        now = time.monotonic()
        if self.sentinel is not None and now - self._replicas_at > REPLICAS_RECHECK_S:
            with contextlib.suppress(*ERRORS):
                self._replicas = max(1, len(await self.sentinel.discover_slaves(str(self.target.service))))
                self._replicas_at = now
        return self._replicas

    async def follow_primary(self) -> bool:
        """Sentinel: ask where the primary is and drop pooled connections to any other
        server (redis-py's pool does this on a lookup). True if it moved."""
        if self.sentinel is None:
            return False
        pool = self.client.connection_pool
        before = getattr(pool, "master_address", None)
        with contextlib.suppress(*ERRORS):
            after = await pool.get_master_address()
            if before is not None and tuple(after) != tuple(before):
                self.failovers_seen += 1
                log.warning("redis: the Sentinel primary moved from %s:%s to %s:%s; following it", *before, *after)
                return True
        return False

    async def script(self, lua: str, keys: Sequence[str], args: Sequence[Any], *, confirm: bool = True) -> Any:
        """Run a Lua script on the primary owning its first key (all its keys share a
        slot on Cluster), confirmed by ``WAIT`` like :meth:`run_confirmed`."""
        digest = sha1(lua)
        _SCRIPTS[digest] = lua
        (reply,) = await self.run_confirmed(keys[0], [("EVALSHA", digest, len(keys), *keys, *args)], confirm=confirm)
        return reply

    def _as_eval(self, cmd: tuple[Any, ...]) -> tuple[Any, ...]:
        if cmd and cmd[0] == "EVALSHA":
            body = _SCRIPTS.get(cmd[1])
            if body is not None:
                return ("EVAL", body, *cmd[2:])
        return cmd

    async def _send(self, key: str, cmds: list[tuple[Any, ...]]) -> list[Any]:
        if not self.cluster:
            if len(cmds) == 1:  # the hot path (a claim without WAIT): no pipeline object to build
                return [await _direct(self.client, cmds[0])]
            pipe = self.client.pipeline(transaction=False)
            for c in cmds:
                pipe.execute_command(*c)
            return list(await pipe.execute(raise_on_error=False))
        return await self._send_cluster(key, cmds)

    async def _send_cluster(self, key: str, cmds: list[tuple[Any, ...]]) -> list[Any]:
        asking: tuple[str, int] | None = None
        delay = 0.02
        deadline = time.monotonic() + max(2.0, float(self._node_kwargs.get("socket_timeout") or 2.0) * 2)
        last: BaseException | None = None
        for _ in range(CLUSTER_REDIRECTS):
            if asking is not None:
                addr = asking
            else:
                node = self._node_for(key)
                if node is None:
                    await self.refresh_topology()
                    node = self._node_for(key)
                if node is None:
                    raise ClusterDownError(f"no primary serves the slot of {key!r}")
                addr = (node.host, node.port)
            try:
                replies = await self._on_node(addr, cmds, asking is not None)
            except TRANSIENT as exc:  # the node died or is failing over
                last = exc
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                await self.refresh_topology()
                asking = None
                continue
            first = replies[0] if replies else None
            if isinstance(first, MovedError):
                await self.refresh_topology()
                asking = None
                continue
            if isinstance(first, AskError):
                asking = (first.host, first.port)
                continue
            if isinstance(first, (TryAgainError, ClusterDownError)):
                last = first
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
                asking = None
                continue
            return replies
        raise last if last is not None else ClusterDownError(f"gave up after {CLUSTER_REDIRECTS} redirects for {key!r}")

    async def _on_node(self, addr: tuple[str, int], cmds: list[tuple[Any, ...]], asking: bool) -> list[Any]:
        """The commands on one node's connection (after ASKING, whose reply is not returned)."""
        if not asking and len(cmds) == 1:
            return [await _direct(self.node(*addr), cmds[0])]
        pipe = self.node(*addr).pipeline(transaction=False)
        if asking:
            pipe.execute_command("ASKING")
        for c in cmds:
            pipe.execute_command(*c)
        replies = list(await pipe.execute(raise_on_error=False))
        return replies[1:] if asking else replies

    def _node_for(self, key: str) -> Any:
        """The primary serving ``key``'s slot by the client's slot map, None if the map has
        none (redis-py raises SlotNotCoveredError, no RedisError, where the map is empty:
        a client that has not loaded it yet, or a refresh made while the slot had no primary)."""
        try:
            return self.client.get_node_from_key(key)
        except SlotNotCoveredError:
            return None

    # ------------------------------------------------------------------ nodes and topology

    def node(self, host: str, port: int) -> aioredis.Redis:
        """A plain client on one Cluster node (or the one server), no retries: what runs
        on it must see a broken connection."""
        client = self._nodes.get((host, port))
        if client is None:
            client = aioredis.Redis(host=host, port=port, **self._node_kwargs)
            self._nodes[(host, port)] = client
        return client

    async def refresh_topology(self) -> None:
        if self.cluster:
            with contextlib.suppress(*ERRORS):
                await self.client.initialize()  # the client's first slot map and command table, once
                await self.client.nodes_manager.initialize()

    async def primaries(self) -> list[tuple[str, int]]:
        """The primaries serving slots (Cluster, asked from a node that answers), the
        primary Sentinel names, or the one server."""
        if self.cluster:
            for host, port in [*(n for n in self._known_nodes()), *self.target.hosts]:
                try:
                    slots = await self.node(host, port).execute_command("CLUSTER", "SLOTS")
                except ERRORS:
                    continue
                found = {(text(s[2][0]) or host, int(s[2][1])) for s in slots}
                return sorted(found)
            raise ClusterDownError("no Cluster node answered CLUSTER SLOTS")
        if self.sentinel is not None:
            host, port = await self.sentinel.discover_master(str(self.target.service))
            return [(str(host), int(port))]
        kw = self.client.connection_pool.connection_kwargs
        return [(str(kw.get("host") or kw.get("path") or "localhost"), int(kw.get("port") or 0))]

    def _known_nodes(self) -> list[tuple[str, int]]:
        try:
            return [(n.host, n.port) for n in self.client.get_primaries()]
        except Exception:
            return []

    async def server_ms(self, key: str | None = None) -> int:
        """A Redis server's clock, Unix ms: on Cluster that of the primary owning ``key``
        (the node whose data the time is compared with), else of the first primary."""
        if self.cluster and key is not None:
            (reply,) = await self.run_confirmed(key, [("TIME",)], confirm=False)
            sec, usec = reply
        elif self.cluster:
            host, port = (await self.primaries())[0]
            sec, usec = await self.node(host, port).time()
        else:
            sec, usec = await self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def config_get(self, name: str) -> dict[str, str]:
        """``CONFIG GET name`` on every primary: {"host:port": value}. A primary that
        refuses CONFIG (managed Redis) is left out."""
        out: dict[str, str] = {}
        for host, port in await self.primaries():
            client = self.node(host, port) if self.cluster else self.client
            try:
                reply = await client.config_get(name)
            except ResponseError:
                continue
            out[f"{host}:{port}"] = text(next(iter(reply.values()), "")) if reply else ""
        return out

    async def startup_warnings(self) -> list[str]:
        """What the docs recommend and this deployment does not do, where readable."""
        notes: list[str] = []
        if self.kind == "single":
            return notes
        if self.wait_replicas == 0:
            notes.append(
                f"{self.kind}: wait_replicas=0, so a claim acknowledged by a primary that dies before replicating it is lost and the GPU can be claimed twice"
            )
        with contextlib.suppress(*ERRORS):
            for where, value in (await self.config_get("min-replicas-to-write")).items():
                if value in ("", "0"):
                    notes.append(f"{where}: min-replicas-to-write is 0; set it to 1 so a primary cut off from its replicas stops accepting writes")
        return notes

    # ------------------------------------------------------------------ keyevents

    def keyevent_subscriber(self, on_event: Callable[[str, str], None], **kw: Any) -> Any:
        """The `del`/`expired` keyevent feed for this deployment (see module docstring):
        a :class:`KeyeventSubscriber`, or for Cluster a :class:`ClusterKeyevents` with
        the same interface."""
        if self.cluster:
            return ClusterKeyevents(self, on_event, **kw)
        if self.sentinel is not None:
            sub = self.sentinel.master_for(
                str(self.target.service),
                redis_class=aioredis.Redis,
                db=self.db,
                retry=Retry(NoBackoff(), 0),
                socket_timeout=None,
                decode_responses=True,
                client_name=FEED_CLIENT_NAME,
            )
            return KeyeventSubscriber(self.client, self.db, on_event, sub_redis=sub, still_valid=self._on_primary, **kw)
        return KeyeventSubscriber(self.client, self.db, on_event, **kw)

    async def _on_primary(self, pubsub: Any) -> bool:
        """Sentinel: is this subscription still on the primary? (After a failover the old
        primary may live on as a replica, and its connections stay open.)"""
        conn = getattr(pubsub, "connection", None)
        if conn is None or self.sentinel is None:
            return True
        try:
            host, port = await self.sentinel.discover_master(str(self.target.service))
        except ERRORS:
            return True  # cannot tell now: keep it
        same = (str(conn.host), int(conn.port)) == (str(host), int(port))
        if not same:
            await self.follow_primary()  # the command pool too, not only this feed
        return same

    async def aclose(self) -> None:
        for client in self._nodes.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._nodes.clear()
        with contextlib.suppress(Exception):
            await self.client.aclose()
        if self.sentinel is not None:
            for s in self.sentinel.sentinels:
                with contextlib.suppress(Exception):
                    await s.aclose()


# Lua bodies by SHA1, for the NOSCRIPT fallback: every script sent by `script()`.
_SCRIPTS: dict[str, str] = {}


async def _direct(client: Any, cmd: tuple[Any, ...]) -> Any:
    """One command without a pipeline; an error reply returned, as a pipeline gives it."""
    try:
        return await client.execute_command(*cmd)
    except ResponseError as exc:
        return exc


def connect(
    url: str | RedisTarget,
    *,
    socket_timeout: float = 5.0,
    retries: int = 3,
    max_connections: int | None = None,
    blocking_timeout: float | None = None,
) -> Deployment:
    """A Deployment for ``url`` (any of the forms of `store.target`). Commands time out
    after ``socket_timeout``; a broken connection is retried ``retries`` times (every
    write of the package is idempotent, so a retry after a lost reply is safe).
    ``max_connections`` with ``blocking_timeout`` (one server only, the gate's bound):
    a caller waits that long for a free connection instead of opening more."""
    target = url if isinstance(url, RedisTarget) else parse_target(url)
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.02), retries) if retries else Retry(NoBackoff(), 0)
    common: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
        "username": target.username,
        "password": target.password,
    }
    node_kwargs = {**common, "retry": Retry(NoBackoff(), 0)}
    if target.tls:
        node_kwargs["ssl"] = True
    if target.kind == "single":
        pool_kw: dict[str, Any] = {"decode_responses": True, "socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout, "retry": retry}
        if max_connections and blocking_timeout is not None:
            pool = aioredis.BlockingConnectionPool.from_url(target.single_url, max_connections=max_connections, timeout=blocking_timeout, **pool_kw)
            return Deployment(target, aioredis.Redis(connection_pool=pool), node_kwargs=node_kwargs)
        if max_connections:
            pool_kw["max_connections"] = max_connections
        client = aioredis.Redis.from_url(target.single_url, **pool_kw)
        return Deployment(target, client, node_kwargs=node_kwargs)
    if target.kind == "sentinel":
        sentinel_kwargs: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout, "decode_responses": True}
        if target.sentinel_password:
            sentinel_kwargs["password"] = target.sentinel_password
        kw = {**common, "retry": retry, "ssl": target.tls}
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs, **kw)
        client = sentinel.master_for(str(target.service), db=target.db)
        return Deployment(target, client, node_kwargs=node_kwargs, sentinel=sentinel)
    ckw: dict[str, Any] = {**common, "retry": retry}
    if target.tls:
        ckw["ssl"] = True
    cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.hosts], **ckw)
    return Deployment(target, cluster, node_kwargs=node_kwargs)


def wrap(client: Any) -> Deployment:
    """A Deployment around a redis-py client made elsewhere: a ``Redis`` (one server, or
    a Sentinel ``master_for`` client: no WAIT unless given a Deployment) or a
    ``RedisCluster`` (the Cluster layout and routing, WAIT for one replica)."""
    if isinstance(client, RedisCluster):
        hosts = tuple((str(n.host), int(n.port)) for n in client.get_nodes()) or (("127.0.0.1", 6379),)
        target = RedisTarget("cluster", url="redis+cluster://" + ",".join(f"{h}:{p}" for h, p in hosts), hosts=hosts, wait_replicas=1)
        kw = {k: v for k, v in getattr(client.nodes_manager, "connection_kwargs", {}).items() if k in _NODE_KEYS}
        return Deployment(target, client, node_kwargs={**kw, "retry": Retry(NoBackoff(), 0)})
    pool_kw = client.connection_pool.connection_kwargs
    target = RedisTarget("single", url="redis://wrapped", db=int(pool_kw.get("db", 0) or 0))
    kw = {k: v for k, v in pool_kw.items() if k in _NODE_KEYS}
    return Deployment(target, client, node_kwargs={**kw, "retry": Retry(NoBackoff(), 0)})


_NODE_KEYS = ("decode_responses", "socket_timeout", "socket_connect_timeout", "username", "password", "encoding")
