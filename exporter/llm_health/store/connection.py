"""Small helpers on redis-py clients shared by the lease library, the queue and the view."""

from __future__ import annotations

from typing import Any

from redis import asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# CLIENT SETNAME of every keyevent subscription: what an operator sees in CLIENT LIST.
FEED_CLIENT_NAME = "llm-health-keyevents"

# Errors that mean "the connection or the server", not "this command was wrong".
TRANSIENT: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)


def text(value: Any) -> Any:
    """A reply as str, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else value


def without_retries(redis: aioredis.Redis) -> aioredis.Redis:
    """A client on the same server and settings as ``redis`` whose connections never
    retry: a pub/sub reader must see each disconnection to know events were lost."""
    pool = redis.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if not k.startswith(("maint_notifications", "orig_")) and k != "himport_registry"}
    kwargs["retry"] = Retry(NoBackoff(), 0)
    kwargs["socket_timeout"] = None  # an idle subscription is silent for long stretches
    kwargs["client_name"] = FEED_CLIENT_NAME
    return aioredis.Redis(connection_pool=type(pool)(connection_class=pool.connection_class, **kwargs))


async def server_ms(redis: aioredis.Redis) -> int:
    """The Redis server's clock, Unix milliseconds."""
    sec, usec = await redis.time()
    return int(sec) * 1000 + int(usec) // 1000
