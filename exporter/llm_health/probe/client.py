"""HTTP calls to one backend: `/metrics`, `/v1/models`, the 1-token probe, sleep flags.

`/metrics`, the read of every round, and the sleep flags (asked every round of an engine
that stands still with work in flight) go through the fast path of probe.fast_http (with
`keepalive`, as the exporter's rounds ask, on the connection the server left open after
the last round's read, where it did; otherwise a new one); the rare calls go through
aiohttp. Both keep the same guarantees. Every call has a connect timeout
and a total timeout of its own; every body is capped in size (`/metrics` at `max_bytes`,
the small JSON answers at `SMALL_BODY`), after gzip is undone, so a small compressed bomb
is caught too. No redirect is ever followed: a 3xx is
an answer like any other error status, so no server can send llm-health's requests (a
probe's POST included) to a path or host of its choosing. Errors come back as values
that say what happened (refused, timeout, HTTP status, not exposition), never as
exceptions, and never carry the API key.

The connect timeout covers the TCP connect alone (`sock_connect` in aiohttp, each
address's connect in probe.fast_http), never a wait for a pooled connection: the exporter gives
each backend a session of its own for the rare calls, and `/metrics` uses no pool at all
(a backend's kept connection is its own), so one backend's slow or trickling answers never
hold a connection another backend waits for.

An engine with no start-time series may send its start as a header of `/metrics` (its
profile's `start_header`, integer microseconds; core.engines). `Fetched.start_header`
carries it (seconds) and the reader uses it where the payload has no start time
(`probe.pieces.read_fetched`), so a restart is seen even when the new process's counters
are already past the old ones. It is compared for equality only, never read as a time.
Where the engine's `/metrics` is a task on its inference loop's own queue
(`metrics_on_loop`), the monitor asks its health endpoint (`BackendClient.health`) when
`/metrics` times out, which such an engine answers beside that queue.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..core import engines, timing
from ..urls import base_url
from . import fast_http

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
SMALL_BODY = 1024 * 1024  # /v1/models, the probe's answer, /is_sleeping: JSON of a few KB
FLAG_TIMEOUT = 2.0  # seconds for `/is_sleeping` or `/is_paused`, connect included
_START_HEADER_VALUE = re.compile(r"[1-9][0-9]{0,18}")


def _start_header(header: str | None) -> float | None:
    """An engine's start header (integer microseconds) in seconds, or None."""
    if header is None or not _START_HEADER_VALUE.fullmatch(header.strip()):
        return None
    return int(header.strip()) / 1e6


async def _body(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    body = bytearray()
    async for chunk in resp.content.iter_chunked(65536):
        body += chunk
        if len(body) > limit:
            raise fast_http.BodyTooLarge(f"body larger than {limit} bytes")  # as the fast path says it
    return bytes(body)


async def _json(resp: aiohttp.ClientResponse) -> Any:
    return json.loads(await _body(resp, SMALL_BODY))


@dataclass(frozen=True)
class Fetched:
    """A /metrics read: the body as the text pieces it arrived in (a large body is never
    copied into one string: the reader parses piece by piece), or what went wrong."""

    parts: tuple[str, ...] | None = None
    error: str | None = None
    timed_out: bool = False
    refused: bool = False
    unavailable: bool = False  # HTTP 503: the server says it cannot serve yet (loading its model)
    closed: bool = False  # the connection ended before any byte of the answer
    seconds: float = 0.0
    size: int = 0
    start_header: float | None = None  # the engine's start header (its profile's start_header), in seconds

    @property
    def text(self) -> str | None:
        return None if self.parts is None else "".join(self.parts)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool | None  # None: the server refused the request itself (4xx): no evidence either way
    seconds: float
    detail: str
    timed_out: bool = False

    @property
    def result(self) -> str:
        """The `result` label of llm_backend_probes_total: ok, timeout or error."""
        return "ok" if self.ok else ("timeout" if self.timed_out else "error")


def _describe(exc: BaseException, timeout: float) -> tuple[str, bool, bool]:
    """(message, timed_out, refused) for a failed call, without the request's headers."""
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return f"timeout after {timeout:g}s", True, False
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"connection refused or unreachable ({exc.os_error.strerror or type(exc.os_error).__name__})", False, True
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server closed the connection", False, False
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"broken response body ({exc})", False, False
    if isinstance(exc, fast_http.BodyTooLarge):
        return str(exc), False, False
    if isinstance(exc, aiohttp.ClientError):
        return f"{type(exc).__name__}: {exc}", False, False
    return f"{type(exc).__name__}: {exc}", False, False


class BackendClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        api_key: str | None = None,
        connect_timeout: float = timing.CONNECT_TIMEOUT_S,
        metrics_timeout: float = timing.METRICS_TIMEOUT_S,
        models_timeout: float = timing.MODELS_TIMEOUT_S,
        probe_timeout: float = timing.PROBE_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keepalive: bool = False,
        get: fast_http.HttpGet = fast_http.get,
    ):
        """`keepalive`: keep the connection a server leaves open for the next `/metrics`
        read (probe.fast_http); for a client that reads every round, not for a one-off.
        `get`: the GET of `/metrics` and the sleep flags (the seam: probe.fast_http's, or
        its library counterpart in the parity test)."""
        self.session = session
        self._get = get
        self.keepalive = keepalive
        self.url = base_url(url)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.connect_timeout = connect_timeout
        self.metrics_timeout = metrics_timeout
        self.models_timeout = models_timeout
        self.probe_timeout = probe_timeout
        self.max_bytes = max_bytes
        headers = {**self._headers, "Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip"}
        self._flag_targets: dict[str, fast_http.Target] = {}  # the sleep flags' paths, two at most
        self._metrics_target: fast_http.Target | None = None
        self._metrics_target_error = ""
        try:
            self._metrics_target = fast_http.Target(self.url, "/metrics", headers, keepalive=keepalive)
        except ValueError as exc:  # never the key itself: the message names the fault only
            self._metrics_target_error = f"cannot read /metrics: {exc}"

    def close(self) -> None:
        """Close the connections kept for the next reads (the aiohttp session is the caller's)."""
        for target in (self._metrics_target, *self._flag_targets.values()):
            if target is not None:
                target.close()

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=min(self.connect_timeout, total))

    async def metrics(self) -> Fetched:
        """One read of `/metrics`, on the fast path (probe.fast_http): most of what a round costs."""
        start = time.monotonic()
        if self._metrics_target is None:
            return Fetched(error=self._metrics_target_error)
        try:
            resp = await self._get(self._metrics_target, connect_timeout=self.connect_timeout, timeout=self.metrics_timeout, max_bytes=self.max_bytes)
        except fast_http.HttpError as exc:
            error = f"payload larger than {self.max_bytes} bytes" if exc.too_large else str(exc)
            return Fetched(error=error, timed_out=exc.timed_out, refused=exc.refused, closed=exc.closed, seconds=time.monotonic() - start)
        seconds = time.monotonic() - start
        if resp.status != 200:
            return Fetched(error=f"HTTP {resp.status}", unavailable=resp.status == 503, seconds=seconds)
        parts, size = resp.parts, resp.size
        ctype = resp.headers.get("content-type", "")
        header_value: str | None = None
        for header, profile in engines.BY_START_HEADER.items():
            header_value = resp.headers.get(header)
            if header_value is not None:
                if not profile.metrics_keepalive:
                    # The engine holds one of its HTTP threads for a connection kept open: let go at once.
                    self._metrics_target.close()
                break
        start_header = _start_header(header_value)
        head = (parts[0] if parts else "")[:4096].lstrip()[:64].lower()
        if "html" in ctype or head.startswith("<"):
            return Fetched(error=f"HTML page, not Prometheus text (Content-Type {ctype or 'missing'})", seconds=seconds, size=size)
        if "json" in ctype or head.startswith("{"):
            return Fetched(error=f"JSON, not Prometheus text (Content-Type {ctype or 'missing'})", seconds=seconds, size=size)
        return Fetched(parts=parts, seconds=seconds, size=size, start_header=start_header)

    async def models(self) -> tuple[bool, str | None, str | None]:
        """(answered, first model id, error)."""
        try:
            async with self.session.get(
                self.url + "/v1/models", headers=self._headers, timeout=self._timeout(self.models_timeout), allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    return False, None, f"HTTP {resp.status}"
                data = await _json(resp)
        except Exception as exc:
            return False, None, _describe(exc, self.models_timeout)[0]
        try:
            model = data["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            return True, None, None
        # A model name goes into the probe's body only: a string of sane length, or none.
        return True, (model if isinstance(model, str) and 0 < len(model) <= 1024 else None), None

    async def health(self, path: str = "/health") -> tuple[bool, str | None, str | None]:
        """The engine's health endpoint answered 200: (answered, None, error), the shape of `models()`."""
        try:
            async with self.session.get(self.url + path, headers=self._headers, timeout=self._timeout(self.models_timeout), allow_redirects=False) as resp:
                await _body(resp, SMALL_BODY)
                if resp.status != 200:
                    return False, None, f"{path} HTTP {resp.status}"
        except Exception as exc:
            return False, None, f"{path} {_describe(exc, self.models_timeout)[0]}"
        return True, None, None

    async def probe(self, model: str | None) -> ProbeResult:
        """One 1-token completion. Only ever sent to an engine with nothing in flight."""
        start = time.monotonic()
        if model is None:
            return ProbeResult(None, 0.0, "no served model listed by /v1/models")
        payload = {"model": model, "prompt": "ok", "max_tokens": 1, "temperature": 0}
        try:
            async with self.session.post(
                self.url + "/v1/completions", json=payload, headers=self._headers, timeout=self._timeout(self.probe_timeout), allow_redirects=False
            ) as resp:
                await _body(resp, SMALL_BODY)
                seconds = time.monotonic() - start
                if resp.status == 200:
                    return ProbeResult(True, seconds, f"in {seconds * 1000:.0f} ms")
                if 400 <= resp.status < 500:
                    return ProbeResult(None, seconds, f"probe refused with HTTP {resp.status} (check model name and API key)")
                return ProbeResult(False, seconds, f"HTTP {resp.status}")
        except Exception as exc:
            detail, timed_out, _ = _describe(exc, self.probe_timeout)
            return ProbeResult(False, time.monotonic() - start, detail, timed_out)

    async def evidence(self, path: str) -> ProbeResult:
        """GET `path` (`Profile.evidence_path`) within models_timeout (a health read's),
        only for an engine already suspected: whether the inference loop answers it. The
        answer's start is the evidence (the engine sends its headers once its loop has
        taken the task); the body is never read, so nothing in it is kept. ok None: the
        server answered but not 200 (the endpoint disabled, `--no-slots`): no evidence."""
        start = time.monotonic()
        try:
            async with self.session.get(self.url + path, headers=self._headers, timeout=self._timeout(self.models_timeout), allow_redirects=False) as resp:
                seconds = time.monotonic() - start
                if resp.status == 200:
                    return ProbeResult(True, seconds, f"{path} answered in {seconds * 1000:.0f} ms")
                return ProbeResult(None, seconds, f"{path} answered HTTP {resp.status}")
        except Exception as exc:
            detail, timed_out, _ = _describe(exc, self.models_timeout)
            return ProbeResult(False, time.monotonic() - start, f"{path} {detail}", timed_out)

    async def flag(self, path: str) -> bool:
        """An engine's sleep or pause flag (vLLM's `/is_sleeping`, `/is_paused`): True only on a clear yes. Asked on the
        fast path (probe.fast_http) too: a hung engine is asked both every round."""
        target = self._flag_targets.get(path)
        if target is None:
            try:
                target = fast_http.Target(self.url, path, {**self._headers, "Accept": "application/json", "Accept-Encoding": "gzip"}, keepalive=self.keepalive)
            except ValueError:
                return False
            self._flag_targets[path] = target
        try:
            resp = await self._get(target, connect_timeout=min(self.connect_timeout, FLAG_TIMEOUT), timeout=FLAG_TIMEOUT, max_bytes=SMALL_BODY)
        except fast_http.HttpError:
            return False
        if resp.status != 200:
            return False
        try:
            data = json.loads("".join(resp.parts))
        except ValueError:
            return False
        if isinstance(data, dict):
            return any(data.get(k) is True for k in ("is_sleeping", "is_paused", "paused", "sleeping"))
        return data is True
