"""Writes gathered over one short tick and sent to Redis in one round trip: the doors'
attempt finishes (`gate.decision.Admission.finish`), which nobody waits for on a client's
path, so a few milliseconds' wait costs nothing and saves a round trip (a write and a
read on both ends) per finish under load.

Each caller queues its commands and awaits their replies, or the pipeline's error: the
caller keeps its own retry rule (sent again while Redis does not answer), so a batch that
failed is retried attempt by attempt, each joining whatever batch is open then. Every
command must be safe to send twice (the attempt script is idempotent by attempt id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

Add = Callable[[Any], None]  # queues its commands on the pipeline it is given


class WriteBatch:
    def __init__(self, pipeline: Callable[[], Awaitable[Any]], execute: Callable[[Any], Awaitable[list[Any]]], tick_s: float):
        """``pipeline()`` opens a pipeline, ``execute(pipe)`` runs it (scripts reloaded, a
        Cluster's MOVED followed: `AdmissionQueue.execute`); a batch is sent ``tick_s``
        after its first write was queued."""
        self._pipeline = pipeline
        self._execute = execute
        self.tick_s = tick_s
        self._open: list[tuple[Add, asyncio.Future[list[Any]]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def run(self, add: Add) -> list[Any]:
        """The replies to the commands ``add`` queued, once the batch holding them ran; the
        batch's error if it failed (Redis down: the caller decides whether to send again)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._open.append((add, future))
        if self._timer is None:
            self._timer = loop.call_later(self.tick_s, self._flush)
        return await future

    def _flush(self) -> None:
        self._timer = None
        batch, self._open = self._open, []
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[Add, asyncio.Future[list[Any]]]]) -> None:
        spans = []
        try:
            pipe = await self._pipeline()
            for add, _ in batch:
                start = len(pipe.command_stack)
                add(pipe)
                spans.append((start, len(pipe.command_stack)))
            replies = await self._execute(pipe)
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (start, end), (_, future) in zip(spans, batch):
            if not future.done():  # its caller may have been cancelled meanwhile
                future.set_result(replies[start:end])
