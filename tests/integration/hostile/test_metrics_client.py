"""The lean `/metrics` client (llm_health.probe.fast_http) against servers that send exactly the
bytes a test chooses, on real loopback sockets: every way a body can arrive (length,
chunked, to the close, gzip), every way it can go wrong (cut short, too large after gzip,
a head without end, a status line from another protocol, an encoding it cannot read, a
trickle), the request it writes, what it leaves behind, and the sleep flags asked on it.
The product's errors are values that name the fault and never carry the API key. The
connection it may keep for the next read: test_kept_connections.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from llm_health.probe import fast_http
from llm_health.probe.client import BackendClient
from tests.fixtures.websec import self_signed

BODY = b'# HELP vllm:num_requests_running Number of requests in model execution batches.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
SLOW = 10.0  # a timeout no correct answer on loopback comes near


@dataclass
class Canned:
    """A server on 127.0.0.1 that reads one request head per connection, keeps it, and
    answers with `answer(writer)`."""

    answer: Callable[[asyncio.StreamWriter], Awaitable[None]]
    requests: list[bytes] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a client's connection ended
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            self.requests.append(await reader.readuntil(b"\r\n\r\n"))
            await self.answer(writer)
            await reader.read()  # until the client closes or aborts
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed.set()
            writer.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def listening() -> AsyncIterator[Callable[..., Awaitable[int]]]:
    """`listen(handle, tls=None)` serves `handle` on a free port of 127.0.0.1 and returns
    the port; every server started is closed when the block ends."""
    servers: list[asyncio.Server] = []

    async def listen(handle: Handler, tls: ssl.SSLContext | None = None) -> int:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
        servers.append(srv)
        return srv.sockets[0].getsockname()[1]

    try:
        yield listen
    finally:
        for srv in servers:
            srv.close()
            await srv.wait_closed()


@pytest.fixture
async def canned() -> AsyncIterator[Callable[..., Awaitable[Canned]]]:
    async with listening() as listen:

        async def start(answer: Callable[[asyncio.StreamWriter], Awaitable[None]], tls: ssl.SSLContext | None = None) -> Canned:
            server = Canned(answer)
            server.port = await listen(server.handle, tls)
            return server

        yield start


def sends(*pieces: bytes, close: bool = True, pause: float = 0.0) -> Callable[[asyncio.StreamWriter], Awaitable[None]]:
    """An answer written in these pieces (each flushed on its own), then the close."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)
        if close:
            writer.close()

    return answer


def head(*lines: str, status: str = "200 OK") -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *lines]) + "\r\n\r\n").encode("latin-1")


def chunked(body: bytes, size: int) -> bytes:
    out = b""
    for i in range(0, len(body), size):
        piece = body[i : i + size]
        out += f"{len(piece):x};ext=1\r\n".encode() + piece + b"\r\n"
    return out + b"0\r\nX-Trailer: 1\r\n\r\n"


async def read(url: str, *, max_bytes: int = 1 << 20, timeout: float = SLOW, headers: dict[str, str] | None = None) -> fast_http.Response:
    target = fast_http.Target(url, "/metrics", headers or {})
    return await fast_http.get(target, connect_timeout=SLOW, timeout=timeout, max_bytes=max_bytes)


async def fails(url: str, **kwargs) -> fast_http.HttpError:
    with pytest.raises(fast_http.HttpError) as caught:
        await read(url, **kwargs)
    return caught.value


# -- bodies as they arrive


async def test_content_length_chunked_close_and_gzip_bodies_read_whole(canned):
    packed = gzip.compress(BODY)
    answers = {
        "length": sends(head(f"Content-Length: {len(BODY)}", "Content-Type: text/plain"), BODY[:10], BODY[10:], close=False),
        "chunked": sends(head("Transfer-Encoding: chunked"), *[bytes([b]) for b in chunked(BODY, 7)], close=False),
        "close": sends(head("Content-Type: text/plain"), BODY[:50], BODY[50:]),
        "gzip length": sends(head(f"Content-Length: {len(packed)}", "Content-Encoding: gzip"), packed, close=False),
        "gzip chunked": sends(head("Transfer-Encoding: chunked", "Content-Encoding: gzip"), chunked(packed, 5), close=False),
        "empty": sends(head("Content-Length: 0"), close=False),
    }
    for name, answer in answers.items():
        server = await canned(answer)
        resp = await read(server.url)
        want = b"" if name == "empty" else BODY
        assert (resp.status, "".join(resp.parts).encode(), resp.size) == (200, want, len(want)), name


async def test_a_multibyte_character_split_across_reads_is_decoded_whole(canned):
    body = "é\n".encode() * 3
    server = await canned(sends(head(f"Content-Length: {len(body)}"), body[:1], body[1:3], body[3:], close=False))
    assert "".join((await read(server.url)).parts) == "é\n" * 3


async def test_the_request_is_one_plain_get_with_its_headers_and_no_redirect_is_followed(canned):
    server = await canned(sends(head("Location: http://127.0.0.1:1/metrics", "Content-Length: 0", status="302 Found")))
    resp = await read(server.url + "/prefix/", headers={"Authorization": "Bearer sekret", "Accept-Encoding": "gzip"})
    assert resp.status == 302 and resp.headers["location"] == "http://127.0.0.1:1/metrics"
    assert len(server.requests) == 1
    lines = server.requests[0].decode("latin-1").split("\r\n")
    assert lines[0] == "GET /prefix/metrics HTTP/1.1"
    assert f"Host: 127.0.0.1:{server.port}" in lines
    assert {"Authorization: Bearer sekret", "Accept-Encoding: gzip", "Connection: close"} <= set(lines)
    assert any(line.startswith("User-Agent: llm-health/") for line in lines)


async def test_a_status_other_than_200_is_the_answer_without_its_body(canned):
    server = await canned(sends(head("Content-Length: 5", status="503 Service Unavailable"), b"wait!", close=False))
    resp = await read(server.url)
    assert (resp.status, resp.parts, resp.size) == (503, (), 0)


async def test_a_name_is_resolved(canned):
    server = await canned(sends(head(f"Content-Length: {len(BODY)}"), BODY, close=False))
    assert (await read(f"http://localhost:{server.port}")).size == len(BODY)


# -- answers that go wrong


async def test_a_body_cut_short_is_a_broken_body_never_a_payload(canned):
    cases = {
        "length": (sends(head(f"Content-Length: {len(BODY)}"), BODY[:40]), f"{len(BODY) - 40} bytes of the body missing"),
        "chunked": (sends(head("Transfer-Encoding: chunked"), chunked(BODY, 30)[:70]), "the chunked body did not end"),
        "gzip": (sends(head("Content-Encoding: gzip"), gzip.compress(BODY)[:30]), "broken gzip body (it ended early)"),
    }
    for name, (answer, why) in cases.items():
        error = await fails((await canned(answer)).url)
        assert why in str(error), (name, str(error))
        assert not (error.timed_out or error.refused or error.too_large), name


async def test_what_is_no_http_answer_is_named(canned):
    cases = {
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n": "not an HTTP/1.x response: 'SSH-2.0-OpenSSH_9.6'",
        b"HTTP/1.1 2000 OK\r\n\r\n": "not an HTTP/1.x response",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n": "malformed response header line: 'no colon here'",
        head("Content-Length: -1"): "bad Content-Length '-1'",
        head("Transfer-Encoding: chunked") + b"zz\r\n": "bad chunk size b'zz'",
        head("Transfer-Encoding: chunked") + b"3\r\nabcXY": "a chunk not followed by CRLF",
        head("Transfer-Encoding: chunked") + b"1" * 2000: "a chunk size line too long",
        head("Content-Encoding: br"): "unsupported Content-Encoding 'br' (llm-health asks for gzip or none)",
        head("Transfer-Encoding: gzip, chunked"): "unsupported Transfer-Encoding 'gzip, chunked'",
        head("Content-Encoding: gzip") + b"not gzip at all": "broken gzip body",
        b"": "server closed the connection",
    }
    for answer, why in cases.items():
        error = await fails((await canned(sends(answer))).url)
        assert why in str(error), (answer[:40], str(error))


async def test_the_head_is_capped_in_bytes_and_lines(canned):
    endless = sends(b"HTTP/1.1 200 OK\r\n", *[b"X-Pad: " + b"a" * 1000 + b"\r\n"] * 80, close=False)
    error = await fails((await canned(endless)).url)
    assert str(error) == f"response head larger than {fast_http.MAX_HEAD} bytes"
    many = sends(head(*[f"X-{i}: 1" for i in range(fast_http.MAX_HEADERS + 1)]))
    assert str(await fails((await canned(many)).url)) == f"more than {fast_http.MAX_HEADERS} response headers"
    at_bound = sends(head(*[f"X-{i}: 1" for i in range(fast_http.MAX_HEADERS - 1)], f"Content-Length: {len(BODY)}"), BODY)
    assert (await read((await canned(at_bound)).url)).size == len(BODY)


async def test_the_body_is_capped_after_gzip_is_undone(canned):
    bomb = gzip.compress(b"\0" * (64 << 20), 9)  # 64 MiB of zeros in about 64 KiB
    assert len(bomb) < 100_000
    cases = {
        "declared": sends(head(f"Content-Length: {2 << 20}")),  # refused before any body byte
        "to the close": sends(head(), b"x" * ((1 << 20) + 1)),
        "gzip length": sends(head(f"Content-Length: {len(bomb)}", "Content-Encoding: gzip"), bomb),
        "gzip chunked": sends(head("Transfer-Encoding: chunked", "Content-Encoding: gzip"), chunked(bomb, 4096)),
    }
    for name, answer in cases.items():
        error = await fails((await canned(answer)).url, max_bytes=1 << 20)
        assert (str(error), error.too_large) == (f"body larger than {1 << 20} bytes", True), name
    exact = sends(head("Content-Encoding: gzip"), gzip.compress(b"x" * (1 << 20)))
    assert (await read((await canned(exact)).url, max_bytes=1 << 20)).size == 1 << 20


async def test_a_trickle_times_out_whole_and_leaves_no_connection_behind(canned):
    forever = sends(head("Transfer-Encoding: chunked"), *[b"1\r\nx\r\n"] * 10_000, close=False, pause=0.02)
    server = await canned(forever)
    error = await fails(server.url, timeout=0.5)
    assert (str(error), error.timed_out) == ("timeout after 0.5s", True)
    await asyncio.wait_for(server.closed.wait(), SLOW)  # the client's socket was closed


async def test_a_closed_port_is_refused(canned):
    server = await canned(sends(b""))
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    error = await fails(f"http://127.0.0.1:{port}")
    assert error.refused and str(error).startswith("connection refused or unreachable (")
    assert server.requests == []


@contextlib.contextmanager
def black_hole(host: str = "127.0.0.1", port: int = 0) -> Iterator[int]:
    """A listener whose accept queue is full: Linux drops the next SYN, so a connect to
    its port hangs. Yields the port."""
    with socket.socket() as listener:
        listener.bind((host, port))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(4):
                filler = socket.socket()
                filler.setblocking(False)
                filler.connect_ex((host, port))
                fillers.append(filler)
            yield port
        finally:
            for filler in fillers:
                filler.close()


async def test_a_connect_that_hangs_is_a_connect_timeout_within_the_total():
    with black_hole() as port:
        target = fast_http.Target(f"http://127.0.0.1:{port}", "/metrics", {})
        with pytest.raises(fast_http.HttpError) as caught:
            await fast_http.get(target, connect_timeout=0.3, timeout=SLOW, max_bytes=1000)
        assert (str(caught.value), caught.value.timed_out) == ("connect timeout after 0.3s", True)
        with pytest.raises(fast_http.HttpError) as caught:  # the total ends first: it is the one named
            await fast_http.get(target, connect_timeout=SLOW, timeout=0.3, max_bytes=1000)
        assert (str(caught.value), caught.value.timed_out) == ("timeout after 0.3s", True)


async def test_a_name_whose_first_address_drops_the_syn_is_read_on_the_next(canned, monkeypatch):
    # A dual-stack name with a broken route for its first address: each address's connect
    # has its own timeout, and the next address is tried within the total.
    server = await canned(sends(head(f"Content-Length: {len(BODY)}"), BODY))
    loop = asyncio.get_running_loop()
    asked = []

    async def getaddrinfo(host, port, **kwargs):
        asked.append(host)
        inet = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "")
        return [(*inet, ("127.0.0.2", port)), (*inet, ("127.0.0.1", port))]

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    with black_hole("127.0.0.2", server.port):
        target = fast_http.Target(f"http://dual.invalid:{server.port}", "/metrics", {})
        resp = await fast_http.get(target, connect_timeout=0.3, timeout=SLOW, max_bytes=1000)
        assert (resp.status, "".join(resp.parts)) == (200, BODY.decode())
        assert asked == ["dual.invalid"] and len(server.requests) == 1
        # Both addresses silent: a connect timeout, named as such, within the total.
        with black_hole("127.0.0.1") as silent, black_hole("127.0.0.2", silent):
            target = fast_http.Target(f"http://dual.invalid:{silent}", "/metrics", {})
            with pytest.raises(fast_http.HttpError) as caught:
                await fast_http.get(target, connect_timeout=0.3, timeout=SLOW, max_bytes=1000)
            assert (str(caught.value), caught.value.timed_out, caught.value.refused) == ("connect timeout after 0.3s", True, False)
            # The total ends during the second address's connect: the total is named.
            target = fast_http.Target(f"http://dual.invalid:{silent}", "/metrics", {})
            with pytest.raises(fast_http.HttpError) as caught:
                await fast_http.get(target, connect_timeout=0.3, timeout=0.45, max_bytes=1000)
            assert (str(caught.value), caught.value.timed_out) == ("timeout after 0.45s", True)


async def test_a_refusal_after_a_silent_address_is_refused():
    with black_hole("127.0.0.2") as port:
        target = fast_http.Target(f"http://127.0.0.2:{port}", "/metrics", {})
        target._addresses = [(socket.AF_INET, ("127.0.0.2", port)), (socket.AF_INET, ("127.0.0.1", port))]  # nothing listens on the second
        with pytest.raises(fast_http.HttpError) as caught:
            await fast_http.get(target, connect_timeout=0.3, timeout=SLOW, max_bytes=1000)
        assert caught.value.refused and not caught.value.timed_out
        assert str(caught.value).startswith("connection refused or unreachable (")


async def test_tls_is_verified(canned, tmp_path):
    cert, key = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = await canned(sends(head(f"Content-Length: {len(BODY)}"), BODY), tls=tls)
    error = await fails(f"https://127.0.0.1:{server.port}")
    assert str(error).startswith("TLS: ") and "certificate verify failed" in str(error)
    assert server.requests == []


# -- the URL and the key


def test_a_url_or_header_that_would_split_the_request_is_refused():
    for url, headers, why in [
        ("http://127.0.0.1:1", {"Authorization": "Bearer a\r\nX-Evil: 1"}, "a control character"),
        ("http://127.0.0.1:1", {"Authorization": "Bearer \u2603"}, "outside Latin-1"),
        ("ftp://127.0.0.1:1", {}, r"not an http\(s\) URL"),
        ("http:///metrics", {}, r"not an http\(s\) URL"),
    ]:
        with pytest.raises(ValueError, match=why):
            fast_http.Target(url, "/metrics", headers)
    assert fast_http.Target("http://[::1]:9", "/metrics", {}).request.startswith(b"GET /metrics HTTP/1.1\r\nHost: [::1]:9\r\n")


async def test_the_api_key_is_in_no_error(canned):
    key = "sk-do-not-leak-4242"
    async with aiohttp.ClientSession() as session:
        for answer in (sends(head("Content-Length: 0", status="401 Unauthorized")), sends(b"garbage\r\n\r\n"), sends(head(), b"\0" * 100)):
            server = await canned(answer)
            fetched = await BackendClient(session, server.url, api_key=key, max_bytes=10).metrics()
            assert fetched.error and key not in fetched.error, fetched.error
            assert f"Authorization: Bearer {key}".encode() in server.requests[0]
        fetched = await BackendClient(session, "http://127.0.0.1:1", api_key=key + "\r\nX: 1").metrics()
        assert fetched.error == "cannot read /metrics: a control character in the URL or in a header value"


# -- the sleep flags, asked on the same client


async def test_a_sleep_flag_is_true_only_on_a_clear_yes(canned):
    """`/is_sleeping` and `/is_paused` go through probe.fast_http too: a JSON yes (plain or
    gzip) is yes; a no, a redirect, broken JSON, a cut body, a refused port and a body past
    1 MiB are all no, and the request carries the key and asks for JSON."""
    yes = b'{"is_sleeping": true}'
    packed = gzip.compress(b'{"is_paused": true}')
    cases = {
        "yes": (sends(head(f"Content-Length: {len(yes)}", "Content-Type: application/json"), yes, close=False), True),
        "gzip yes": (sends(head(f"Content-Length: {len(packed)}", "Content-Encoding: gzip"), packed, close=False), True),
        "bare true": (sends(head("Content-Length: 4"), b"true", close=False), True),
        "no": (sends(head("Content-Length: 22"), b'{"is_sleeping": false}', close=False), False),
        "redirect": (sends(head("Location: /is_sleeping2", "Content-Length: 0", status="302 Found")), False),
        "broken": (sends(head("Content-Length: 5"), b'{"is_', close=False), False),
        "cut": (sends(head("Content-Length: 50"), yes), False),
        "too large": (sends(head(f"Content-Length: {(1 << 20) + 1}"), yes), False),
    }
    async with aiohttp.ClientSession() as session:
        for name, (answer, want) in cases.items():
            server = await canned(answer)
            assert await BackendClient(session, server.url, api_key="k").flag("/is_sleeping") is want, name
            request = server.requests[0]
            assert request.startswith(b"GET /is_sleeping HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in request, name
            assert b"Accept: application/json\r\n" in request, name
        assert await BackendClient(session, "http://127.0.0.1:1").flag("/is_paused") is False
