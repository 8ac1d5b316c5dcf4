"""Keeping a lease alive while its job runs, and telling the job the moment the lease can
no longer be trusted: before its TTL can run out, never after.

The lease is surely valid until (local time the claim or the last confirmed renewal was
*sent*) + TTL: Redis counts the TTL from when it ran the command, which is later. Every
renewal call is bounded by that validity less a safety margin (5% of the TTL, at least
100 ms, for scheduling and for the two clocks' drift); when no renewal is confirmed in
time (Redis down, the connection black-holed, a renewal refused), the lease counts as
lost at once: `lost` is set and `on_lost` is called (e.g. `job_task.cancel`), while Redis
still holds it for us, so no other holder can have it yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import ERRORS
from .records import Lease

log = logging.getLogger(__name__)

Renew = Callable[[Lease], Awaitable[bool]]
RENEW_ERRORS = ERRORS  # store.errors: a failover's answers and any other, retried until the lease's validity ends


def safety_margin(ttl_ms: int) -> float:
    """Seconds before the lease could expire at which it counts as lost."""
    return max(0.05 * ttl_ms / 1000, 0.1)


class Heartbeat:
    """Renews a lease every ``interval_s`` until stopped (see the module's docstring)."""

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
        ttl = lease.ttl_ms / 1000
        # From the claim's send time; a lease made without one is trusted from now.
        self.valid_until = (lease.sent_at or time.monotonic()) + ttl
        self.margin = safety_margin(lease.ttl_ms)
        self._stopping = False
        self.task = asyncio.create_task(self._run(), name=f"lease-heartbeat-{lease.gpu}")

    @property
    def trusted_until(self) -> float:
        """Monotonic time at which the lease is given up unless renewed before."""
        return self.valid_until - self.margin

    async def _run(self) -> None:
        ttl = self.lease.ttl_ms / 1000
        last_sent = self.valid_until - ttl
        while True:
            await asyncio.sleep(max(0.0, min(last_sent + self.interval_s, self.trusted_until) - time.monotonic()))
            while True:  # renew until confirmed or until the lease can no longer be trusted
                left = self.trusted_until - time.monotonic()
                if left <= 0:
                    return self._lose("no renewal confirmed before the lease could expire")
                sent = time.monotonic()
                try:
                    async with asyncio.timeout(left):
                        ok = await self.renew(self.lease)
                except TimeoutError:
                    if self._stopping:
                        return
                    return self._lose("no renewal confirmed before the lease could expire (Redis did not answer in time)")
                except RENEW_ERRORS as e:
                    if self._stopping:
                        return
                    log.warning("lease %s: renewal failed, retrying: %r", self.lease.gpu, e)
                    await asyncio.sleep(min(0.05, max(0.0, self.trusted_until - time.monotonic())))
                    continue
                break
            if self._stopping:  # stop() came during the renewal, its cancellation lost (see stop)
                return
            if not ok:
                return self._lose("renewal refused: the lease expired or another holder has it")
            self.renewals += 1
            last_sent = sent
            self.valid_until = sent + ttl

    def _lose(self, reason: str) -> None:
        self.reason = reason
        self.lost.set()
        log.warning("lease on %s lost: %s", self.lease.gpu, reason)
        if self.on_lost is not None:
            self.on_lost()

    async def stop(self) -> None:
        """Stop renewing; returns once the heartbeat's task has ended. On Python 3.11,
        ``asyncio.wait_for`` (redis-py sends every command under it when a socket
        timeout is set) drops a cancellation that arrives as the command completes
        (CPython gh-86296, fixed in 3.12): the renewal then returns as if nothing
        happened, and a loop that relied on the cancellation alone would renew the
        lease for ever while this awaited it. So the loop also ends at the first
        check of ``_stopping`` after a renewal."""
        self._stopping = True
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
