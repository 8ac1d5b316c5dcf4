"""The `Deployment` interface: what every Redis user of the package asks of its Redis,
one server, Sentinel or Cluster alike, and what the three kinds share. Each kind is a
class of its own (store.deployment_single, store.deployment_sentinel,
store.deployment_cluster) that overrides what differs; store.deployment picks one by the
URL's scheme. No method asks which kind it runs on: a kind's difference is a method of
its class.

The defaults here are those of a deployment whose client reaches its one primary (one
server, and Sentinel's primary-following client): commands on ``client``, keys as given,
no slot map. `ClusterDeployment` overrides them with routing by slot.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import NoScriptError, ResponseError

from .bulk import BulkReads
from .connection import text
from .errors import ERRORS, NotReplicated, retryable
from .keys import LeaseKeys, QueueKeys
from .target import RedisTarget

# What a node client takes from a wrapped client's settings (`around`).
NODE_KEYS = ("decode_responses", "socket_timeout", "socket_connect_timeout", "username", "password", "encoding")


def sha1(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


def node_kwargs_of(settings: dict[str, Any]) -> dict[str, Any]:
    """A node client's settings, from a redis-py client's own: no retries."""
    return {**{k: v for k, v in settings.items() if k in NODE_KEYS}, "retry": Retry(NoBackoff(), 0)}


@dataclass(frozen=True)
class Dialing:
    """What `connect` was asked for: commands time out after ``socket_timeout``; a broken
    connection is retried ``retries`` times; ``max_connections`` with ``blocking_timeout``
    (one server only, the gate's bound) makes a caller wait for a free connection."""

    socket_timeout: float = 5.0
    retries: int = 3
    max_connections: int | None = None
    blocking_timeout: float | None = None

    def retry(self) -> Retry:
        return Retry(ExponentialBackoff(cap=0.5, base=0.02), self.retries) if self.retries else Retry(NoBackoff(), 0)

    def common(self, target: RedisTarget) -> dict[str, Any]:
        """The data nodes' settings every kind's client takes."""
        return {
            "decode_responses": True,
            "socket_timeout": self.socket_timeout,
            "socket_connect_timeout": self.socket_timeout,
            "username": target.username,
            "password": target.password,
        }

    def node_kwargs(self, target: RedisTarget) -> dict[str, Any]:
        """A plain client on one node (`Deployment.node`): no retries."""
        kw = {**self.common(target), "retry": Retry(NoBackoff(), 0)}
        if target.tls:
            kw["ssl"] = True
        return kw


class Deployment(abc.ABC):
    """A connected Redis deployment. Make one with :func:`store.deployment.connect`."""

    kind: ClassVar[str]  # as store.target names it: "single", "sentinel" or "cluster"
    schemes: ClassVar[tuple[str, ...]]  # the URL schemes that make this kind
    # Whether one script may touch any of the package's keys: True where they all live on
    # one primary; False on Cluster, where a script's keys must share a hash slot.
    one_keyspace: ClassVar[bool] = True

    def __init__(self, target: RedisTarget, client: Any, *, node_kwargs: dict[str, Any]):
        self.target = target
        self.client = client
        self.db = target.db
        self.wait_replicas = target.wait_replicas
        self.wait_timeout_ms = target.wait_timeout_ms
        self._node_kwargs = node_kwargs
        self._nodes: dict[tuple[str, int], aioredis.Redis] = {}
        self.failovers_seen = 0  # Cluster: topology changes followed; Sentinel: primaries changed

    @classmethod
    @abc.abstractmethod
    def open(cls, target: RedisTarget, dialing: Dialing) -> Self:
        """This kind's client for ``target``."""

    # ------------------------------------------------------------------ key layout

    def tag(self, part: str) -> str:
        """``part`` as a hash tag where keys must share a slot (Cluster), as is elsewhere."""
        return part

    def lease_keys(self, keys: LeaseKeys | None = None) -> LeaseKeys:
        return keys or LeaseKeys()

    def queue_keys(self, prefix: str) -> QueueKeys:
        return QueueKeys(prefix)

    def bulk_reads(self, keys: LeaseKeys) -> BulkReads:
        """The exporter view's batch reads of leases, TIME and key scans, as this kind needs."""
        return BulkReads(keys, self.client)

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
            cmds = [_as_eval(c) for c in cmds]
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
                await self._too_few_acknowledged()
                raise NotReplicated(acked, wanted, self.wait_timeout_ms, replies)
        return replies

    async def replicas_wanted(self) -> int:
        """How many replicas a confirmed write waits for: the URL's `wait_replicas`."""
        return self.wait_replicas

    async def _too_few_acknowledged(self) -> None:
        """A confirmed write that too few replicas acknowledged, before NotReplicated.
        After `SENTINEL FAILOVER` the old primary lives on, demoted only seconds later, and
        pooled connections to it still take writes; no replica follows it any more. Leave
        it so the caller's retry reaches the new one."""
        await self.follow_primary()

    async def follow_primary(self) -> bool:
        """Ask where the primary is now and leave any other server; True if it moved.
        Only Sentinel's primary moves under the same client."""
        return False

    async def script(self, lua: str, keys: Sequence[str], args: Sequence[Any], *, confirm: bool = True) -> Any:
        """Run a Lua script on the primary owning its first key (all its keys share a
        slot on Cluster), confirmed by ``WAIT`` like :meth:`run_confirmed`."""
        digest = sha1(lua)
        _SCRIPTS[digest] = lua
        (reply,) = await self.run_confirmed(keys[0], [("EVALSHA", digest, len(keys), *keys, *args)], confirm=confirm)
        return reply

    async def _send(self, key: str, cmds: list[tuple[Any, ...]]) -> list[Any]:
        """The commands on one connection of ``client`` (its primary), error replies returned."""
        if len(cmds) == 1:  # the hot path (a claim without WAIT): no pipeline object to build
            return [await one_command(self.client, cmds[0])]
        pipe = self.client.pipeline(transaction=False)
        for c in cmds:
            pipe.execute_command(*c)
        return list(await pipe.execute(raise_on_error=False))

    async def pipeline_for(self, key: str) -> Any:
        """A plain pipeline (no transaction) on the primary owning ``key``."""
        return self.client.pipeline(transaction=False)

    # ------------------------------------------------------------------ nodes and topology

    def node(self, host: str, port: int) -> aioredis.Redis:
        """A plain client on one Cluster node (or the one server), no retries: what runs
        on it must see a broken connection."""
        client = self._nodes.get((host, port))
        if client is None:
            client = aioredis.Redis(host=host, port=port, **self._node_kwargs)
            self._nodes[(host, port)] = client
        return client

    def primary_client(self, host: str, port: int) -> Any:
        """A client whose commands run on the primary at ``host:port`` (one of
        :meth:`primaries`): here ``client``, which reaches the one primary."""
        return self.client

    def server_pool(self) -> Any:
        """The connection pool of the one server the deployment is, None where the client
        follows a primary or a slot map (Sentinel, Cluster)."""
        return None

    async def refresh_topology(self) -> bool:
        """Ask the slot map again (a MOVED, a failed node); False where there is none to
        ask (one server, Sentinel): a MOVED there is an answer, not a redirect."""
        return False

    @abc.abstractmethod
    async def primaries(self) -> list[tuple[str, int]]:
        """The primaries holding the data, as (host, port)."""

    async def server_ms(self, key: str | None = None) -> int:
        """A Redis server's clock, Unix ms: that of the primary owning ``key`` (the node
        whose data the time is compared with), else of the first primary."""
        sec, usec = await self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def config_get(self, name: str) -> dict[str, str]:
        """``CONFIG GET name`` on every primary: {"host:port": value}. A primary that
        refuses CONFIG (managed Redis) is left out."""
        out: dict[str, str] = {}
        for host, port in await self.primaries():
            try:
                reply = await self.primary_client(host, port).config_get(name)
            except ResponseError:
                continue
            out[f"{host}:{port}"] = text(next(iter(reply.values()), "")) if reply else ""
        return out

    async def startup_warnings(self) -> list[str]:
        """What the docs recommend for a replicated deployment and this one does not do,
        where readable."""
        notes: list[str] = []
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

    @abc.abstractmethod
    def keyevent_subscriber(self, on_event: Callable[[str, str], None], **kw: Any) -> Any:
        """The `del`/`expired` keyevent feed for this deployment (see store.deployment):
        a :class:`~store.feed.KeyeventSubscriber`, or one with the same interface."""

    async def aclose(self) -> None:
        for client in self._nodes.values():
            with contextlib.suppress(Exception):
                await client.aclose()
        self._nodes.clear()
        with contextlib.suppress(Exception):
            await self.client.aclose()


# Lua bodies by SHA1, for the NOSCRIPT fallback: every script sent by `script()`.
_SCRIPTS: dict[str, str] = {}


def _as_eval(cmd: tuple[Any, ...]) -> tuple[Any, ...]:
    if cmd and cmd[0] == "EVALSHA":
        body = _SCRIPTS.get(cmd[1])
        if body is not None:
            return ("EVAL", body, *cmd[2:])
    return cmd


async def one_command(client: Any, cmd: tuple[Any, ...]) -> Any:
    """One command without a pipeline; an error reply returned, as a pipeline gives it."""
    try:
        return await client.execute_command(*cmd)
    except ResponseError as exc:
        return exc
