"""A lean HTTP/1.1 GET for the one read every round makes: a backend's `/metrics`.

A round is mostly this read (bench/bench_client.py, bench/bench_scale.py). A real vLLM
closes a connection idle for 5 s, so at 10 s rounds every read opens a new connection,
and aiohttp's client spends about three times what the read needs on setting one up
(connector, happy eyeballs, URL objects, a request and a response object). This module is
the read alone, on an asyncio protocol: one connection per read (`Connection: close`), the
request written once, the answer parsed as it arrives. It keeps every guarantee of the
aiohttp read it replaces:

- a connect timeout on each TCP (and TLS) connect and a total timeout on the whole read;
- the body capped after gzip is undone (`max_bytes`), so a small compressed bomb is
  caught, and the head capped too (`MAX_HEAD` bytes, `MAX_HEADERS` lines);
- no redirect followed: a 3xx is an answer like any other status;
- a body as Content-Length, chunked or read to the close, and gzip or identity; anything
  else is an error that names it;
- TLS verified as aiohttp verifies it (the default context: system CAs, host name);
- names resolved by the event loop and kept for `DNS_TTL` seconds, as aiohttp keeps them;
- errors are values that say what happened, never exceptions, and never carry the
  request's headers (the API key).

The other calls (`/v1/models`, the probe, `/health`, the sleep flags) are rare and stay
on aiohttp (probe.client).
"""

from __future__ import annotations

import asyncio
import codecs
import ipaddress
import math
import socket
import ssl
import time
import zlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .. import __version__

MAX_HEAD = 64 * 1024  # status line and headers, in bytes
MAX_HEADERS = 128  # header lines
MAX_CHUNK_LINE = 1024  # a chunk's size line, extensions included
DNS_TTL = 10.0  # seconds a resolved name is kept (aiohttp's default)
_ACCEPTED_ENCODINGS = ("gzip", "x-gzip", "identity", "")

_default_tls: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    """The default TLS context (system CAs, host names checked), made once: making one
    loads the CA store."""
    global _default_tls
    if _default_tls is None:
        _default_tls = ssl.create_default_context()
    return _default_tls


class HttpError(Exception):
    """A failed read: `str()` says what happened."""

    def __init__(self, message: str, *, timed_out: bool = False, refused: bool = False, too_large: bool = False):
        super().__init__(message)
        self.timed_out, self.refused, self.too_large = timed_out, refused, too_large


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header's last value
    parts: tuple[str, ...]  # the body as text (UTF-8, bad bytes replaced), as it arrived
    size: int  # the body's bytes after gzip is undone


class Target:
    """Where a URL's reads go: scheme, host, port, the request's first lines. Made once per
    backend; raises ValueError for a URL it cannot read."""

    def __init__(self, url: str, path: str, headers: dict[str, str]):
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
        lines = [f"GET {target} HTTP/1.1", f"Host: {authority}", f"User-Agent: llm-health/{__version__}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines.append("Connection: close")
        for line in lines:  # no line break or control character may split a line in two
            if any(ord(c) < 32 or ord(c) == 127 for c in line):
                raise ValueError("a control character in the URL or in a header value")
        try:
            self.request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError("a character outside Latin-1 in the URL or in a header value") from None
        self._addresses: list[tuple[Any, ...]] = []
        self._resolved_at = -DNS_TTL
        try:  # an IP address is its own answer, for ever
            ip = ipaddress.ip_address(self.host)
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            self._addresses, self._resolved_at = [(family, (self.host, self.port))], math.inf
        except ValueError:
            pass

    async def addresses(self, loop: asyncio.AbstractEventLoop) -> list[tuple[Any, ...]]:
        """(family, sockaddr) to try, in the resolver's order; an IP address is not resolved."""
        if self._addresses and (self._resolved_at == math.inf or time.monotonic() - self._resolved_at < DNS_TTL):
            return self._addresses
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        found = [(family, sockaddr) for family, _, _, _, sockaddr in infos]
        if not found:
            raise OSError(f"{self.host} has no address")
        self._addresses, self._resolved_at = found, time.monotonic()
        return found


class _Reader(asyncio.Protocol):
    """Parses one response as its bytes arrive; `done` gets the Response or an HttpError."""

    def __init__(self, done: asyncio.Future[Response], max_bytes: int):
        self.done = done
        self.max_bytes = max_bytes
        self.transport: Any = None  # uvloop's transports are no asyncio.Transport subclasses
        self.buf = bytearray()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.mode = ""  # "length", "chunked" or "close" once the head is read
        self.left = 0  # body bytes still due ("length"), or of the current chunk ("chunked")
        self.chunk_state = "size"  # chunked: size, data, crlf or trailer
        self.gunzip: Any = None
        self.text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.parts: list[str] = []
        self.size = 0

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        try:
            if not self.mode:
                if self.buf:
                    self.buf += data
                    self._head(self.buf)
                else:  # most heads arrive whole, with the body's first bytes: no copy
                    self._head(data)
            elif self.mode == "chunked":
                self.buf += data
                self._chunks()
            else:
                self._body(data)
        except HttpError as exc:
            self._fail(exc)

    def eof_received(self) -> bool | None:
        self.connection_lost(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if not self.mode:
            self._fail(HttpError("server closed the connection"))
        elif self.mode == "close":
            self._finish()
        else:
            why = f"{self.left} bytes of the body missing" if self.mode == "length" else "the chunked body did not end"
            self._fail(HttpError(f"broken response body (the connection closed: {why})"))

    # -- parsing

    def _head(self, data: bytes | bytearray) -> None:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) > MAX_HEAD:
                raise HttpError(f"response head larger than {MAX_HEAD} bytes")
            if data is not self.buf:
                self.buf += data
            return
        if end > MAX_HEAD:
            raise HttpError(f"response head larger than {MAX_HEAD} bytes")
        lines = data[:end].decode("latin-1").split("\r\n")
        rest = memoryview(data)[end + 4 :]
        self.buf = bytearray()
        version, _, tail = lines[0].partition(" ")
        code = tail[:3]
        if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit() or tail[3:4] not in ("", " "):
            raise HttpError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        if len(lines) - 1 > MAX_HEADERS:
            raise HttpError(f"more than {MAX_HEADERS} response headers")
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise HttpError(f"malformed response header line: {line[:80]!r}")
            self.headers[name.lower()] = value.strip()
        self.status = int(code)
        if self.status != 200:  # the body is not read: the status is the answer
            self._finish()
            return
        encoding = self.headers.get("content-encoding", "").lower()
        if encoding not in _ACCEPTED_ENCODINGS:
            raise HttpError(f"unsupported Content-Encoding {encoding[:40]!r} (llm-health asks for gzip or none)")
        if encoding in ("gzip", "x-gzip"):
            self.gunzip = zlib.decompressobj(16 + zlib.MAX_WBITS)
        transfer = self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        if transfer:
            if transfer != "chunked":
                raise HttpError(f"unsupported Transfer-Encoding {transfer[:40]!r}")
            self.mode = "chunked"
            self.buf += rest
            self._chunks()
            return
        if length is not None:
            if not length.isdigit() or len(length) > 18:
                raise HttpError(f"bad Content-Length {length[:40]!r}")
            self.mode, self.left = "length", int(length)
            if self.left > self.max_bytes and self.gunzip is None:
                raise HttpError(f"body larger than {self.max_bytes} bytes", too_large=True)
            self._body(rest)  # finishes the read when the length is already there
            return
        self.mode = "close"
        self._body(rest)

    def _chunks(self) -> None:
        buf = self.buf
        while not self.done.done():
            if self.chunk_state == "size":
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_CHUNK_LINE:
                        raise HttpError("a chunk size line too long")
                    return
                size = bytes(buf[:end]).split(b";", 1)[0].strip()
                del buf[: end + 2]
                if not size or len(size) > 15 or any(c not in b"0123456789abcdefABCDEF" for c in size):
                    raise HttpError(f"bad chunk size {size[:20]!r}")
                self.left = int(size, 16)
                self.chunk_state = "data" if self.left else "trailer"
            elif self.chunk_state == "data":
                if not buf:
                    return
                piece = bytes(buf[: self.left])
                del buf[: len(piece)]
                self.left -= len(piece)
                self._decode(piece)
                if self.left == 0:
                    self.chunk_state = "crlf"
            elif self.chunk_state == "crlf":
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise HttpError("a chunk not followed by CRLF")
                del buf[:2]
                self.chunk_state = "size"
            else:  # trailer: header lines up to an empty one, none of them read
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise HttpError(f"chunked trailer larger than {MAX_HEAD} bytes")
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish()

    def _body(self, data: bytes | memoryview) -> None:
        if self.mode == "length":
            data = data[: self.left]
            self.left -= len(data)
        if data:
            self._decode(data)
        if self.mode == "length" and self.left == 0 and not self.done.done():
            self._finish()

    def _decode(self, data: bytes | memoryview) -> None:
        room = self.max_bytes - self.size
        if self.gunzip is not None:
            try:
                data = self.gunzip.decompress(data, room + 1)
            except zlib.error as exc:
                raise HttpError(f"broken gzip body ({exc})") from None
        self.size += len(data)
        if len(data) > room:
            raise HttpError(f"body larger than {self.max_bytes} bytes", too_large=True)
        if data:
            self.parts.append(self.text.decode(data))

    # -- ending

    def _finish(self) -> None:
        if self.gunzip is not None and self.status == 200 and not self.gunzip.eof:
            self._fail(HttpError("broken gzip body (it ended early)"))
            return
        tail = self.text.decode(b"", final=True)
        parts = tuple(p for p in (*self.parts, tail) if p)
        self.done.set_result(Response(self.status, self.headers, parts, self.size))
        self._close()

    def _fail(self, exc: HttpError) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _expire(done: asyncio.Future[Response], timeout: float) -> None:
    if not done.done():
        done.set_exception(HttpError(f"timeout after {timeout:g}s", timed_out=True))


async def get(target: Target, *, connect_timeout: float, timeout: float, max_bytes: int) -> Response:
    """One GET of `target`. Raises HttpError, and only it.

    The total timeout is one timer on the answer's future; the resolve and each connect run
    in one timeout context, moved to each connect's own deadline (two timers per read)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    done: asyncio.Future[Response] = loop.create_future()
    timer = loop.call_at(deadline, _expire, done, timeout)
    transport: Any = None
    connecting = False
    try:
        try:
            async with asyncio.timeout_at(deadline) as scope:
                try:
                    addresses = await target.addresses(loop)
                except OSError as exc:
                    raise HttpError(f"connection refused or unreachable (cannot resolve {target.host[:100]}: {exc.strerror or exc})", refused=True) from None
                error: OSError | None = None
                for family, sockaddr in addresses:
                    connecting = loop.time() + connect_timeout < deadline
                    scope.reschedule(min(deadline, loop.time() + connect_timeout))
                    try:
                        transport, _ = await loop.create_connection(
                            lambda: _Reader(done, max_bytes),
                            sockaddr[0],
                            sockaddr[1],
                            family=family,
                            ssl=_tls() if target.tls else None,
                            server_hostname=target.host if target.tls else None,
                        )
                        break
                    except ssl.SSLError as exc:
                        raise HttpError(f"TLS: {str(exc)[:200]}") from None
                    except OSError as exc:
                        error = exc
                else:
                    why = (error.strerror or type(error).__name__) if error else "no address"
                    raise HttpError(f"connection refused or unreachable ({why})", refused=True)
        except TimeoutError:
            if connecting:
                raise HttpError(f"connect timeout after {connect_timeout:g}s", timed_out=True) from None
            raise HttpError(f"timeout after {timeout:g}s", timed_out=True) from None
        transport.write(target.request)
        return await done
    finally:  # a failed, timed-out or cancelled read leaves no connection, timer or pending result behind
        timer.cancel()
        done.cancel()
        if transport is not None and not transport.is_closing():
            transport.abort()
