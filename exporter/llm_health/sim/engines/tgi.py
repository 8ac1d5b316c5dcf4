"""The simulated Text Generation Inference (TGI) router: one unit (no labels), its
`/metrics` as TGI's Rust exporter writes it (tests/data/real-world/metrics/tgi-*: the same
families in the same order, HELP where it has one, types, label names and bucket bounds,
whole numbers without a decimal point, a blank line after each family), and the
OpenAI-compatible API."""

from __future__ import annotations

from ...core.engines import TGI
from ..render import SimEngine, _Hist
from .base import OpenAIFlavor, Served, StepEngine, plain


def _exponential(start: float, factor: float, count: int) -> tuple[float, ...]:
    """TGI's duration buckets: each the one before times `factor` (so 0.0007593750000000001)."""
    out = []
    for _ in range(count):
        start *= factor
        out.append(start)
    return tuple(out)


_DURATION = _exponential(0.0001, 1.5, 35)
_INPUT = tuple(5.11 * i for i in range(1, 101))  # max input length 511 in 100 buckets
_NEW = tuple(5.12 * i for i in range(1, 101))  # max new tokens 512
_NEXT = tuple(float(i) for i in range(1, 1025))  # batch sizes up to max batch size 1024
BOUNDS = {"prompt_tokens": _INPUT, "generation_tokens": _NEW, "seconds": _DURATION, "queue_seconds": _DURATION, "token_seconds": _DURATION}
STEP_SECONDS = {"prefill": 0.08, "decode": 0.06}  # one forward pass of the simulated batch
PREFILL, DECODE = 'method="prefill"', 'method="decode"'


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, typ: str, help_: str | None) -> None:
        if help_:
            self.lines.append(f"# HELP tgi_{name} {help_}\n")
        self.lines.append(f"# TYPE tgi_{name} {typ}\n")

    def sample(self, name: str, value: float, labels: str = "") -> None:
        self.lines.append(f"tgi_{name}{{{labels}}} {plain(value)}\n" if labels else f"tgi_{name} {plain(value)}\n")

    def end(self) -> None:
        self.lines.append("\n")

    def histogram(self, name: str, hist: _Hist, labels: str = "") -> None:
        """Buckets, `_sum`, `_count` of one label set."""
        sep = f"{labels}," if labels else ""
        for bound, count in zip(hist.bounds, hist.counts):
            self.sample(f"{name}_bucket", count, f'{sep}le="{plain(bound)}"')
        self.sample(f"{name}_bucket", hist.count, f'{sep}le="+Inf"')
        self.sample(f"{name}_sum", hist.sum, labels)
        self.sample(f"{name}_count", hist.count, labels)


def _steps(count: float, seconds: float, bounds: tuple[float, ...] = _DURATION) -> _Hist:
    """`count` observations of `seconds` each."""
    hist = _Hist(bounds)
    if count:
        hist.observe(seconds, int(count))
    return hist


def render_tgi(e: StepEngine) -> str:
    """TGI's `/metrics` for one unit, in the order and spelling its router writes them."""
    out = _Out()
    steps = {"prefill": e.prefill_steps, "decode": e.decode_steps}

    def per_method(name: str, help_: str | None, order: tuple[str, str], share: float) -> None:
        out.family(name, "histogram", help_)
        for method in order:
            out.histogram(name, _steps(steps[method], STEP_SECONDS[method] * share), f'method="{method}"')
        out.end()

    def counter(name: str, help_: str | None, values: tuple[tuple[str, float], ...]) -> None:
        out.family(name, "counter", help_)
        for labels, value in values:
            out.sample(name, value, labels)
        out.end()

    def histogram(name: str, help_: str, hist: _Hist) -> None:
        out.family(name, "histogram", help_)
        out.histogram(name, hist)
        out.end()

    counter("request_success", "Number of successful requests", (("", e.success),))
    counter("batch_concat", None, (('reason="chunking"', 0),))
    counter("request_count", "Total number of requests", (("", e.success),))  # no failures simulated
    counter("request_failure", None, (('err="validation"', 0),))
    inference = "Number of successful inference calls per method (prefill or decode)"
    counter("batch_inference_success", inference, ((PREFILL, e.prefill_steps), (DECODE, e.decode_steps)))
    counter("batch_inference_count", "Inference calls per method (prefill or decode)", ((DECODE, e.decode_steps), (PREFILL, e.prefill_steps)))
    for name, help_, value in (
        ("queue_size", "Current queue size", e.waiting),
        ("batch_current_max_tokens", "Maximum tokens for the current batch", e.running * 512),
        ("batch_current_size", "Current batch size", e.running),
    ):
        out.family(name, "gauge", help_)
        out.sample(name, value)
        out.end()
    histogram("request_input_length", "Input token length per request", e.hists["prompt_tokens"])
    histogram("request_max_new_tokens", "Maximum new tokens per request", e.hists["generation_tokens"])
    histogram("request_inference_duration", "Request inference duration", e.hists["seconds"])
    out.family("request_skipped_tokens", "summary", "Speculated tokens per request")
    for q in ("0", "0.5", "0.9", "0.95", "0.99", "0.999", "1"):
        out.sample("request_skipped_tokens", 0, f'quantile="{q}"')
    out.sample("request_skipped_tokens_sum", 0)
    out.sample("request_skipped_tokens_count", e.generation_tokens)
    out.end()
    per_method("batch_forward_duration", "Batch forward duration per method (prefill or decode)", ("prefill", "decode"), 0.9)
    histogram("request_duration", "Request duration", e.hists["seconds"])
    histogram("request_validation_duration", "Request validation duration", _steps(e.success, 0.0002))
    histogram("request_queue_duration", "Request queue duration", e.hists["queue_seconds"])
    filter_help = "Time spent filtering batches and sending generated tokens per method (prefill or decode)"
    per_method("batch_filter_duration", filter_help, ("decode", "prefill"), 0.01)
    per_method("batch_inference_duration", "Batch inference duration", ("prefill", "decode"), 1.0)
    histogram("request_mean_time_per_token_duration", "Mean time per token per request", e.hists["token_seconds"])
    out.family("batch_concat_duration", "histogram", None)
    out.histogram("batch_concat_duration", _steps(0, 0.001), DECODE)
    out.end()
    histogram("request_generated_tokens", "Generated tokens per request", e.hists["generation_tokens"])
    per_method("batch_decode_duration", "Time spent decoding a batch per method (prefill or decode)", ("prefill", "decode"), 0.002)
    histogram("batch_next_size", "Batch size of the next batch", _steps(e.prefill_steps, max(e.running, 1), _NEXT))
    return "".join(out.lines)


class TgiSim(OpenAIFlavor):
    profile = TGI
    one_engine = True  # one router, one model, no unit labels
    owned_by = "tgi"

    def make_engines(self, count: int, max_model_len: int) -> list[SimEngine]:
        return [StepEngine(engine="", max_model_len=max_model_len, hist_bounds=BOUNDS)]

    def payload(self, server: Served) -> str:
        unit = server.engines[0]
        assert isinstance(unit, StepEngine)
        return render_tgi(unit)
