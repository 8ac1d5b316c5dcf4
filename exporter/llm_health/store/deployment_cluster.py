"""Redis Cluster (`redis+cluster://`, `rediss+cluster://`): redis-py's `RedisCluster` for
ordinary commands, which follows slot moves. Keys that one script touches share a hash
tag (each GPU's, the whole queue's). A confirmed write goes on one connection to the
primary owning its key and follows `MOVED`, `ASK` (with `ASKING` on the same
connection), `TRYAGAIN` and failovers itself; the keyevent feed is one subscription
per primary (store.cluster_events)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Self

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterDownError, MovedError, SlotNotCoveredError, TryAgainError

from .bulk import BulkReads, ClusterBulkReads
from .cluster_events import ClusterKeyevents
from .connection import TRANSIENT, text
from .deployment_base import Deployment, Dialing, node_kwargs_of, one_command
from .errors import ERRORS
from .keys import LeaseKeys, QueueKeys
from .target import CLUSTER_SCHEMES, RedisTarget

CLUSTER_REDIRECTS = 16  # MOVED/ASK/TRYAGAIN hops one confirmed write may follow


class ClusterDeployment(Deployment):
    kind = "cluster"
    schemes = CLUSTER_SCHEMES
    one_keyspace = False

    @classmethod
    def open(cls, target: RedisTarget, dialing: Dialing) -> Self:
        ckw: dict[str, Any] = {**dialing.common(target), "retry": dialing.retry()}
        if target.tls:
            ckw["ssl"] = True
        cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in target.hosts], **ckw)
        return cls(target, cluster, node_kwargs=dialing.node_kwargs(target))

    @classmethod
    def around(cls, client: RedisCluster) -> Self:
        """A ``RedisCluster`` made elsewhere: the Cluster layout and routing, WAIT for one replica."""
        hosts = tuple((str(n.host), int(n.port)) for n in client.get_nodes()) or (("127.0.0.1", 6379),)
        target = RedisTarget("cluster", url="redis+cluster://" + ",".join(f"{h}:{p}" for h, p in hosts), hosts=hosts, wait_replicas=1)
        return cls(target, client, node_kwargs=node_kwargs_of(getattr(client.nodes_manager, "connection_kwargs", {})))

    # ------------------------------------------------------------------ key layout

    def tag(self, part: str) -> str:
        return "{" + part + "}"

    def lease_keys(self, keys: LeaseKeys | None = None) -> LeaseKeys:
        return super().lease_keys(keys).tagged()

    def queue_keys(self, prefix: str) -> QueueKeys:
        return super().queue_keys(prefix).tagged()

    def bulk_reads(self, keys: LeaseKeys) -> BulkReads:
        return ClusterBulkReads(keys, self.client)

    # ------------------------------------------------------------------ routing by slot

    async def _send(self, key: str, cmds: list[tuple[Any, ...]]) -> list[Any]:
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
            return [await one_command(self.node(*addr), cmds[0])]
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

    async def pipeline_for(self, key: str) -> Any:
        """redis-py's cluster pipeline refuses EVALSHA: a plain pipeline on the primary
        owning ``key``'s slot."""
        await self.client.initialize()  # the slot map, once
        node = self.client.get_node_from_key(key)
        return self.node(node.host, node.port).pipeline(transaction=False)

    # ------------------------------------------------------------------ nodes and topology

    def primary_client(self, host: str, port: int) -> Any:
        return self.node(host, port)

    async def refresh_topology(self) -> bool:
        with contextlib.suppress(*ERRORS):
            await self.client.initialize()  # the client's first slot map and command table, once
            await self.client.nodes_manager.initialize()
        return True

    async def primaries(self) -> list[tuple[str, int]]:
        """The primaries serving slots, asked from a node that answers."""
        for host, port in [*self._known_nodes(), *self.target.hosts]:
            try:
                slots = await self.node(host, port).execute_command("CLUSTER", "SLOTS")
            except ERRORS:
                continue
            found = {(text(s[2][0]) or host, int(s[2][1])) for s in slots}
            return sorted(found)
        raise ClusterDownError("no Cluster node answered CLUSTER SLOTS")

    def _known_nodes(self) -> list[tuple[str, int]]:
        try:
            return [(n.host, n.port) for n in self.client.get_primaries()]
        except Exception:
            return []

    async def server_ms(self, key: str | None = None) -> int:
        if key is not None:
            (reply,) = await self.run_confirmed(key, [("TIME",)], confirm=False)
            sec, usec = reply
        else:
            host, port = (await self.primaries())[0]
            sec, usec = await self.node(host, port).time()
        return int(sec) * 1000 + int(usec) // 1000

    def keyevent_subscriber(self, on_event: Callable[[str, str], None], **kw: Any) -> ClusterKeyevents:
        """One subscription per primary, following topology changes."""
        return ClusterKeyevents(self, on_event, **kw)
