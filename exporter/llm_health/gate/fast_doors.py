"""The fast path of the doors' aiohttp app, `llm-health decide`'s server: the door requests
(`/-/auth_request...`, `/-/ext_authz...`, `/-/refused`) answered on a raw asyncio
protocol, everything else served by the doors' aiohttp application on the same port and
connection.

The seam is `ServeDoors` (`serve` here). Its library counterpart is the doors' aiohttp app
on aiohttp's own server (`Doors.app`, as `llm-health decide` serves it with a web config
that sets basic auth users or headers; tests/fixtures/doors.py's `serve_aiohttp`), and
tests/integration/test_fast_doors_parity.py sends the same requests to both
(docs/architecture.md, "Fast paths and their library counterparts").

A door request is a small header-only request on a connection the proxy keeps; aiohttp's
request and response objects, middleware and writer cost more CPU than the decision itself
(docs/benchmarks.md, "Profile of decide"). Here the request is parsed by httptools (the
parser uvloop and uvicorn use: its limits are checked here, as aiohttp's are), answered
by the same `Doors` methods the aiohttp handlers call (`gate.doors`: one answer path, the
one decision of `gate.decision`), and the response written in one `transport.write`.
What has no library is written by hand: the request read into a header multidict, the
response's bytes, the hand-over below.

Any other request (`/metrics`, `/-/healthy`, `/-/reload`, the operator's controls, an
unknown path, a HEAD) hands its connection to aiohttp's own protocol: the request is given
to it as read, and so is every later one on that connection. A web config with basic
auth users or response headers serves everything through aiohttp (`run`): its middleware
guards the doors too.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httptools
from aiohttp import web
from multidict import CIMultiDict

from ..web import freeze_after_startup
from .doors import Answer, Doors
from .headers import GateError

log = logging.getLogger("llm_health.gate.fast_doors")

MAX_LINE = 8190  # aiohttp's limits: the request line, one header's name and value
MAX_HEADERS = 128
MAX_BODY = 1024  # the doors read no body (aiohttp's client_max_size for them)
MAX_RELAYED_BODY = 1 << 20  # a request handed to aiohttp: its body is read here first
KEEP_ALIVE_S = 75.0  # an idle kept connection is closed after this (aiohttp's default)
_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_SKIP_RELAYED = {"content-length", "transfer-encoding"}


def render(status: int, headers: dict[str, str], body: bytes, keep_alive: bool, version: str = "1.1") -> bytes:
    """One response's bytes, in the request's HTTP version, its `Connection` header as
    aiohttp writes it (`close` on HTTP/1.1, `keep-alive` on HTTP/1.0). A header value with a
    line break is refused (aiohttp's rule): the answer becomes a 500."""
    out = [b"HTTP/%s %d %s\r\n" % (version.encode(), status, _REASONS.get(status, b"Unknown"))]
    for name, value in headers.items():
        if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
            raise ValueError(f"a line break in the response header {name!r}")
        out.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
    out.append(b"Content-Length: %d\r\n" % len(body))
    if version == "1.1":
        if not keep_alive:
            out.append(b"Connection: close\r\n")
    elif keep_alive:
        out.append(b"Connection: keep-alive\r\n")
    out.append(b"\r\n")
    out.append(body)
    return b"".join(out)


class DoorProtocol(asyncio.Protocol):
    """One client connection (see the module's docstring). Requests are answered in the
    order they came (pipelining), each after the one before it."""

    def __init__(self, doors: Doors, fallback: Callable[[], asyncio.Protocol]):
        self.doors = doors
        self.fallback = fallback
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None  # uvloop's transports are no asyncio.Transport subclasses
        self.relay: asyncio.Protocol | None = None  # aiohttp's protocol, once handed over
        self.tail: asyncio.Future[None] | None = None  # the last answer under way
        self.held: list[bytes] = []  # requests for aiohttp, waiting for the answers before them
        self.idle: asyncio.TimerHandle | None = None  # closes the connection once idle KEEP_ALIVE_S
        self.busy = 0  # door requests being answered
        self.last = 0.0  # the loop's time of the last request or answer
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.size = 0

    # --- asyncio -----------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        loop = asyncio.get_running_loop()
        self.last = loop.time()
        self.idle = loop.call_later(KEEP_ALIVE_S, self._check_idle)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "upgrades are not served here")
        except httptools.HttpParserError as exc:  # a callback's own error comes as its context
            cause = exc.__context__
            self._fail(cause.status, str(cause)) if isinstance(cause, _Unreadable) else self._fail(400, f"bad request: {exc}")

    def eof_received(self) -> bool | None:
        if self.relay is not None:
            return self.relay.eof_received()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.idle is not None:
            self.idle.cancel()
        if self.relay is not None:
            self.relay.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.pause_writing()

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.resume_writing()

    # --- httptools' callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_LINE:
            raise _Unreadable(414, "the request line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_LINE:
            raise _Unreadable(431, "a request header is too long")
        if len(self.headers) >= MAX_HEADERS:
            raise _Unreadable(431, "too many request headers")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        """`Expect: 100-continue` on HTTP/1.1, before aiohttp has the connection: the interim
        `100 Continue` now (after the answers before it), so the client sends its body without
        waiting; the header is then not relayed, so aiohttp sends no second one. A body
        declared over the limit gets no `100` (its read is refused with 413). An HTTP/1.1
        request without `Host` is refused with 400, as aiohttp refuses it (RFC 9112, 3.2)."""
        if self.relay is not None or self.parser.get_http_version() != "1.1":
            return
        if not any(n.lower() == b"host" for n, _ in self.headers):
            raise _Unreadable(400, "Missing 'Host' header in request.")
        expect = [v.strip().lower() for n, v in self.headers if n.lower() == b"expect"]
        if expect != [b"100-continue"]:
            return  # none, or one aiohttp answers 417 to
        lengths = [v for n, v in self.headers if n.lower() == b"content-length"]
        if lengths and (not lengths[0].strip().isdigit() or int(lengths[0]) > MAX_RELAYED_BODY):
            return
        self.headers = [(n, v) for n, v in self.headers if n.lower() != b"expect"]

        def send(_: object = None) -> None:
            if not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

        if self.tail is not None and not self.tail.done():
            self.tail.add_done_callback(send)
        else:
            send()

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > MAX_RELAYED_BODY:
            raise _Unreadable(413, "the request body is too large")
        self.body += body

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        path = self.url.partition(b"?")[0]
        door = path == b"/-/refused" or path.startswith((b"/-/auth_request", b"/-/ext_authz"))
        if self.relay is None and door and method != b"HEAD":
            keep_alive = self.parser.should_keep_alive()
            if not keep_alive:
                self.transport.pause_reading()  # nothing after this request is read
            self.busy += 1
            version = self.parser.get_http_version()
            task = asyncio.ensure_future(self._answer(method.decode(), self.url, self.headers, self.size, keep_alive, version, self.tail))
            self.tail = task
            return
        self._hand_over(method)

    # --- answers -----------------------------------------------------------------------------
    async def _answer(self, method: str, url: bytes, raw: list[tuple[bytes, bytes]], size: int, keep_alive: bool, version: str, before: Any) -> None:
        headers: CIMultiDict[str] = CIMultiDict((n.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")) for n, v in raw)
        raw_path = url.decode("utf-8", "surrogateescape")
        try:
            if size > MAX_BODY:
                answer: Answer = 413, {"Content-Type": "text/plain; charset=utf-8"}, b"Maximum request body size %d exceeded." % MAX_BODY  # aiohttp's words
            elif raw_path.startswith("/-/auth_request"):
                answer = await self.doors.auth_request(raw_path, headers)
            elif raw_path.startswith("/-/ext_authz"):
                answer = await self.doors.ext_authz(method, raw_path, headers)
            else:
                answer = self.doors.refused(headers)
            data = render(*answer, keep_alive, version)
        except Exception:
            log.exception("the door's answer to %s %s failed", method, raw_path[:200])
            data = render(500, {"Content-Type": "text/plain; charset=utf-8"}, b"500 Internal Server Error\n", keep_alive, version)
        if before is not None and not before.done():
            await asyncio.wait([before])
        self.busy -= 1
        if self.transport.is_closing():
            return
        self.transport.write(data)
        self.last = asyncio.get_running_loop().time()
        if not keep_alive:
            self.transport.close()

    def _check_idle(self) -> None:
        """Close a connection idle for KEEP_ALIVE_S (a timer re-armed only when it fires,
        not per request); one handed to aiohttp is aiohttp's to close."""
        self.idle = None
        if self.relay is not None or self.transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        left = KEEP_ALIVE_S - (loop.time() - self.last)
        if self.busy == 0 and left <= 0:
            self.transport.close()
            return
        self.idle = loop.call_later(max(left, 1.0), self._check_idle)

    def _fail(self, status: int, message: str) -> None:
        """A request that cannot be read: answered after the answers before it, and the
        connection closed (nothing after it is read)."""
        self.transport.pause_reading()
        if self.relay is not None:
            self.transport.close()
            return
        data = render(status, {"Content-Type": "text/plain; charset=utf-8"}, message.encode() + b"\n", False)

        def send(_: object = None) -> None:
            if not self.transport.is_closing():
                self.transport.write(data)
                self.transport.close()

        if self.tail is not None and not self.tail.done():
            self.tail.add_done_callback(send)
        else:
            send()

    def _hand_over(self, method: bytes) -> None:
        """This request and every later one on this connection go to aiohttp, after the
        door answers before them."""
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        version = self.parser.get_http_version()
        lines = [b"%s %s HTTP/%s\r\n" % (method, self.url, version.encode())]
        lines += [b"%s: %s\r\n" % (n, v) for n, v in self.headers if n.decode("latin-1").lower() not in _SKIP_RELAYED]
        lines.append(b"Content-Length: %d\r\n\r\n" % len(self.body))
        self.held.append(b"".join(lines) + self.body)
        if self.relay is None:
            self.relay = self.fallback()
            if self.tail is None or self.tail.done():
                self._start_relay()
            else:
                self.tail.add_done_callback(lambda _: self._start_relay())
        elif self.held and self.tail is None:
            self._flush_held()

    def _start_relay(self) -> None:
        self.tail = None
        if self.transport.is_closing():
            return
        assert self.relay is not None
        self.relay.connection_made(self.transport)
        self._flush_held()

    def _flush_held(self) -> None:
        assert self.relay is not None
        held, self.held = self.held, []
        for data in held:
            self.relay.data_received(data)


class _Unreadable(GateError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


Stop = Callable[[], Awaitable[None]]


class ServeDoors(Protocol):
    """The seam: `doors` served on `host:port` (TLS with `ssl_context`), `app` (`Doors.app`,
    started here: its startup and cleanup run) answering what the server does not answer
    itself; returns the coroutine function that stops it. `serve` here, or `app` alone on
    aiohttp's server: the same statuses, headers and bodies for every request."""

    async def __call__(self, doors: Doors, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> Stop: ...


async def serve(doors: Doors, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> Stop:
    """Start the doors' server; returns the coroutine function that stops it (the open
    answers finished, the app's cleanup run: pending attempt finishes written)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()  # the app's startup: the decision's sampler, the syslog listener, SIGHUP
    loop = asyncio.get_running_loop()
    fallback = runner.server
    assert fallback is not None
    server = await loop.create_server(lambda: DoorProtocol(doors, fallback), host, port, ssl=ssl_context, reuse_address=True)

    async def stop() -> None:
        server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(fallback.shutdown(5.0), 6.0)
        await runner.cleanup()

    return stop


def run(doors: Doors, app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None, server: ServeDoors = serve) -> None:
    """Serve until SIGTERM or SIGINT, on uvloop where it is installed, with `server`."""
    freeze_after_startup(app)
    try:
        import uvloop
    except ImportError:
        factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    else:
        factory = uvloop.new_event_loop

    async def main() -> None:
        stop = await server(doors, app, host, port, ssl_context)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, done.set)
        await done.wait()
        await stop()

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
