"""A simulated fleet of inference servers on loopback, for tests and the demo.

Each `SimServer` is a real aiohttp server that answers like a vLLM V1 API server:
`/metrics` (rendered by `sim.render`), `/v1/models`, `/v1/completions`, `/health`,
`/is_sleeping`, `/is_paused`; `SimServer(name, kind=...)` answers like another engine
(sim.engines: one module per engine, its `/metrics` body and headers, its answers, the
sleep endpoints of the profile it simulates). Engine state
advances with `advance(seconds)`, driven by the test or by a ticker task (the demo), so
every scenario is deterministic under test.

Every completion that arrives is logged with the work in flight at that moment, so tests
can prove that no request was ever sent to a busy engine.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
from dataclasses import dataclass

from aiohttp import web

from . import engines as sim_engines
from .engines.base import ADMITTED_HEADER
from .render import SimEngine


@dataclass
class Received:
    path: str
    running: int
    waiting: int
    admitted: bool = False  # forwarded by an admission door (the demo's traffic), not a health check

    @property
    def while_busy(self) -> bool:
        return self.running > 0 or self.waiting > 0


async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, keepalive_timeout: float = 75.0) -> tuple[web.AppRunner, int]:
    """Start `app` on host:port (0: a free port); its runner and the port it got.
    `keepalive_timeout`: seconds an idle connection is kept (aiohttp's default, 75; vLLM's
    uvicorn closes one after 5)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1, keepalive_timeout=keepalive_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None and isinstance(server, asyncio.Server)
    return runner, int(server.sockets[0].getsockname()[1])


class _Served:
    """A simulated server's life on loopback: `start` on a free port, `stop`, `url`."""

    _runner: web.AppRunner | None = None
    port: int | None = None
    keepalive_timeout = 75.0  # aiohttp's default; bench_scale sets vLLM's 5 s

    def app(self) -> web.Application:
        raise NotImplementedError

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner, self.port = await serve_app(self.app(), host, port, self.keepalive_timeout)
        return self.url

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class SimServer(_Served):
    """One simulated vLLM API server on 127.0.0.1, or with `kind` another engine's server
    (sim.engines.FLAVORS; one whose flavor has `one_engine` runs one inference loop).

    `metrics_mode`: `ok`, `404`, `html`, `garbage`, `slow` (answers after `slow_seconds`),
    `huge` (a body past any sane cap). `multiprocess`: no `process_start_time_seconds`, as
    with `--api-server-count > 1`. `probe_hangs`: completions never answer (a hung engine
    with nothing in flight: vLLM does not even count the request as waiting). `loading`:
    the model still loads, `/metrics` answers 503 (and, where the flavor says so, `/health`
    and completions). `loop_stuck`: the inference loop stopped outside a decode: `/metrics`
    (a task on that loop) never answers, nor does what the flavor serves from the loop.
    """

    def __init__(self, name: str, engines: int = 1, model: str = "sim-model", api_key: str | None = None, max_model_len: int = 32768, kind: str = "vllm"):
        self.flavor = sim_engines.flavor(kind)
        if self.flavor.one_engine and engines != 1:
            raise ValueError(f"a {kind} server has one inference loop: engines=1")
        self.name = name
        self.kind = kind
        self.model = model
        self.engines: list[SimEngine] = self.flavor.make_engines(engines, max_model_len)
        self.start_time: float = float(int(time.time()))
        # the start header of an engine that sends one: CLOCK_MONOTONIC microseconds at start
        self.start_us: int = time.monotonic_ns() // 1000
        self.loading = False
        self.loop_stuck = False
        self.multiprocess = False
        self.metrics_mode = "ok"
        self.slow_seconds = 0.0
        self.probe_hangs = False
        self.paused = False
        self.api_key = api_key
        self.received: list[Received] = []
        self.metrics_reads = 0

    # --- state -----------------------------------------------------------------------
    @property
    def running(self) -> int:
        return sum(e.running for e in self.engines)

    @property
    def waiting(self) -> int:
        return sum(e.waiting for e in self.engines)

    def advance(self, seconds: float) -> None:
        for e in self.engines:
            e.advance(seconds)

    def restart(self, keep_start_time: bool = False) -> None:
        """A new process: counters reset; a new start time (and start header) unless
        `keep_start_time`."""
        for e in self.engines:
            e.reset()
        if not keep_start_time:
            self.start_time += 1.0 + max(0.0, time.time() - self.start_time)
            self.start_us = max(self.start_us + 1, time.monotonic_ns() // 1000)

    def completions_while_busy(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("completions") and r.while_busy and not r.admitted]

    def payload(self) -> str:
        return self.flavor.payload(self)

    def _metrics_headers(self) -> dict[str, str]:
        return self.flavor.metrics_headers(self)

    def _metrics_body(self) -> bytes:
        body = self.payload().encode()
        self.flavor.after_metrics_read(self)
        return body

    # --- HTTP ------------------------------------------------------------------------
    def authorised(self, request: web.Request) -> bool:
        return self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}"

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.metrics_reads += 1
        mode = self.metrics_mode
        if self.loading:
            return self.flavor.loading_response()
        if self.loop_stuck:
            await asyncio.sleep(3600)
        if mode == "404":
            return web.Response(status=404, text='{"detail":"Not Found"}', content_type="application/json")
        if mode == "html":
            return web.Response(text="<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="text/html")
        if mode == "garbage":
            return web.Response(text='vllm:num_requests_running{model_name="x" 1\n\x00\x01 not exposition', content_type="text/plain")
        if mode == "huge":
            return web.Response(body=b"# padding\n" * 3_000_000, content_type="text/plain")
        if mode == "gzip":
            resp = web.Response(body=self._metrics_body(), headers=self._metrics_headers())
            resp.enable_compression(web.ContentCoding.gzip)
            return resp
        if mode == "gzip_bomb":
            # 64 MiB of comment lines in about 64 KiB on the wire: the size cap must apply after gunzip.
            bomb = gzip.compress(b"#" * (64 * 1024 * 1024), compresslevel=9)
            return web.Response(body=bomb, headers={"Content-Type": "text/plain", "Content-Encoding": "gzip"})
        if mode == "slow":
            await asyncio.sleep(self.slow_seconds)
        return web.Response(body=self._metrics_body(), headers=self._metrics_headers())

    async def _models(self, request: web.Request) -> web.Response:
        return await self.flavor.models(self, request)

    async def _completions(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, self.running, self.waiting, admitted=ADMITTED_HEADER in request.headers))
        return await self.flavor.completion(self, request)

    async def _health(self, request: web.Request) -> web.Response:
        return await self.flavor.health(self, request)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": any(e.mode == "sleeping" for e in self.engines)})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/health", self._health)
        profile = self.flavor.profile  # the sleep endpoints of the engine simulated, if any
        if profile.sleep_path:
            app.router.add_get(profile.sleep_path, self._is_sleeping)
        if profile.pause_path:
            app.router.add_get(profile.pause_path, self._is_paused)
        return app


class SimProxy(_Served):
    """A least-connection style proxy: each `/metrics` read may come from another backend,
    which is why a proxy is checked through `/v1/models` only."""

    def __init__(self, name: str, backends: list[SimServer]):
        self.name = name
        self.backends = backends
        self._next = 0
        self.metrics_reads = 0
        self.models_reads = 0

    def _pick(self) -> SimServer:
        self._next = (self._next + 1) % len(self.backends)
        return self.backends[self._next]

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.metrics_reads += 1
        return await self._pick()._metrics(request)

    async def _models(self, request: web.Request) -> web.Response:
        self.models_reads += 1
        return await self._pick()._models(request)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        return app


def dead_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- scenarios ------------------------------------------------------------------------


def saturated(server: SimServer, running: int = 12, waiting: int = 3, tokens_per_second: float = 10.0) -> None:
    """Every slot taken (max-num-seqs 12), more waiting, engine progressing."""
    for e in server.engines:
        e.mode, e.running, e.waiting, e.tokens_per_second, e.kv_usage = "decode", running, waiting, tokens_per_second, 0.6


def overloaded(server: SimServer, max_num_seqs: int = 4, arrivals_per_second: float = 3.0, request_tokens: int = 20, tokens_per_second: float = 10.0) -> None:
    """A saturated engine whose queue ages: requests arrive faster than it serves them (4
    places, 2 s a request: 2 a second served, 3 arriving), so `waiting` grows and its head
    gets older; the counters move as vLLM's do (SimEngine's request lifecycle)."""
    for e in server.engines:
        e.mode, e.kv_usage, e.tokens_per_second = "decode", 0.6, tokens_per_second
        e.max_num_seqs, e.arrivals_per_second, e.request_tokens = max_num_seqs, arrivals_per_second, request_tokens


def batch_job(server: SimServer, running: int = 3, tokens_per_second: float = 8.0) -> None:
    """A batch job: 2-4 long requests at about 8 tokens/s."""
    for e in server.engines:
        e.mode, e.running, e.waiting, e.tokens_per_second, e.kv_usage = "decode", running, 0, tokens_per_second, 0.2


def long_prefill(server: SimServer) -> None:
    """V1: one long prompt in chunked prefill, no other request decoding: only KV usage moves."""
    for e in server.engines:
        e.mode, e.running, e.waiting, e.kv_usage = "prefill", 1, 0, 0.05


def hang(server: SimServer, engine: int | None = None) -> None:
    """The engine stops dead with work in flight (a SIGSTOPped EngineCore)."""
    for i, e in enumerate(server.engines):
        if engine is None or i == engine:
            e.mode = "hung"
            if not e.running and not e.waiting:
                e.running = 4


def hang_waiting(server: SimServer) -> None:
    """vLLM #39863: the engine died silently; running 0, waiting 3, nothing moves."""
    for e in server.engines:
        e.mode, e.running, e.waiting = "hung", 0, 3


def sleep(server: SimServer) -> None:
    for e in server.engines:
        e.mode = "sleeping"


def idle(server: SimServer) -> None:
    for e in server.engines:
        e.mode, e.running, e.waiting = "idle", 0, 0


def stuck(server: SimServer) -> None:
    """The inference loop stopped outside a decode (an engine whose `/metrics` is a task on
    it): `/metrics` and what else the loop serves never answer, `/health` does. Nothing moves."""
    for e in server.engines:
        e.mode = "hung"
    server.loop_stuck = True


SCENARIOS = {
    "idle": idle,
    "saturated": saturated,
    "overloaded": overloaded,
    "batch": batch_job,
    "long_prefill": long_prefill,
    "hung": hang,
    "hung_waiting": hang_waiting,
    "sleeping": sleep,
    "stuck": stuck,
}
