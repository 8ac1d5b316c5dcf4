"""The simulated SGLang server: one unit (its `model_name`), its `/metrics` as SGLang's
Prometheus support writes it in multiprocess mode (tests/data/real-world/metrics/sglang-*:
the same families, HELP text, types, label names and bucket bounds, `_sum` before the
buckets, label names sorted, no start-time series), and the OpenAI-compatible API."""

from __future__ import annotations

from ...core.engines import SGLANG
from ..render import SimEngine, _f, _Hist
from .base import OpenAIFlavor, Served, StepEngine

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_TPOT = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_FUNC = tuple(0.05 * 1.5**i for i in range(18))
BOUNDS = {"first_token_seconds": _TTFT, "seconds": _E2E, "token_seconds": _TPOT, "queue_seconds": _FUNC}

# The request histograms: (name, help, the StepEngine histogram it renders).
_HISTS = (
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", "first_token_seconds"),
    ("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", "seconds"),
    ("time_per_output_token_seconds", "Histogram of time per output token in seconds.", "token_seconds"),
)


def _histogram(out: list[str], name: str, help_: str, hist: _Hist, label: str) -> None:
    out.append(f"# HELP sglang:{name} {help_}\n# TYPE sglang:{name} histogram\n")
    out.append(f"sglang:{name}_sum{{{label}}} {_f(hist.sum)}\n")
    for bound, count in zip(hist.bounds, hist.counts):
        out.append(f'sglang:{name}_bucket{{le="{_f(bound)}",{label}}} {_f(float(count))}\n')
    out.append(f'sglang:{name}_bucket{{le="+Inf",{label}}} {_f(float(hist.count))}\n')
    out.append(f"sglang:{name}_count{{{label}}} {_f(float(hist.count))}\n")


def render_sglang(e: StepEngine, model: str) -> str:
    """SGLang's `/metrics` for one unit, in the order and spelling it writes them."""
    label = f'model_name="{model}"'
    out: list[str] = []

    def sample(name: str, typ: str, help_: str, value: float) -> None:
        out.append(f"# HELP sglang:{name} {help_}\n# TYPE sglang:{name} {typ}\nsglang:{name}{{{label}}} {_f(float(value))}\n")

    sample("prompt_tokens_total", "counter", "Number of prefill tokens processed.", e.prompt_tokens)
    sample("generation_tokens_total", "counter", "Number of generation tokens processed.", e.generation_tokens)
    sample("token_usage", "gauge", "The token usage", round(e.kv_usage, 2))
    sample("cache_hit_rate", "gauge", "The cache hit rate", 0.0)
    for name, help_, key in _HISTS:
        _histogram(out, name, help_, e.hists[key], label)
    _histogram(out, "func_latency_seconds", "Function latency in seconds", e.hists["queue_seconds"], 'name="generate_request"')
    sample("num_running_reqs", "gauge", "The number of running requests", e.running)
    sample("num_used_tokens", "gauge", "The number of used tokens", int(e.kv_usage * e.max_model_len))
    sample("gen_throughput", "gauge", "The generate throughput (token/s)", e.tokens_per_second * e.running if e.mode == "decode" else 0.0)
    sample("num_queue_reqs", "gauge", "The number of requests in the waiting queue", e.waiting)
    return "".join(out)


class SGLangSim(OpenAIFlavor):
    profile = SGLANG
    one_engine = True  # the captured payload's one unit: model_name, no rank label
    owned_by = "sglang"

    def make_engines(self, count: int, max_model_len: int) -> list[SimEngine]:
        return [StepEngine(engine="", max_model_len=max_model_len, hist_bounds=BOUNDS)]

    def payload(self, server: Served) -> str:
        unit = server.engines[0]
        assert isinstance(unit, StepEngine)
        return render_sglang(unit, server.model)
