"""Engine profiles: which series of each inference engine mean running, waiting, progress,
start time and sleep, how to tell the engines apart from a payload, and the `Reading`
the state machine is fed.

Pure: no I/O. A payload is parsed once with the targeted parser, asking for the series
of every profile (`PAYLOAD_NAMES`); the profile is then told by the series present.

Numbers from an engine are evidence only when they can be: a running or waiting count
that is NaN, infinite or negative, a counter or gauge that is not a finite non-negative
number, a start time that is not a finite positive number, is read as unknown (NaN, or
None for the start time). An unknown value never makes an engine idle, never makes it
restarted, and never hides what the other values show.

A payload past the reader's `Limits` (engine units, wanted samples, unit label length)
is refused whole with `OverLimits`: the exporter keeps per-engine state, and one backend
must not make it keep unbounded state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

from .exposition import Budget, Names, Samples, TooManySamples, compile_names, parse

START_TIME = "process_start_time_seconds"


@dataclass(frozen=True)
class Profile:
    """How one engine exposes its work and its progress.

    `unit_labels` name the labels that tell one engine unit from another in one payload
    (vLLM's data-parallel `engine` rank and `model_name`); series are summed over every
    other label (e.g. `finished_reason`). `counters` only ever rise in one process, so a
    fall means a restart. `steps` is the counter of engine steps; `gauges` are the
    engine-side gauges whose change also shows the engine took a step (KV usage rises
    during a long prefill even when no step is counted).
    """

    name: str
    marker: str  # a sample name only this profile's engine exposes
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    steps: str | None
    generation_tokens: str | None
    counters: tuple[str, ...]
    gauges: tuple[str, ...] = ()
    unit_labels: tuple[str, ...] = ()
    sleep_awake: str | None = None  # gauge with sleep_state="awake": 0 means sleeping
    has_sleep_endpoints: bool = False

    @cached_property
    def wanted(self) -> frozenset[str]:
        names = {START_TIME, *self.running, *self.waiting, *self.counters, *self.gauges}
        for name in (self.steps, self.generation_tokens, self.sleep_awake):
            if name:
                names.add(name)
        return frozenset(names)


_VLLM_COUNTERS = (
    "vllm:iteration_tokens_total_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
)

VLLM_V1 = Profile(
    name="vllm_v1",
    marker="vllm:kv_cache_usage_perc",
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    steps="vllm:iteration_tokens_total_count",
    generation_tokens="vllm:generation_tokens_total",
    counters=(*_VLLM_COUNTERS, "vllm:prefix_cache_queries_total"),
    gauges=("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"),
    unit_labels=("model_name", "engine"),
    sleep_awake="vllm:engine_sleep_state",
    has_sleep_endpoints=True,
)

VLLM_V0 = Profile(
    name="vllm_v0",
    marker="vllm:gpu_cache_usage_perc",
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting", "vllm:num_requests_swapped"),
    steps="vllm:iteration_tokens_total_count",
    generation_tokens="vllm:generation_tokens_total",
    counters=_VLLM_COUNTERS,
    gauges=(
        "vllm:gpu_cache_usage_perc",
        "vllm:cpu_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_swapped",
    ),
    unit_labels=("model_name", "engine"),
    has_sleep_endpoints=True,
)

SGLANG = Profile(
    name="sglang",
    marker="sglang:num_running_reqs",
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    steps="sglang:cuda_graph_passes_total",
    generation_tokens="sglang:generation_tokens_total",
    counters=(
        "sglang:cuda_graph_passes_total",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
    ),
    gauges=("sglang:num_used_tokens", "sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs"),
    unit_labels=("model_name", "engine"),
)

TGI = Profile(
    name="tgi",
    marker="tgi_batch_current_size",
    running=("tgi_batch_current_size",),
    waiting=("tgi_queue_size",),
    steps="tgi_batch_inference_count",
    generation_tokens="tgi_request_generated_tokens_sum",
    counters=(
        "tgi_batch_inference_count",
        "tgi_batch_inference_success",
        "tgi_request_success",
        "tgi_request_generated_tokens_sum",
    ),
    gauges=("tgi_batch_current_size", "tgi_queue_size", "tgi_batch_current_max_tokens"),
)

LLAMACPP = Profile(
    name="llamacpp",
    marker="llamacpp:requests_processing",
    running=("llamacpp:requests_processing",),
    waiting=("llamacpp:requests_deferred",),
    steps="llamacpp:n_decode_total",
    generation_tokens="llamacpp:tokens_predicted_total",
    counters=("llamacpp:n_decode_total", "llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"),
    gauges=("llamacpp:requests_processing", "llamacpp:requests_deferred"),
)

# Triton has no "running" gauge: pending requests are the work in flight, and executions
# the progress. One unit per model and version.
TRITON = Profile(
    name="triton",
    marker="nv_inference_pending_request_count",
    running=(),
    waiting=("nv_inference_pending_request_count",),
    steps="nv_inference_exec_count",
    generation_tokens=None,
    counters=("nv_inference_exec_count", "nv_inference_count", "nv_inference_request_success"),
    gauges=("nv_inference_pending_request_count",),
    unit_labels=("model", "version"),
)

# Order matters only where a payload could carry two markers: V1 before V0 (a V1 engine
# of some versions still lists the deprecated gauge).
PROFILES: tuple[Profile, ...] = (VLLM_V1, VLLM_V0, SGLANG, TGI, LLAMACPP, TRITON)
BY_NAME = {p.name: p for p in PROFILES}
_MARKERS = frozenset(p.marker for p in PROFILES) | {
    "vllm:num_requests_running",
    "vllm:iteration_tokens_total_count",
}


@dataclass(frozen=True)
class Limits:
    """What one payload may hold before it is refused (configurable per exporter)."""

    max_engines: int = 256  # engine units (model_name x data-parallel rank)
    max_samples: int = 10_000  # samples of the wanted series, and lines starting with `{`
    max_label_length: int = 512  # characters of a unit label value (model_name, engine)


class OverLimits(ValueError):
    """The payload holds more than the reader's Limits allow."""


@dataclass(frozen=True)
class EngineReading:
    """One engine unit (a data-parallel rank of one model) at one instant. `running` and
    `waiting` are NaN where the engine's number was no evidence (NaN, infinite, negative)."""

    model_name: str
    engine: str
    running: float
    waiting: float
    steps: float | None
    generation_tokens: float | None
    counters: tuple[float, ...]  # in profile order, NaN where absent or no evidence
    gauges: tuple[float, ...]
    sleeping: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.model_name, self.engine)

    @property
    def in_flight(self) -> bool:
        """Work is surely in flight: a known running or waiting count above zero."""
        return self.running > 0 or self.waiting > 0

    @property
    def known(self) -> bool:
        """Whether the engine's own numbers say if work is in flight."""
        return self.in_flight or not (math.isnan(self.running) or math.isnan(self.waiting))

    @property
    def fingerprint(self) -> tuple[float, ...]:
        return self.counters + self.gauges


@dataclass(frozen=True)
class Reading:
    """A parsed `/metrics` payload of one backend, reduced to what the decision needs."""

    profile: str
    start_time: float | None
    engines: dict[tuple[str, str], EngineReading] = field(default_factory=dict)


class UnknownEngine(ValueError):
    """The payload is text exposition but no profile's series are in it."""


PAYLOAD_NAMES: Names = compile_names(frozenset().union(*(p.wanted for p in PROFILES), _MARKERS))


def detect(samples: Samples) -> Profile:
    """Choose the profile from the series present in the payload."""
    for profile in PROFILES:
        if profile.marker in samples:
            return profile
    if "vllm:num_requests_running" in samples or "vllm:iteration_tokens_total_count" in samples:
        # Older or partial vLLM payloads without a cache-usage gauge.
        return VLLM_V0
    raise UnknownEngine("no known engine series (vllm:, sglang:, tgi_, llamacpp:, nv_inference_) in /metrics")


def _unit(labels: dict[str, str], unit_labels: tuple[str, ...]) -> tuple[str, str]:
    values = [labels.get(name, "") for name in unit_labels] + ["", ""]
    return (values[0], values[1])


def _sum_by_unit(samples: Iterable[tuple[dict[str, str], float]], unit_labels: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """Per unit, the sum of the samples; NaN for a unit with any value that is no evidence
    (not a finite number at or above zero: it cannot be a count, a counter or a usage)."""
    out: dict[tuple[str, str], float] = {}
    first, second = (*unit_labels, "", "")[:2]  # "" is no label name: labels.get gives ""
    inf, nan = math.inf, math.nan
    for labels, value in samples:
        key = (labels.get(first, ""), labels.get(second, ""))
        out[key] = out.get(key, 0.0) + (value if 0 <= value < inf else nan)
    return out


def read(text: str, limits: Limits | None = None) -> Reading:
    """Parse a whole payload and reduce it (for callers with the text at hand; the
    exporter parses in pieces, see probe.reading)."""
    limits = limits or Limits()
    try:
        samples = parse(text, PAYLOAD_NAMES, budget=Budget(limits.max_samples))
    except TooManySamples as exc:
        raise OverLimits(f"{exc}, more than max_samples") from None
    return reduce(samples, limits)


def reduce(samples: Samples, limits: Limits | None = None) -> Reading:
    """A payload's samples (of PAYLOAD_NAMES) reduced to a `Reading`, one `EngineReading`
    per engine unit. Raises UnknownEngine, or OverLimits."""
    limits = limits or Limits()
    profile = detect(samples)
    start = samples.get(START_TIME)
    start_time = start[0][1] if start else None
    if start_time is not None and not (math.isfinite(start_time) and start_time > 0):
        start_time = None  # no evidence of a start time, so none of a restart either

    sums = {name: _sum_by_unit(samples.get(name, ()), profile.unit_labels) for name in profile.wanted}
    units: set[tuple[str, str]] = set()
    for name in (*profile.running, *profile.waiting, *profile.counters):
        units.update(sums[name])
    if not units:
        raise UnknownEngine(f"{profile.name} payload has none of {sorted(profile.running + profile.waiting)}")
    if len(units) > limits.max_engines:
        raise OverLimits(f"{len(units)} engine units (model_name, engine), more than max_engines {limits.max_engines}")
    longest = max(len(v) for key in units for v in key)
    if longest > limits.max_label_length:
        raise OverLimits(f"a unit label value of {longest} characters, more than max_label_length {limits.max_label_length}")

    awake: dict[tuple[str, str], float] = {}
    if profile.sleep_awake:
        for labels, value in samples.get(profile.sleep_awake, ()):
            if labels.get("sleep_state") == "awake":
                awake[_unit(labels, profile.unit_labels)] = value

    def total(names: tuple[str, ...], key: tuple[str, str]) -> float:
        return sum(sums[n].get(key, 0.0) for n in names)

    def one(name: str | None, key: tuple[str, str]) -> float | None:
        return sums[name].get(key, math.nan) if name else None

    engines = {}
    for key in sorted(units):
        engines[key] = EngineReading(
            model_name=key[0],
            engine=key[1],
            running=total(profile.running, key),
            waiting=total(profile.waiting, key),
            steps=one(profile.steps, key),
            generation_tokens=one(profile.generation_tokens, key),
            counters=tuple(sums[n].get(key, math.nan) for n in profile.counters),
            gauges=tuple(sums[n].get(key, math.nan) for n in profile.gauges),
            sleeping=awake.get(key, 1.0) == 0.0,
        )
    return Reading(profile=profile.name, start_time=start_time, engines=engines)
