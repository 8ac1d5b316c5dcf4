"""The fast path of aiohttp's client GET, for the reads every round makes: a backend's
`/metrics`, and the sleep flags (`/is_sleeping`, `/is_paused`) of an engine that stands still.

The answer's parser, its caps and the errors are in probe.http_answer.

A round is mostly this read, and aiohttp's client spends several times what the read needs
on it (connector, happy eyeballs, URL objects, a request and a response object; the figures
are bench_client's and bench_scale's in docs/benchmarks.md). This module is the read alone, on an asyncio
protocol: the request written once, the answer parsed as it arrives. It keeps every
guarantee of the aiohttp read it replaces:

- a connect timeout on each TCP (and TLS) connect and a total timeout on the whole read;
- the body capped after gzip is undone (`max_bytes`), so a small compressed bomb is
  caught, and the head capped too (`MAX_HEAD` bytes, `MAX_HEADERS` lines);
- no redirect followed: a 3xx is an answer like any other status; an interim 1xx (100
  Continue, 103 Early Hints) is skipped for the answer after it, as aiohttp skips it;
- a body as Content-Length, chunked or read to the close, and gzip or identity; anything
  else is an error that names it;
- TLS verified as aiohttp verifies it (the default context: system CAs, host name);
- names resolved by the event loop and kept for `DNS_TTL` seconds, as aiohttp keeps them;
- a failure raises `HttpError`, which says what happened and never carries the
  request's headers (the API key).

Connections: a `Target` made with `keepalive=True` (the exporter's rounds) keeps the one
connection a server left open for its next read (`KEEP_IDLE` seconds at most; at most half
the process's RLIMIT_NOFILE kept in all); other reads say `Connection: close`. A real vLLM
closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so at 10 s rounds each of
its reads opens one anyway; nginx (75 s by default), or a vLLM with that variable raised,
keep it, and a read on it costs less (bench/bench_client.py). Where the kept connection
is found closed `MISSES` reads in a row, the next `PLAIN_READS` say `Connection: close`
(a connection held for nothing costs more than none). Kept only after a whole
HTTP/1.1 answer framed by length or chunks, with no `Connection: close` and no byte past
its end; dropped when it talks while idle or the server closes it. A kept connection that
ends before the answer's first byte (closed as the request went out) is read once more on
a new one, within the same total timeout; a read that timed out or got a byte is not.

The other calls (`/v1/models`, the probe, `/health`) are rare and stay on aiohttp
(probe.client).

The seam is `HttpGet` (`get` here; `BackendClient` takes one). Its library counterpart is
aiohttp's client with the same caps around it (tests/fixtures/aiohttp_get.py), and
tests/integration/test_fast_http_parity.py runs the same servers' answers through both
(docs/architecture.md, "Fast paths and their library counterparts").
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import resource
import socket
import ssl
import time
import weakref
from typing import Any, Protocol
from urllib.parse import urlsplit

from .. import __version__
from .http_answer import MAX_HEAD as MAX_HEAD
from .http_answer import MAX_HEADERS as MAX_HEADERS
from .http_answer import BodyTooLarge as BodyTooLarge
from .http_answer import HttpClosed as HttpClosed
from .http_answer import HttpError as HttpError
from .http_answer import HttpRefused as HttpRefused
from .http_answer import HttpTimeout as HttpTimeout
from .http_answer import ProbeError as ProbeError
from .http_answer import Response as Response
from .http_answer import _Reader

DNS_TTL = 10.0  # seconds a resolved name is kept (aiohttp's default)
KEEP_IDLE = 60.0  # seconds a connection the server left open waits for the next read (NATs and load balancers keep idle flows minutes)
MISSES = 2  # reads in a row that found the kept connection closed, before asking without keep-alive
PLAIN_READS = 30  # reads then made with Connection: close (5 min at 10 s rounds), before trying again

_default_tls: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    """The default TLS context (system CAs, host names checked), made once: making one
    loads the CA store."""
    global _default_tls
    if _default_tls is None:
        _default_tls = ssl.create_default_context()
    return _default_tls


class Target:
    """Where a URL's reads go: scheme, host, port, the request's first lines, and (with
    `keepalive`) the one connection kept for the next read. Made once per backend; raises
    ValueError for a URL it cannot read. `close()` drops the kept connection."""

    def __init__(self, url: str, path: str, headers: dict[str, str], *, keepalive: bool = False):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("not an http(s) URL with a host")
        self.tls = scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        authority = host if parts.port is None else f"{host}:{parts.port}"
        target = (parts.path.rstrip("/") + path) or "/"
        self.authority, self.path, self.headers = authority, target, dict(headers)  # for a library client (the seam's other side)
        lines = [f"GET {target} HTTP/1.1", f"Host: {authority}", f"User-Agent: llm-health/{__version__}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        for line in lines:  # no line break or control character may split a line in two
            if any(ord(c) < 32 or ord(c) == 127 for c in line):
                raise ValueError("a control character in the URL or in a header value")
        try:
            self.kept_request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            self.request = ("\r\n".join([*lines, "Connection: close"]) + "\r\n\r\n").encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError("a character outside Latin-1 in the URL or in a header value") from None
        self.keepalive = keepalive
        self._idle: _Conn | None = None
        self._kept_one = False  # the last read kept its connection
        self._misses = 0  # reads in a row that found the connection kept for them gone
        self._plain = 0  # reads left that say Connection: close, after MISSES such reads
        self._addresses: list[tuple[Any, ...]] = []
        self._resolved_at = -DNS_TTL
        try:  # an IP address is its own answer, for ever
            ip = ipaddress.ip_address(self.host)
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            self._addresses, self._resolved_at = [(family, (self.host, self.port))], math.inf
        except ValueError:
            pass

    def take(self) -> tuple[_Conn | None, bool]:
        """(the kept connection if it is still open, whether this read may keep its own).
        A server that closed the kept connection before `MISSES` reads in a row came (one
        that closes idle ones sooner than the rounds come, as vLLM does at 10 s rounds) is
        asked with `Connection: close` for the next `PLAIN_READS` reads: a connection held
        for nothing costs more than none."""
        if not self.keepalive:
            return None, False
        conn, kept_one = self._idle, self._kept_one
        self._kept_one = False
        if conn is not None:  # never kept while reads say Connection: close
            conn.unpark()
            if conn.open and not conn.transport.is_closing():
                return conn, True
            conn.close()
        if kept_one:
            return None, self.missed()
        if self._plain:
            self._plain -= 1
            return None, False
        return None, True

    def missed(self) -> bool:
        """The connection kept for this read was gone when it came; whether this read may
        keep its own."""
        self._misses += 1
        if self._misses >= MISSES:
            self._misses, self._plain = 0, PLAIN_READS
        if self._plain:
            self._plain -= 1
            return False
        return True

    def park(self, conn: _Conn, loop: asyncio.AbstractEventLoop) -> None:
        """Keep `conn` for the next read (`KEEP_IDLE` seconds at most), or close it where a
        connection is kept already or too many are."""
        if self._idle is not None or len(_kept) >= _max_kept():
            conn.close()
            return
        self._idle, self._kept_one = conn, True
        conn.kept_by = self
        conn.expiry = loop.call_later(KEEP_IDLE, conn.close)
        _kept.add(conn)

    def close(self) -> None:
        conn = self._idle
        if conn is not None:
            conn.close()

    def known(self) -> list[tuple[Any, ...]] | None:
        """The addresses, where no resolve is due (an IP address, or a name resolved less
        than `DNS_TTL` seconds ago); else None."""
        if self._addresses and (self._resolved_at == math.inf or time.monotonic() - self._resolved_at < DNS_TTL):
            return self._addresses
        return None

    async def addresses(self, loop: asyncio.AbstractEventLoop) -> list[tuple[Any, ...]]:
        """(family, sockaddr) to try, in the resolver's order; an IP address is not resolved."""
        known = self.known()
        if known is not None:
            return known
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        found = [(family, sockaddr) for family, _, _, _, sockaddr in infos]
        if not found:
            raise OSError(f"{self.host} has no address")
        self._addresses, self._resolved_at = found, time.monotonic()
        return found


class HttpGet(Protocol):
    """The seam: one GET of `target` (its host, path and headers; with `keepalive`, a
    connection the server leaves open may carry the next one). The answer's status and
    headers; for a 200 its body, gzip undone, at most `max_bytes` of it; no redirect
    followed. Raises HttpError, and only it: `HttpTimeout` past `timeout` (or every
    address's `connect_timeout`), `HttpRefused`, `BodyTooLarge`, `HttpClosed` for a
    connection that ended before any byte of the answer, a plain HttpError otherwise."""

    async def __call__(self, target: Target, *, connect_timeout: float, timeout: float, max_bytes: int) -> Response: ...


_kept: weakref.WeakSet[_Conn] = weakref.WeakSet()  # connections parked in a Target
_kept_max = 0


def _max_kept() -> int:
    """Half the process's file descriptors (its soft RLIMIT_NOFILE, read once)."""
    global _kept_max
    if not _kept_max:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        _kept_max = max(1, (soft if soft != resource.RLIM_INFINITY else 1 << 20) // 2)
    return _kept_max


class _Conn(asyncio.Protocol):
    """One connection: hands what arrives to the answer being read (`reader`), and closes
    when anything arrives with no answer being read."""

    def __init__(self) -> None:
        self.transport: Any = None  # uvloop's transports are no asyncio.Transport subclasses
        self.reader: _Reader | None = None
        self.open = True
        self.kept_by: Target | None = None
        self.expiry: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.reader is not None:
            self.reader.data_received(data)
        else:  # bytes nobody asked for: the connection cannot be trusted with the next answer
            self.abort()

    def eof_received(self) -> bool | None:
        if self.reader is not None:
            self.reader.connection_lost(None)
        self.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self.unpark()
        if self.reader is not None:
            self.reader.connection_lost(exc)

    def unpark(self) -> None:
        if self.kept_by is not None:
            if self.kept_by._idle is self:
                self.kept_by._idle = None
            self.kept_by = None
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None
        _kept.discard(self)

    def close(self) -> None:
        self.open = False
        self.unpark()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.open = False
        self.unpark()
        if self.transport is not None:
            self.transport.abort()


def _expire(done: asyncio.Future[Response], timeout: float) -> None:
    if not done.done():
        done.set_exception(HttpTimeout(f"timeout after {timeout:g}s"))


class _Stale(ProbeError):
    """A kept connection closed by the server before any byte of the answer."""


async def get(target: Target, *, connect_timeout: float, timeout: float, max_bytes: int) -> Response:
    """One GET of `target`, on its kept connection or a new one. Raises HttpError, and only it.

    The total timeout is one timer on the answer's future; the resolve (where one is due)
    and each address's connect run in a timeout context of their own (`_connect`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    conn, keep = target.take()
    if conn is not None:
        try:
            resp = await _exchange(loop, target, conn, deadline, timeout, max_bytes, reused=True, keep=True)
            target._misses = 0  # the kept connection carried the read: no miss in a row
            return resp
        except _Stale:  # closed by the server as the request went out: once more, on a new connection
            keep = target.missed()
    conn = await _connect(loop, target, deadline, connect_timeout, timeout)
    return await _exchange(loop, target, conn, deadline, timeout, max_bytes, reused=False, keep=keep)


async def _connect(loop: asyncio.AbstractEventLoop, target: Target, deadline: float, connect_timeout: float, timeout: float) -> _Conn:
    """A new connection to the first of the target's addresses that takes one. Each
    address's connect has `connect_timeout` of its own (within the total): a name whose
    first address drops the SYN (an IPv6 route that goes nowhere) still reaches the next.
    A refusal anywhere is the answer `refused`; only addresses that all timed out make a
    connect timeout."""
    addresses = target.known()
    try:
        if addresses is None:
            async with asyncio.timeout_at(deadline):
                addresses = await target.addresses(loop)
    except TimeoutError:
        raise HttpTimeout(f"timeout after {timeout:g}s") from None
    except OSError as exc:
        raise HttpRefused(f"connection refused or unreachable (cannot resolve {target.host[:100]}: {exc.strerror or exc})") from None
    error: OSError | None = None
    for family, sockaddr in addresses:
        ends = min(deadline, loop.time() + connect_timeout)
        try:
            async with asyncio.timeout_at(ends):
                _, conn = await loop.create_connection(
                    _Conn,
                    sockaddr[0],
                    sockaddr[1],
                    family=family,
                    ssl=_tls() if target.tls else None,
                    server_hostname=target.host if target.tls else None,
                )
            return conn
        except TimeoutError:
            if ends >= deadline:  # the total ran out: it is the one named
                raise HttpTimeout(f"timeout after {timeout:g}s") from None
        except ssl.SSLError as exc:
            raise HttpError(f"TLS: {str(exc)[:200]}") from None
        except OSError as exc:
            error = exc
    if error is None and addresses:  # every address timed out
        raise HttpTimeout(f"connect timeout after {connect_timeout:g}s")
    why = (error.strerror or type(error).__name__) if error else "no address"
    raise HttpRefused(f"connection refused or unreachable ({why})")


async def _exchange(
    loop: asyncio.AbstractEventLoop, target: Target, conn: _Conn, deadline: float, timeout: float, max_bytes: int, *, reused: bool, keep: bool
) -> Response:
    """The request written on `conn` and its answer read; `conn` kept after a reusable
    answer. Raises _Stale for a kept connection that ended before the answer's first byte."""
    done: asyncio.Future[Response] = loop.create_future()
    reader = conn.reader = _Reader(done, max_bytes, conn)
    timer = loop.call_at(deadline, _expire, done, timeout)
    try:
        if conn.open:
            conn.transport.write(target.kept_request if keep else target.request)
        else:  # closed while it was being connected
            reader.connection_lost(None)
        try:
            resp = await done
        except HttpError as exc:
            if reused and not reader.received and not exc.timed_out:
                raise _Stale from None
            raise
    finally:  # a failed, timed-out or cancelled read leaves no connection, timer or pending result behind
        timer.cancel()
        done.cancel()
        if conn.reader is reader:
            conn.reader = None
            conn.abort()
    if reader.reusable and keep and conn.open:
        target.park(conn, loop)
    elif conn.open:
        conn.close()
    return resp
