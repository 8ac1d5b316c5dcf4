"""A Sentinel-watched primary (`redis+sentinel://`, `rediss+sentinel://`): redis-py's
`Sentinel` and a `master_for` client that follows the primary. A confirmed write waits
for every replica Sentinel lists as up (`wait_replicas=all`, the default); after a
failover the old primary may live on, demoted only seconds later, so a write refused or
too little acknowledged, and a keyevent subscription, leave a server that is no longer
the primary."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Self

from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from .connection import FEED_CLIENT_NAME
from .deployment_base import Deployment, Dialing
from .errors import ERRORS
from .feed import KeyeventSubscriber
from .target import ALL_REPLICAS, SENTINEL_SCHEMES, RedisTarget

log = logging.getLogger(__name__)

REPLICAS_RECHECK_S = 5.0  # wait_replicas=all: how often Sentinel is asked for the replicas


class SentinelDeployment(Deployment):
    kind = "sentinel"
    schemes = SENTINEL_SCHEMES

    def __init__(self, target: RedisTarget, client: Any, *, node_kwargs: dict[str, Any], sentinel: Sentinel):
        super().__init__(target, client, node_kwargs=node_kwargs)
        self.sentinel = sentinel
        self.service = str(target.service)
        self._replicas = 1  # wait_replicas=all: the last count Sentinel gave
        self._replicas_at = 0.0

    @classmethod
    def open(cls, target: RedisTarget, dialing: Dialing) -> Self:
        sentinel_kwargs: dict[str, Any] = {
            "socket_timeout": dialing.socket_timeout,
            "socket_connect_timeout": dialing.socket_timeout,
            "decode_responses": True,
        }
        if target.sentinel_password:
            sentinel_kwargs["password"] = target.sentinel_password
        kw = {**dialing.common(target), "retry": dialing.retry(), "ssl": target.tls}
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs, **kw)
        client = sentinel.master_for(str(target.service), db=target.db)
        return cls(target, client, node_kwargs=dialing.node_kwargs(target), sentinel=sentinel)

    async def replicas_wanted(self) -> int:
        """`wait_replicas=all` (the default): every replica Sentinel lists as up, asked
        again every 5 s and after a write that too few acknowledged. With one of two, a
        forced failover can promote the replica that did not have a claim, while the old
        primary still counts the other (the chaos test saw acknowledged claims lost and
        tokens go backwards)."""
        if self.wait_replicas != ALL_REPLICAS:
            return self.wait_replicas
        now = time.monotonic()
        if now - self._replicas_at > REPLICAS_RECHECK_S:
            with contextlib.suppress(*ERRORS):
                self._replicas = max(1, len(await self.sentinel.discover_slaves(self.service)))
                self._replicas_at = now
        return self._replicas

    async def _too_few_acknowledged(self) -> None:
        await super()._too_few_acknowledged()
        self._replicas_at = 0.0  # ask Sentinel again: a replica may have gone

    async def follow_primary(self) -> bool:
        """Ask Sentinel where the primary is and drop pooled connections to any other
        server (redis-py's pool does this on a lookup). True if it moved."""
        pool = self.client.connection_pool
        before = getattr(pool, "master_address", None)
        with contextlib.suppress(*ERRORS):
            after = await pool.get_master_address()
            if before is not None and tuple(after) != tuple(before):
                self.failovers_seen += 1
                log.warning("redis: the Sentinel primary moved from %s:%s to %s:%s; following it", *before, *after)
                return True
        return False

    async def primaries(self) -> list[tuple[str, int]]:
        """The primary Sentinel names."""
        host, port = await self.sentinel.discover_master(self.service)
        return [(str(host), int(port))]

    def keyevent_subscriber(self, on_event: Callable[[str, str], None], **kw: Any) -> KeyeventSubscriber:
        """One subscription on the primary, left when that server is no longer it."""
        sub = self.sentinel.master_for(
            self.service,
            redis_class=aioredis.Redis,
            db=self.db,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=None,
            decode_responses=True,
            client_name=FEED_CLIENT_NAME,
        )
        return KeyeventSubscriber(self.client, self.db, on_event, sub_redis=sub, still_valid=self._on_primary, **kw)

    async def _on_primary(self, pubsub: Any) -> bool:
        """Is this subscription still on the primary? (After a failover the old primary
        may live on as a replica, and its connections stay open.)"""
        conn = getattr(pubsub, "connection", None)
        if conn is None:
            return True
        try:
            host, port = await self.sentinel.discover_master(self.service)
        except ERRORS:
            return True  # cannot tell now: keep it
        same = (str(conn.host), int(conn.port)) == (str(host), int(port))
        if not same:
            await self.follow_primary()  # the command pool too, not only this feed
        return same

    async def aclose(self) -> None:
        await super().aclose()
        for s in self.sentinel.sentinels:
            with contextlib.suppress(Exception):
                await s.aclose()
