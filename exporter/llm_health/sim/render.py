"""A simulated vLLM V1 engine and its `/metrics` payload, in the exposition format vLLM
writes (prometheus_client's rendering: the same HELP and TYPE lines, label order, float
spelling, `_created` series, bucket bounds as a real vLLM payload), checked against real
payloads by tests/integration/test_sim_format.py. `SimEngine` is also the base of the other
simulated engines (sim.engines).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > largest:
                return tuple(out)
            out.append(v)
        exp += 1


def _hists(max_model_len: int) -> dict[str, _Hist]:
    tokens = buckets_1_2_5(max_model_len)
    return {n: _Hist(tokens if b is _TOKEN_BUCKETS else b) for n, _, b in _HISTOGRAMS}


def _f(value: float) -> str:
    return floatToGoString(value)


class _Hist:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[int, ...] | tuple[float, ...]):
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
    # The request lifecycle, on when max_num_seqs > 0 (the `overloaded` scenario): requests
    # arrive at `arrivals_per_second` into `waiting`, are scheduled first come first served
    # into at most max_num_seqs running places, finish after `request_tokens` steps (the
    # success counter, as vLLM's request_success_total), and `preempt()` puts the most
    # recently scheduled one back at the head of the queue. Off, the counts stay as set.
    max_num_seqs: int = 0
    arrivals_per_second: float = 0.0
    request_tokens: int = 20
    _left: list[int] = field(default_factory=list)  # steps left per running request, in scheduling order
    _arrival_carry: float = 0.0

    def __post_init__(self) -> None:
        if not self.hists:
            self.hists = _hists(self.max_model_len)

    @property
    def steps(self) -> int:
        return self.hists["vllm:iteration_tokens_total"].count

    def _whole(self, units: float) -> int:
        """The whole steps in `units` plus what earlier calls left over; the fraction is kept."""
        self._carry += units
        whole = int(self._carry)
        self._carry -= whole
        return whole

    def _schedule(self) -> None:
        while self.waiting > 0 and len(self._left) < self.max_num_seqs:
            self.waiting -= 1
            self._left.append(self.request_tokens)
        self.running = len(self._left)

    def preempt(self) -> None:
        """vLLM's preemption: the most recently scheduled running request goes back to the
        head of the waiting queue, its work lost; num_preemptions_total counts it."""
        if self._left:
            self._left.pop()
            self.waiting += 1
            self.running = len(self._left)
            self.preemptions += 1

    def _lifecycle(self, seconds: float) -> None:
        self._arrival_carry += seconds * self.arrivals_per_second
        arrived = int(self._arrival_carry)
        self._arrival_carry -= arrived
        self.waiting += arrived
        if len(self._left) != self.running:  # counts set from outside: take them as running requests
            self._left = [self.request_tokens] * self.running
        self._schedule()

    def advance(self, seconds: float) -> None:
        if self.max_num_seqs > 0 and self.mode == "decode":
            self._lifecycle(seconds)
        if self.mode == "decode" and self.running > 0:
            # One step per output token per request in the batch: batch steps at the pace of one request.
            steps = self._whole(seconds * self.tokens_per_second)
            if steps and self.max_num_seqs > 0:
                self._left = [left - steps for left in self._left]
                done = sum(1 for left in self._left if left <= 0)
                if done:
                    self.finish(done, generation_tokens=self.request_tokens, seconds=self.request_tokens / self.tokens_per_second)
                    self._left = [left for left in self._left if left > 0]
                    self._schedule()
            if steps:
                self._decoded(steps)
                self.generation_tokens += steps * self.running
                self.kv_usage = min(0.95, self.kv_usage + 0.0001 * steps)
        elif self.mode == "prefill":
            self._prefilling(seconds)

    def _decoded(self, steps: int) -> None:
        """`steps` decode steps of the running batch, as the engine counts them."""
        self.hists["vllm:iteration_tokens_total"].observe(self.running, steps)

    def _prefilling(self, seconds: float) -> None:
        """`seconds` into a long prefill: KV usage rises, no step is counted yet."""
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
        self._left = []
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

    def gauge(name: str, help_: str, attr: str) -> None:
        add(f"# HELP {name} {help_}")
        add(f"# TYPE {name} gauge")
        for e, lab in zip(engines, lbl):
            add(f"{name}{{{lab}}} {_f(float(getattr(e, attr)))}")

    def counter(name: str, help_: str, attr: str) -> None:
        add(f"# HELP {name}_total {help_}")
        add(f"# TYPE {name}_total counter")
        for e, lab in zip(engines, lbl):
            add(f"{name}_total{{{lab}}} {_f(float(getattr(e, attr)))}")
        add(f"# HELP {name}_created {help_}")
        add(f"# TYPE {name}_created gauge")
        for e, lab in zip(engines, lbl):
            add(f"{name}_created{{{lab}}} {_f(e.created)}")

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", "running")
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "waiting")
    add(
        "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
    )
    add("# TYPE vllm:engine_sleep_state gauge")
    for e, lab in zip(engines, lbl):
        asleep = e.mode == "sleeping"
        add(f'vllm:engine_sleep_state{{{lab},sleep_state="awake"}} {_f(0.0 if asleep else 1.0)}')
        add(f'vllm:engine_sleep_state{{{lab},sleep_state="weights_offloaded"}} {_f(1.0 if asleep else 0.0)}')
        add(f'vllm:engine_sleep_state{{{lab},sleep_state="discard_all"}} {_f(0.0)}')
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage")
    counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", "prefix_queries")
    add("# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.")
    add("# TYPE vllm:prefix_cache_hits_total counter")
    for lab in lbl:
        add(f"vllm:prefix_cache_hits_total{{{lab}}} 0.0")
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions")
    # vLLM 0.32's own queue caps (--max-num-queued-reqs / -tokens): per model and reason, no
    # engine label, both reasons made at start; a simulated engine has no cap, so 0.
    rejections = "Number of admission attempts rejected by a queue limit, by reason."
    add(f"# HELP vllm:admission_rejections_total {rejections}")
    add("# TYPE vllm:admission_rejections_total counter")
    for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
        add(f'vllm:admission_rejections_total{{model_name="{model}",reason="{reason}"}} {_f(0.0)}')
    add(f"# HELP vllm:admission_rejections_created {rejections}")
    add("# TYPE vllm:admission_rejections_created gauge")
    for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
        add(f'vllm:admission_rejections_created{{model_name="{model}",reason="{reason}"}} {_f(engines[0].created)}')
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
        for e, lab in zip(engines, lbl):
            h = e.hists[name]
            for b, c in zip(bounds, h.counts):
                add(f'{name}_bucket{{{lab},le="{_f(float(b))}"}} {_f(float(c))}')
            add(f'{name}_bucket{{{lab},le="+Inf"}} {_f(float(h.count))}')
            add(f"{name}_count{{{lab}}} {_f(float(h.count))}")
            add(f"{name}_sum{{{lab}}} {_f(h.sum)}")
        add(f"# HELP {name}_created {help_}")
        add(f"# TYPE {name}_created gauge")
        for e, lab in zip(engines, lbl):
            add(f"{name}_created{{{lab}}} {_f(e.created)}")
    return "\n".join(out) + "\n"
