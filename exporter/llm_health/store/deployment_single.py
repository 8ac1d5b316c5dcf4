"""One Redis server (`redis://`, `rediss://`, `unix://`): a redis-py `Redis` on redis-py's
own URL, the one primary there is; nothing replicates unless the URL asks `WAIT` for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

from redis import asyncio as aioredis

from .deployment_base import Deployment, Dialing, node_kwargs_of
from .feed import KeyeventSubscriber
from .target import SINGLE_SCHEMES, RedisTarget


class SingleDeployment(Deployment):
    kind = "single"
    schemes = SINGLE_SCHEMES

    @classmethod
    def open(cls, target: RedisTarget, dialing: Dialing) -> Self:
        pool_kw: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": dialing.socket_timeout,
            "socket_connect_timeout": dialing.socket_timeout,
            "retry": dialing.retry(),
        }
        if dialing.max_connections and dialing.blocking_timeout is not None:
            pool = aioredis.BlockingConnectionPool.from_url(
                target.single_url, max_connections=dialing.max_connections, timeout=dialing.blocking_timeout, **pool_kw
            )
            return cls(target, aioredis.Redis(connection_pool=pool), node_kwargs=dialing.node_kwargs(target))
        if dialing.max_connections:
            pool_kw["max_connections"] = dialing.max_connections
        return cls(target, aioredis.Redis.from_url(target.single_url, **pool_kw), node_kwargs=dialing.node_kwargs(target))

    @classmethod
    def around(cls, client: Any) -> Self:
        """A ``Redis`` made elsewhere (one server, or a Sentinel ``master_for`` client:
        no WAIT unless the URL is given instead)."""
        pool_kw = client.connection_pool.connection_kwargs
        target = RedisTarget("single", url="redis://wrapped", db=int(pool_kw.get("db", 0) or 0))
        return cls(target, client, node_kwargs=node_kwargs_of(pool_kw))

    def server_pool(self) -> Any:
        return getattr(self.client, "connection_pool", None)

    async def primaries(self) -> list[tuple[str, int]]:
        """The one server."""
        kw = self.client.connection_pool.connection_kwargs
        return [(str(kw.get("host") or kw.get("path") or "localhost"), int(kw.get("port") or 0))]

    async def startup_warnings(self) -> list[str]:
        """None: one server has no replica to recommend anything about."""
        return []

    def keyevent_subscriber(self, on_event: Callable[[str, str], None], **kw: Any) -> KeyeventSubscriber:
        """One subscription on the one server."""
        return KeyeventSubscriber(self.client, self.db, on_event, **kw)
