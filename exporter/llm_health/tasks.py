"""Stopping a background task that may swallow its cancellation.

redis-py can swallow a `CancelledError` delivered while it waits on a reply (it closes the
connection and raises its own error, which a loop that outlives Redis outages catches and
goes on). `task.cancel()` then `gather(task)` waits for ever on such a loop. Every loop
that reads Redis stops through `cancel_and_wait`; the keyevent feed (`store.feed`) also
closes its pub/sub connection between tries (`unstick`), which ends a read in progress."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

RECANCEL_S = 0.1  # how long to wait for a cancelled task before cancelling it again


async def cancel_and_wait(task: asyncio.Task[Any], recancel_s: float = RECANCEL_S, unstick: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Cancel ``task`` until it has ended (a swallowed cancellation is sent again: the loop's
    next await, a sleep, honours it), running ``unstick`` (its errors ignored) before each
    cancellation after the first; the task's result or exception is dropped."""
    task.cancel()
    while not (await asyncio.wait({task}, timeout=recancel_s))[0]:
        if unstick is not None:
            with contextlib.suppress(Exception):
                await unstick()
        task.cancel()
    with contextlib.suppress(BaseException):
        task.result()
