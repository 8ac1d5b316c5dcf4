"""Stopping a background task that may swallow its cancellation.

redis-py can swallow a `CancelledError` delivered while it waits on a reply (it closes the
connection and raises its own error, which a loop that outlives Redis outages catches and
goes on). `task.cancel()` then `gather(task)` waits for ever on such a loop. The keyevent
feed has its own stop for this (`store.feed`); loops that only read Redis use this one."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

RECANCEL_S = 0.1  # how long to wait for a cancelled task before cancelling it again


async def cancel_and_wait(task: asyncio.Task[Any], recancel_s: float = RECANCEL_S) -> None:
    """Cancel ``task`` until it has ended (a swallowed cancellation is sent again: the loop's
    next await, a sleep, honours it); its result or exception is dropped."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_s)
    with contextlib.suppress(BaseException):
        task.result()
