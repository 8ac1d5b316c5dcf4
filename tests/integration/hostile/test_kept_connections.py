"""The connection the lean client (llm_health.probe.fast_http) keeps for a backend's next read,
`Target(keepalive=True)` as the exporter's rounds make it, against servers on real
loopback sockets that serve one request after another on a connection and answer
exactly what a test chooses: reused after a whole framed answer, dropped after any
answer that cannot frame the next one, read again once when the server closed it as the
request went out and never after a byte or a timeout, dropped when idle too long or when
it talks, capped in number, let go at once for llama-server, and asked without
keep-alive where the server closes kept connections before the next round.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest

from llm_health.probe import fast_http
from llm_health.probe.client import BackendClient
from tests.integration.hostile.test_metrics_client import BODY, SLOW, chunked, head, listening


@dataclass
class Keeper:
    """A server on 127.0.0.1 that serves requests one after another on each connection:
    `answer(n)` gives the bytes for the n-th request of all (from 0), None to close the
    connection instead of answering, or b"" to answer nothing and keep it open."""

    answer: Callable[[int], bytes | None]
    close_after: set[int] = field(default_factory=set)  # requests after whose answer the connection is closed
    requests: list[tuple[int, bytes]] = field(default_factory=list)  # (connection number, request head)
    connections: int = 0
    closed: int = 0  # connections that ended
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append((number, head))
                out = self.answer(len(self.requests) - 1)
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
                if len(self.requests) - 1 in self.close_after:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed += 1
            writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
async def keeper() -> AsyncIterator[Callable[..., Awaitable[Keeper]]]:
    async with listening() as listen:

        async def start(answer: Callable[[int], bytes | None], close_after: set[int] | None = None) -> Keeper:
            server = Keeper(answer, close_after or set())
            server.port = await listen(server.handle)
            return server

        yield start


OK = head(f"Content-Length: {len(BODY)}") + BODY


async def kept_read(target: fast_http.Target, timeout: float = SLOW) -> fast_http.Response:
    return await fast_http.get(target, connect_timeout=SLOW, timeout=timeout, max_bytes=1 << 20)


async def until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(SLOW):
        while not check():
            await asyncio.sleep(0.01)


async def test_a_kept_connection_carries_the_next_reads(keeper):
    server = await keeper(lambda n: OK if n % 2 else head("Transfer-Encoding: chunked") + chunked(BODY, 50))
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    for _ in range(4):
        assert "".join((await kept_read(target)).parts).encode() == BODY
    assert [c for c, _ in server.requests] == [0, 0, 0, 0] and server.connections == 1
    assert all(b"Connection:" not in r for _, r in server.requests)
    target.close()
    await until(lambda: server.closed == 1)


async def test_an_answer_that_cannot_frame_the_next_one_ends_its_connection(keeper):
    """Not kept: `Connection: close`, HTTP/1.0, a body read to the close, a byte past the
    body's end, a status other than 200 (its body is not read)."""
    answers = {
        "close header": head(f"Content-Length: {len(BODY)}", "Connection: close") + BODY,
        "HTTP/1.0": f"HTTP/1.0 200 OK\r\nContent-Length: {len(BODY)}\r\n\r\n".encode() + BODY,
        "extra byte": head(f"Content-Length: {len(BODY)}") + BODY + b"X",
        "chunked extra": head("Transfer-Encoding: chunked") + chunked(BODY, 50) + b"HTTP/1.1 200 OK\r\n",
        "503": head("Content-Length: 5", status="503 Service Unavailable") + b"later",
    }
    for name, first in answers.items():
        server = await keeper(lambda n, first=first: first if n == 0 else OK)
        target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
        await kept_read(target)
        assert "".join((await kept_read(target)).parts).encode() == BODY, name
        assert [c for c, _ in server.requests] == [0, 1], name
        target.close()


async def test_a_connection_the_server_closed_as_the_request_went_out_is_read_again_once(keeper):
    # The second request meets a server that closes instead of answering: read on a new one.
    server = await keeper(lambda n: None if n == 1 else OK)
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    await kept_read(target)
    assert "".join((await kept_read(target)).parts).encode() == BODY
    assert [c for c, _ in server.requests] == [0, 0, 1]
    # A new connection that closes before answering is an error, not read again.
    server = await keeper(lambda n: None)
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    with pytest.raises(fast_http.HttpError, match="server closed the connection"):
        await kept_read(target)
    assert len(server.requests) == 1
    target.close()


async def test_a_kept_read_that_got_a_byte_or_timed_out_is_not_read_again(keeper):
    # The second answer's head starts, then nothing: a timeout, not a second request.
    answers = {0: OK, 1: OK[:20], 2: OK, 3: b""}
    server = await keeper(answers.__getitem__)
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    await kept_read(target)
    with pytest.raises(fast_http.HttpError, match=r"timeout after 0\.5s") as caught:
        await kept_read(target, timeout=0.5)
    assert caught.value.timed_out and len(server.requests) == 2
    # A kept connection whose server never answers: a timeout, and no second request.
    await kept_read(target)  # on a new connection, then kept
    with pytest.raises(fast_http.HttpError, match=r"timeout after 0\.5s"):
        await kept_read(target, timeout=0.5)
    assert [c for c, _ in server.requests] == [0, 0, 1, 1]
    target.close()


async def test_a_kept_connection_is_dropped_when_the_server_closes_it_when_idle_too_long_or_when_it_talks(keeper, monkeypatch):
    # The server closes after its first answer: the next read is on a new connection, whether
    # the close arrived before it or as it went out.
    server = await keeper(lambda n: OK, close_after={0})
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    await kept_read(target)
    assert "".join((await kept_read(target)).parts).encode() == BODY
    assert [c for c, _ in server.requests] == [0, 1]
    target.close()
    # Idle past KEEP_IDLE: closed by the client.
    monkeypatch.setattr(fast_http, "KEEP_IDLE", 0.2)
    server = await keeper(lambda n: OK)
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    await kept_read(target)
    await until(lambda: server.closed == 1)
    await kept_read(target)
    assert [c for c, _ in server.requests] == [0, 1]
    target.close()
    # Bytes nobody asked for, while no request is out: the connection is dropped.
    monkeypatch.setattr(fast_http, "KEEP_IDLE", SLOW)
    server = await keeper(lambda n: OK)
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    await kept_read(target)
    conn = target._idle
    assert conn is not None and conn.open
    conn.data_received(b"HTTP/1.1 200 OK\r\n")
    assert target._idle is None and not conn.open
    await kept_read(target)
    assert [c for c, _ in server.requests] == [0, 1]
    target.close()


async def test_at_most_the_cap_of_connections_is_kept(keeper, monkeypatch):
    monkeypatch.setattr(fast_http, "_kept_max", 1)
    server = await keeper(lambda n: OK)
    targets = [fast_http.Target(server.url, "/metrics", {}, keepalive=True) for _ in range(3)]
    for t in targets:
        await kept_read(t)
    assert [t._idle is not None for t in targets] == [True, False, False] and len(fast_http._kept) == 1
    await until(lambda: server.closed == 2)
    targets[0].close()
    assert len(fast_http._kept) == 0


async def test_a_llama_server_connection_is_let_go_at_once(keeper):
    """llama-server (cpp-httplib) holds a worker thread for each connection kept open, so a
    `/metrics` answer with its start header ends the connection; any other is kept."""
    llama = head(f"Content-Length: {len(BODY)}", "Process-Start-Time-Unix: 123456789") + BODY
    async with aiohttp.ClientSession() as session:
        for answer, connections in ((llama, [0, 1]), (OK, [0, 0])):
            server = await keeper(lambda n, answer=answer: answer)
            client = BackendClient(session, server.url, keepalive=True)
            for _ in range(2):
                assert (await client.metrics()).error is None
            assert [c for c, _ in server.requests] == connections
            if connections == [0, 1]:
                await until(lambda server=server: server.closed == 2)
            client.close()


async def test_a_server_that_closes_kept_connections_before_the_next_read_is_asked_without_keep_alive(keeper, monkeypatch):
    """As a real vLLM at 10 s rounds (it closes idle connections after 5 s): after MISSES
    reads that found the kept connection gone, PLAIN_READS reads say Connection: close,
    then keep-alive is tried again."""
    monkeypatch.setattr(fast_http, "PLAIN_READS", 3)
    server = await keeper(lambda n: OK, close_after=set(range(100)))
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    for _ in range(7):
        assert "".join((await kept_read(target)).parts).encode() == BODY
    modes = ["close" if b"Connection: close\r\n" in r else "keep" for _, r in server.requests]
    assert fast_http.MISSES == 2 and modes == ["keep", "keep", "close", "close", "close", "keep", "keep"], modes
    # A server that keeps them: never asked to close.
    server = await keeper(lambda n: OK)
    target = fast_http.Target(server.url, "/metrics", {}, keepalive=True)
    for _ in range(7):
        await kept_read(target)
    assert all(b"Connection:" not in r for _, r in server.requests) and server.connections == 1
    target.close()
