"""probe.fast_http (the fast path) against its library counterpart, aiohttp's client with
the same caps (tests/fixtures/aiohttp_get.py): the same answers, sent byte for byte by
servers on real loopback sockets, read by both; the same status, headers, text and size,
or the same error case (`HttpTimeout`, `HttpRefused`, `BodyTooLarge`, `HttpClosed`, a plain
`HttpError`). Then the same through `BackendClient` (its `Fetched` and its sleep flags),
and a connection the server keeps or closes between reads."""

from __future__ import annotations

import asyncio
import gzip
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from llm_health.probe import fast_http
from llm_health.probe.client import BackendClient, Fetched
from tests.fixtures.aiohttp_get import aiohttp_get
from tests.integration.hostile.test_metrics_client import BODY, chunked, head, listening, sends

SLOW = 10.0
CAP = 4096  # max_bytes of every read here
Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


def hangs() -> Answer:
    async def answer(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(SLOW)

    return answer


PACKED = gzip.compress(BODY)
BOMB = gzip.compress(b"0" * (CAP * 50))
CASES: dict[str, Answer] = {
    # bodies as they arrive
    "length": sends(head(f"Content-Length: {len(BODY)}", "Content-Type: text/plain"), BODY[:10], BODY[10:], close=False),
    "chunked": sends(head("Transfer-Encoding: chunked"), *[bytes([b]) for b in chunked(BODY, 7)], close=False),
    "read to the close": sends(head("Content-Type: text/plain"), BODY[:50], BODY[50:]),
    "HTTP/1.0 to the close": sends(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n", BODY),
    "gzip length": sends(head(f"Content-Length: {len(PACKED)}", "Content-Encoding: gzip"), PACKED, close=False),
    "gzip chunked": sends(head("Transfer-Encoding: chunked", "Content-Encoding: gzip"), chunked(PACKED, 5), close=False),
    "empty": sends(head("Content-Length: 0"), close=False),
    "bad UTF-8": sends(head("Content-Length: 6"), b"a\xff\xfeb\xc3", b"\xa9", close=False),
    "a header twice, odd case": sends(head("X-Twice: one", "x-twice: two", "CONTENT-LENGTH: 2"), b"ok", close=False),
    "keep-alive refused": sends(head(f"Content-Length: {len(BODY)}", "Connection: close"), BODY),
    # statuses
    "404 with a body": sends(head("Content-Length: 9", status="404 Not Found"), b"not here\n", close=False),
    "503": sends(head("Content-Length: 4", "Retry-After: 5", status="503 Service Unavailable"), b"wait", close=False),
    "302 not followed": sends(head("Location: http://127.0.0.1:1/metrics", "Content-Length: 0", status="302 Found"), close=False),
    "100 Continue before the answer": sends(b"HTTP/1.1 100 Continue\r\n\r\n", head(f"Content-Length: {len(BODY)}"), BODY, close=False),
    "103 Early Hints before the answer": sends(
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n" + head(f"Content-Length: {len(BODY)}") + BODY, close=False
    ),
    # caps
    "declared over the cap": sends(head(f"Content-Length: {CAP + 1}"), b"x" * 100),
    "chunked over the cap": sends(head("Transfer-Encoding: chunked"), chunked(b"x" * (CAP + 100), 1000)),
    "to the close over the cap": sends(head(), b"x" * (CAP + 100)),
    "gzip bomb": sends(head(f"Content-Length: {len(BOMB)}", "Content-Encoding: gzip"), BOMB),
    "an encoding not asked for": sends(head("Content-Length: 2", "Content-Encoding: br"), b"ok", close=False),
    # broken answers
    "closed before a byte": sends(),
    "length cut short": sends(head(f"Content-Length: {len(BODY)}"), BODY[:40]),
    "chunked cut short": sends(head("Transfer-Encoding: chunked"), chunked(BODY, 30)[:70]),
    "bad chunk size": sends(head("Transfer-Encoding: chunked"), b"zz\r\n"),
    "not HTTP": sends(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"),
    "a status of four digits": sends(b"HTTP/1.1 2000 OK\r\n\r\n"),
    "a header line without a colon": sends(b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 0\r\n\r\n"),
    "silent": hangs(),
    "a head that trickles past the timeout": sends(b"HTTP/1.1 200 OK\r\n", b"Content-Length: 5\r\n", pause=0.4, close=False),
}
TIMEOUT = 0.6  # the total timeout of every read here: "silent" and the trickle pass it


Outcome = tuple[Any, ...]


async def outcome(get: fast_http.HttpGet, url: str, keepalive: bool = False, path: str = "/metrics") -> Outcome:
    """What a read gave: ("answer", status, headers, text, size) or ("error", its case)."""
    target = fast_http.Target(url, path, {"Accept-Encoding": "gzip", "Authorization": "Bearer k"}, keepalive=keepalive)
    try:
        resp = await get(target, connect_timeout=SLOW, timeout=TIMEOUT, max_bytes=CAP)
    except fast_http.HttpError as exc:
        return ("error", type(exc).__name__)
    finally:
        target.close()
    return ("answer", resp.status, resp.headers, "".join(resp.parts), resp.size)


@pytest.fixture
async def both() -> AsyncIterator[dict[str, fast_http.HttpGet]]:
    async with aiohttp.ClientSession() as session:
        yield {"fast": fast_http.get, "aiohttp": aiohttp_get(session)}


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Answer], Awaitable[tuple[str, list[bytes]]]]]:
    """`serve(answer)`: a server that reads each request's head and answers `answer`, on a
    connection of its own per request: (its URL, the request heads it read)."""
    async with listening() as listen:

        async def start(answer: Answer) -> tuple[str, list[bytes]]:
            heads: list[bytes] = []

            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                try:
                    heads.append(await reader.readuntil(b"\r\n\r\n"))
                    await answer(writer)
                    await reader.read()
                except (ConnectionError, asyncio.IncompleteReadError):
                    pass
                finally:
                    writer.close()

            return f"http://127.0.0.1:{await listen(handle)}", heads

        yield start


@pytest.mark.parametrize("case", list(CASES))
async def test_the_same_answer_reads_the_same(case, both, serve):
    got = {}
    for name, get in both.items():
        url, _ = await serve(CASES[case])
        got[name] = await outcome(get, url)
    assert got["fast"] == got["aiohttp"], case


async def test_a_port_nobody_listens_on_is_refused_by_both(both):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = {name: await outcome(get, f"http://127.0.0.1:{port}") for name, get in both.items()}
    assert got["fast"] == got["aiohttp"] == ("error", "HttpRefused")


async def test_both_send_the_same_request_line_and_headers(both, serve):
    heads, hosts = {}, {}
    for name, get in both.items():
        url, seen = await serve(CASES["length"])
        await outcome(get, url + "/prefix/")
        [heads[name]] = seen
        hosts[name] = url.removeprefix("http://")
    lines = {name: head.decode("latin-1").split("\r\n") for name, head in heads.items()}
    assert lines["fast"][0] == lines["aiohttp"][0] == "GET /prefix/metrics HTTP/1.1"
    for name, ls in lines.items():
        assert f"Host: {hosts[name]}" in ls, (name, ls)
    wanted = {"authorization", "accept-encoding", "connection", "user-agent"}
    fields = {
        name: {(k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in ls[1:] if line) if k.lower() in wanted} for name, ls in lines.items()
    }
    assert fields["fast"] == fields["aiohttp"], fields


async def served_on_one_connection(listen: Callable[..., Awaitable[int]], answers: list[bytes]) -> tuple[str, list[int]]:
    """A server that answers the n-th request of a connection with answers[n] (the last
    one for any later), and closes after an answer that says `Connection: close`: (its
    URL, the connections it accepted, one count each, as a list)."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            for n in range(100):
                await reader.readuntil(b"\r\n\r\n")
                answer = answers[min(n, len(answers) - 1)]
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    return f"http://127.0.0.1:{await listen(handle)}", accepted


async def test_reads_on_a_kept_connection_and_after_the_server_closes_it_read_the_same(both):
    ok = head(f"Content-Length: {len(BODY)}") + BODY
    closing = head(f"Content-Length: {len(BODY)}", "Connection: close") + BODY
    async with listening() as listen:
        got: dict[str, list[Outcome]] = {}
        for name, get in both.items():
            url, _ = await served_on_one_connection(listen, [ok, ok, closing, ok])
            target = fast_http.Target(url, "/metrics", {}, keepalive=True)
            got[name] = []
            for _ in range(5):
                resp = await get(target, connect_timeout=SLOW, timeout=SLOW, max_bytes=CAP)
                got[name].append((resp.status, "".join(resp.parts)))
            target.close()
    assert got["fast"] == got["aiohttp"] == [(200, BODY.decode())] * 5


def comparable(f: Fetched) -> Fetched:
    """A Fetched without what is not the reader's to match: the time, the error's words,
    where the body's pieces break (its text is matched whole)."""
    parts = None if f.parts is None else ("".join(f.parts),)
    return replace(f, parts=parts, seconds=0.0, error=None if f.error is None else "error")


@pytest.mark.parametrize("case", ["length", "gzip chunked", "503", "declared over the cap", "closed before a byte", "not HTTP", "silent"])
async def test_backend_client_reads_the_same_fetched_through_both(case, serve):
    async with aiohttp.ClientSession() as session:
        got = {}
        for name, get in {"fast": fast_http.get, "aiohttp": aiohttp_get(session)}.items():
            url, _ = await serve(CASES[case])
            client = BackendClient(session, url, api_key="k", metrics_timeout=TIMEOUT, max_bytes=CAP, get=get)
            got[name] = comparable(await client.metrics())
            client.close()
    assert got["fast"] == got["aiohttp"], case


@pytest.mark.parametrize(
    "body, want",
    [(b'{"is_sleeping": true}', True), (b'{"is_sleeping": false}', False), (b"true", True), (b"not json", False)],
)
async def test_a_sleep_flag_reads_the_same_through_both(body, want, serve):
    async with aiohttp.ClientSession() as session:
        got = {}
        for name, get in {"fast": fast_http.get, "aiohttp": aiohttp_get(session)}.items():
            url, _ = await serve(sends(head(f"Content-Length: {len(body)}", "Content-Type: application/json"), body, close=False))
            client = BackendClient(session, url, get=get)
            got[name] = await client.flag("/is_sleeping")
            client.close()
    assert got["fast"] == got["aiohttp"] == want
