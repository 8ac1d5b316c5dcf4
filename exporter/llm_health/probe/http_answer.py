"""The answer of probe.fast_http's read (its docstring says what the read keeps of aiohttp's):
the status line and headers capped (`MAX_HEAD` bytes, `MAX_HEADERS` lines), an interim
1xx skipped, the body framed by Content-Length, chunks or the close, gzip undone under
the body's cap, the text decoded as it arrives; and the errors a read raises, a class
per case (the probe room's branch of the error tree)."""

from __future__ import annotations

import asyncio
import codecs
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.errors import LLMHealthError

MAX_HEAD = 64 * 1024  # status line and headers, in bytes
MAX_HEADERS = 128  # header lines
MAX_CHUNK_LINE = 1024  # a chunk's size line, extensions included
_ACCEPTED_ENCODINGS = ("gzip", "x-gzip", "identity", "")


class ProbeError(LLMHealthError):
    """The probe room's branch of the error tree (core.errors)."""


class HttpError(ProbeError):
    """A failed read: `str()` says what happened. Its cases are subclasses (httpx's shape),
    each also a flag the readers test (`timed_out`, `refused`, `too_large`, `closed`)."""

    timed_out = refused = too_large = closed = False


class HttpTimeout(HttpError):
    """No answer in time: the connect or the whole read."""

    timed_out = True


class HttpRefused(HttpError):
    """Nothing listens there, or the name does not resolve."""

    refused = True


class BodyTooLarge(HttpError):
    """The answer's body is past the reader's cap."""

    too_large = True


class HttpClosed(HttpError):
    """The connection ended before any byte of the answer (a server stopping or restarting,
    or one that answers nothing)."""

    closed = True


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # names in lower case; a repeated header's last value
    parts: tuple[str, ...]  # the body as text (UTF-8, bad bytes replaced), as it arrived
    size: int  # the body's bytes after gzip is undone


class Carrier(Protocol):
    """The connection an answer arrives on (fast_http's): the answer being read, closed or
    aborted by it."""

    reader: Any

    def close(self) -> None: ...

    def abort(self) -> None: ...


class _Reader:
    """Parses one response as its bytes arrive on `conn`; `done` gets the Response or an
    HttpError. `reusable` once it ended: the connection may carry the next request."""

    def __init__(self, done: asyncio.Future[Response], max_bytes: int, conn: Carrier):
        self.done = done
        self.max_bytes = max_bytes
        self.conn = conn
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
        self.received = False  # any byte of the answer arrived
        self.persistent = False  # HTTP/1.1 without Connection: close
        self.extra = False  # bytes past the answer's end arrived with it
        self.reusable = False

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            self.extra = True
            return
        self.received = True
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

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if not self.mode:
            self._fail((HttpError if self.received else HttpClosed)("server closed the connection"))
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
        if code[0] == "1" and code != "101":  # an interim answer (100 Continue, 103 Early Hints): the answer follows, as aiohttp reads it
            self.buf = bytearray(rest)
            if self.buf:
                self._head(self.buf)
            return
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise HttpError(f"malformed response header line: {line[:80]!r}")
            self.headers[name.lower()] = value.strip()
        self.status = int(code)
        self.persistent = version == "HTTP/1.1" and "close" not in self.headers.get("connection", "").lower()
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
                raise BodyTooLarge(f"body larger than {self.max_bytes} bytes")
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
                    self.extra = bool(buf)
                    self._finish()

    def _body(self, data: bytes | memoryview) -> None:
        if self.mode == "length":
            self.extra = len(data) > self.left
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
            raise BodyTooLarge(f"body larger than {self.max_bytes} bytes")
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
        # Reusable: the whole answer read, framed by its length or its chunks, and nothing after it.
        self.reusable = self.persistent and self.status == 200 and self.mode in ("length", "chunked") and not self.extra
        self.conn.reader = None
        if not self.reusable:
            self.conn.close()

    def _fail(self, exc: HttpError) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        self.conn.reader = None
        self.conn.abort()
