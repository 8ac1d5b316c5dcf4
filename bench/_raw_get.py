"""The floor of a `/metrics` read: a minimal asyncio GET on a new connection, Content-Length
bodies only, none of the exporter's checks (bench_client's `raw` path and bench_scale's
floor per read: in a module of its own, so neither imports the other)."""

from __future__ import annotations

import asyncio
from typing import Any


class _Get(asyncio.Protocol):
    def __init__(self, done: asyncio.Future[int]):
        self.done, self.buf, self.end = done, bytearray(), -1
        self.transport: Any = None  # uvloop's transports are not asyncio.Transport subclasses

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.end < 0:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self.buf[:head_end]).lower()
            at = head.index(b"content-length:") + len(b"content-length:")
            self.end = head_end + 4 + int(head[at : head.index(b"\r\n", at)])
        if len(self.buf) >= self.end and not self.done.done():
            self.done.set_result(len(self.buf) - self.buf.find(b"\r\n\r\n") - 4)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("closed before the body ended"))


async def raw_get(port: int) -> int:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _Get(done), "127.0.0.1", port)
    transport.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n" % port)
    try:
        return await asyncio.wait_for(done, 10.0)
    finally:
        transport.close()
