"""Keeping a lease alive while its job runs: renew before the TTL runs out, and tell the
job the moment the lease can no longer be trusted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from .connection import TRANSIENT
from .records import Lease

log = logging.getLogger(__name__)

RENEW_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT, RedisError)

Renew = Callable[[Lease], Awaitable[bool]]


class Heartbeat:
    """Renews a lease every ``interval_s`` until stopped. When a renewal is refused, or
    no renewal could be confirmed within the TTL (Redis unreachable), the lease counts
    as lost: ``lost`` is set and ``on_lost`` is called (e.g. ``job_task.cancel``)."""

    def __init__(
        self,
        renew: Renew,
        lease: Lease,
        interval_s: float,
        on_lost: Callable[[], Any] | None = None,
    ):
        self.renew, self.lease, self.interval_s, self.on_lost = renew, lease, interval_s, on_lost
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
                ok = await self.renew(self.lease)
            except RENEW_ERRORS as e:
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
