"""A simulated fleet of vLLM servers on loopback, for tests and the demo.

Each `SimServer` is a real aiohttp server that answers like a vLLM V1 API server:
`/metrics` in the exposition format vLLM writes (prometheus_client's rendering: the same
HELP and TYPE lines, label order, float spelling, `_created` series, bucket bounds as a
real vLLM 0.11 payload), `/v1/models`, `/v1/completions`, `/health`, `/is_sleeping`,
`/is_paused`. Engine state advances with `advance(seconds)`, driven by the test or by a
ticker task (the demo), so every scenario is deterministic under test.

Every completion that arrives is logged with the work in flight at that moment, so tests
can prove that no request was ever sent to a busy engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client.utils import floatToGoString

_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_STEP_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LAT_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (name, help, buckets) in the order vLLM V1 registers them.
_HISTOGRAMS = (
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKEN_BUCKETS),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", _TOKEN_BUCKETS),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _STEP_BUCKETS),
    ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", _TOKEN_BUCKETS),
    ("vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", _TOKEN_BUCKETS),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS),
    (
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
        _TPOT_BUCKETS,
    ),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _TPOT_BUCKETS),
    ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", _TPOT_BUCKETS),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LAT_BUCKETS),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _LAT_BUCKETS),
    ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", _LAT_BUCKETS),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _LAT_BUCKETS),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _LAT_BUCKETS),
)


def buckets_1_2_5(largest: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > largest:
                return tuple(out)
            out.append(v)
        exp += 1


def _hists(max_model_len: int) -> dict[str, "_Hist"]:
    tokens = buckets_1_2_5(max_model_len)
    return {n: _Hist(tokens if b is _TOKEN_BUCKETS else b) for n, _, b in _HISTOGRAMS}


def _f(value: float) -> str:
    return floatToGoString(value)


class _Hist:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds):
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += times
        self.count += times
        self.sum += value * times


@dataclass
class SimEngine:
    """One vLLM engine core (a data-parallel rank): what it is doing and its counters.

    `mode` drives `advance`: `idle`, `decode` (running requests make steps and tokens at
    `tokens_per_second`), `prefill` (a long chunked prefill: only KV usage moves, as in V1),
    `hung` (nothing moves), `sleeping`.
    """

    engine: str = "0"
    mode: str = "idle"
    running: int = 0
    waiting: int = 0
    tokens_per_second: float = 8.0
    kv_usage: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    success: float = 0.0
    preemptions: float = 0.0
    prefix_queries: float = 0.0
    created: float = field(default_factory=time.time)
    max_model_len: int = 32768
    hists: dict[str, _Hist] = field(default_factory=dict)
    _carry: float = 0.0

    def __post_init__(self):
        if not self.hists:
            self.hists = _hists(self.max_model_len)

    @property
    def steps(self) -> int:
        return self.hists["vllm:iteration_tokens_total"].count

    def advance(self, seconds: float) -> None:
        if self.mode == "decode" and self.running > 0:
            # One step per output token per request in the batch: batch steps at the pace of one request.
            self._carry += seconds * self.tokens_per_second
            steps = int(self._carry)
            self._carry -= steps
            if steps:
                self.hists["vllm:iteration_tokens_total"].observe(self.running, steps)
                self.generation_tokens += steps * self.running
                self.kv_usage = min(0.95, self.kv_usage + 0.0001 * steps)
        elif self.mode == "prefill":
            self.kv_usage = min(0.95, self.kv_usage + 0.01 * seconds)

    def finish_prefill(self, prompt_tokens: int) -> None:
        """The first output token of a prefilled prompt: V1 counts prompt and step only now."""
        self.prompt_tokens += prompt_tokens
        self.prefix_queries += prompt_tokens
        self.hists["vllm:iteration_tokens_total"].observe(prompt_tokens)
        self.generation_tokens += 1
        self.mode = "decode"

    def finish(self, n: int = 1, prompt_tokens: int = 256, generation_tokens: int = 256, seconds: float = 30.0) -> None:
        for name, value in (
            ("vllm:request_prompt_tokens", prompt_tokens),
            ("vllm:request_generation_tokens", generation_tokens),
            ("vllm:request_max_num_generation_tokens", generation_tokens),
            ("vllm:request_params_n", 1),
            ("vllm:request_params_max_tokens", generation_tokens),
            ("vllm:time_to_first_token_seconds", 0.05),
            ("vllm:request_time_per_output_token_seconds", seconds / max(generation_tokens, 1)),
            ("vllm:e2e_request_latency_seconds", seconds),
            ("vllm:request_queue_time_seconds", 0.01),
            ("vllm:request_inference_time_seconds", seconds),
            ("vllm:request_prefill_time_seconds", 0.05),
            ("vllm:request_decode_time_seconds", seconds),
        ):
            self.hists[name].observe(value, n)
        self.success += n
        self.prompt_tokens += prompt_tokens * n
        self.prefix_queries += prompt_tokens * n

    def reset(self) -> None:
        fresh = SimEngine(engine=self.engine, max_model_len=self.max_model_len)
        for name in ("kv_usage", "prompt_tokens", "generation_tokens", "success", "preemptions", "prefix_queries", "hists", "created"):
            setattr(self, name, getattr(fresh, name))
        self.running = self.waiting = 0
        self.mode = "idle"


def render_vllm(engines: list[SimEngine], model: str, start_time: float | None) -> str:
    """A vLLM V1 `/metrics` payload for these engines, formatted as prometheus_client does."""
    out: list[str] = []
    add = out.append
    if start_time is not None:
        add("# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.")
        add("# TYPE process_start_time_seconds gauge")
        add(f"process_start_time_seconds {_f(start_time)}")
    lbl = [f'engine="{e.engine}",model_name="{model}"' for e in engines]

    def gauge(name, help_, attr):
        add(f"# HELP {name} {help_}")
        add(f"# TYPE {name} gauge")
        for e, l in zip(engines, lbl):
            add(f"{name}{{{l}}} {_f(float(getattr(e, attr)))}")

    def counter(name, help_, attr):
        add(f"# HELP {name}_total {help_}")
        add(f"# TYPE {name}_total counter")
        for e, l in zip(engines, lbl):
            add(f"{name}_total{{{l}}} {_f(float(getattr(e, attr)))}")
        add(f"# HELP {name}_created {help_}")
        add(f"# TYPE {name}_created gauge")
        for e, l in zip(engines, lbl):
            add(f"{name}_created{{{l}}} {_f(e.created)}")

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", "running")
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting")
    add("# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.")
    add("# TYPE vllm:engine_sleep_state gauge")
    for e, l in zip(engines, lbl):
        asleep = e.mode == "sleeping"
        add(f'vllm:engine_sleep_state{{{l},sleep_state="awake"}} {_f(0.0 if asleep else 1.0)}')
        add(f'vllm:engine_sleep_state{{{l},sleep_state="weights_offloaded"}} {_f(1.0 if asleep else 0.0)}')
        add(f'vllm:engine_sleep_state{{{l},sleep_state="discard_all"}} {_f(0.0)}')
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage")
    counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "prefix_queries")
    add("# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.")
    add("# TYPE vllm:prefix_cache_hits_total counter")
    for l in lbl:
        add(f"vllm:prefix_cache_hits_total{{{l}}} 0.0")
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions")
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens")
    counter("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens")
    add("# HELP vllm:request_success_total Count of successfully processed requests.")
    add("# TYPE vllm:request_success_total counter")
    for e in engines:
        for reason, value in (("stop", 0.0), ("length", e.success), ("abort", 0.0)):
            add(f'vllm:request_success_total{{engine="{e.engine}",finished_reason="{reason}",model_name="{model}"}} {_f(value)}')
    add("# HELP vllm:request_success_created Count of successfully processed requests.")
    add("# TYPE vllm:request_success_created gauge")
    for e in engines:
        for reason in ("stop", "length", "abort"):
            add(f'vllm:request_success_created{{engine="{e.engine}",finished_reason="{reason}",model_name="{model}"}} {_f(e.created)}')
    for name, help_, _ in _HISTOGRAMS:
        bounds = engines[0].hists[name].bounds
        add(f"# HELP {name} {help_}")
        add(f"# TYPE {name} histogram")
        for e, l in zip(engines, lbl):
            h = e.hists[name]
            for b, c in zip(bounds, h.counts):
                add(f'{name}_bucket{{{l},le="{_f(float(b))}"}} {_f(float(c))}')
            add(f'{name}_bucket{{{l},le="+Inf"}} {_f(float(h.count))}')
            add(f"{name}_count{{{l}}} {_f(float(h.count))}")
            add(f"{name}_sum{{{l}}} {_f(h.sum)}")
        add(f"# HELP {name}_created {help_}")
        add(f"# TYPE {name}_created gauge")
        for e, l in zip(engines, lbl):
            add(f"{name}_created{{{l}}} {_f(e.created)}")
    return "\n".join(out) + "\n"


@dataclass
class Received:
    path: str
    running: int
    waiting: int

    @property
    def while_busy(self) -> bool:
        return self.running > 0 or self.waiting > 0


class _Served:
    """A simulated server's life on loopback: `start` on a free port, `stop`, `url`."""

    _runner: web.AppRunner | None = None
    port: int | None = None

    def app(self) -> web.Application:
        raise NotImplementedError

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.url

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class SimServer(_Served):
    """One simulated vLLM API server on 127.0.0.1.

    `metrics_mode`: `ok`, `404`, `html`, `garbage`, `slow` (answers after `slow_seconds`),
    `huge` (a body past any sane cap). `multiprocess`: no `process_start_time_seconds`, as
    with `--api-server-count > 1`. `probe_hangs`: completions never answer (a hung engine
    with nothing in flight: vLLM does not even count the request as waiting).
    """

    def __init__(self, name: str, engines: int = 1, model: str = "sim-model", api_key: str | None = None, max_model_len: int = 32768):
        self.name = name
        self.model = model
        self.engines = [SimEngine(engine=str(i), max_model_len=max_model_len) for i in range(engines)]
        self.start_time: float = float(int(time.time()))
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
        """A new process: counters reset; a new start time unless in multiprocess mode."""
        for e in self.engines:
            e.reset()
        if not keep_start_time:
            self.start_time += 1.0 + max(0.0, time.time() - self.start_time)

    def completions_while_busy(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("completions") and r.while_busy]

    def payload(self) -> str:
        return render_vllm(self.engines, self.model, None if self.multiprocess else self.start_time)

    # --- HTTP ------------------------------------------------------------------------
    def _authorised(self, request: web.Request) -> bool:
        return self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}"

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.metrics_reads += 1
        mode = self.metrics_mode
        if mode == "404":
            return web.Response(status=404, text='{"detail":"Not Found"}', content_type="application/json")
        if mode == "html":
            return web.Response(text="<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="text/html")
        if mode == "garbage":
            return web.Response(text='vllm:num_requests_running{model_name="x" 1\n\x00\x01 not exposition', content_type="text/plain")
        if mode == "huge":
            return web.Response(body=b"# padding\n" * 3_000_000, content_type="text/plain")
        if mode == "gzip":
            resp = web.Response(body=self.payload().encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
            resp.enable_compression(web.ContentCoding.gzip)
            return resp
        if mode == "gzip_bomb":
            # 64 MiB of comment lines in about 64 KiB on the wire: the size cap must apply after gunzip.
            import gzip

            bomb = gzip.compress(b"#" * (64 * 1024 * 1024), compresslevel=9)
            return web.Response(body=bomb, headers={"Content-Type": "text/plain", "Content-Encoding": "gzip"})
        if mode == "slow":
            await asyncio.sleep(self.slow_seconds)
        return web.Response(body=self.payload().encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": 1024}]}
        )

    async def _completions(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, self.running, self.waiting))
        if not self._authorised(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = await request.json()
        if body.get("model") != self.model:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist."}}, status=404)
        if self.probe_hangs or any(e.mode == "hung" for e in self.engines):
            await asyncio.sleep(3600)
        if self.running or self.waiting:
            # A real engine would queue this behind the batch; the sim makes it wait as long.
            await asyncio.sleep(3600)
        engine = self.engines[0]
        engine.finish(1, prompt_tokens=1, generation_tokens=1, seconds=0.01)
        engine.hists["vllm:iteration_tokens_total"].observe(1)
        return web.json_response(
            {
                "id": "cmpl-sim",
                "object": "text_completion",
                "model": self.model,
                "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

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
        app.router.add_get("/is_sleeping", self._is_sleeping)
        app.router.add_get("/is_paused", self._is_paused)
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

    async def _metrics(self, request):
        self.metrics_reads += 1
        return await self._pick()._metrics(request)

    async def _models(self, request):
        self.models_reads += 1
        return await self._pick()._models(request)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        return app


def dead_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- scenarios ------------------------------------------------------------------------


def saturated(server: SimServer, running: int = 12, waiting: int = 3, tokens_per_second: float = 10.0) -> None:
    """Report 1's proof: every slot taken (max-num-seqs 12), more waiting, engine progressing."""
    for e in server.engines:
        e.mode, e.running, e.waiting, e.tokens_per_second, e.kv_usage = "decode", running, waiting, tokens_per_second, 0.6


def batch_job(server: SimServer, running: int = 3, tokens_per_second: float = 8.0) -> None:
    """Report 1's batch job: 2-4 long requests at about 8 tokens/s."""
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


SCENARIOS = {
    "idle": idle,
    "saturated": saturated,
    "batch": batch_job,
    "long_prefill": long_prefill,
    "hung": hang,
    "hung_waiting": hang_waiting,
    "sleeping": sleep,
}
