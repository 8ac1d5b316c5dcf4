"""The simulated Triton Inference Server: one unit per model (`model`, `version`), its
`/metrics` as Triton 2.38's prometheus-cpp writes it (tests/data/real-world/metrics/triton-*:
the same families in the same order, HELP, types and label names, its GPU's and CPU's and
response cache's gauges, a summary per model with `_count` and `_sum` before the
quantiles, whole numbers without a decimal point), and the OpenAI-compatible API of its
OpenAI frontend. Pending requests are the work in flight (running and waiting)."""

from __future__ import annotations

from ...core.engines import TRITON
from ..render import SimEngine
from .base import OpenAIFlavor, Served, StepEngine, plain

GPU = 'gpu_uuid="GPU-00000000-0000-0000-0000-000000000000"'
_QUANTILES = ("0.5", "0.9", "0.95", "0.99", "0.999")
_REQUEST_HELP = "Number of {} inference requests, all batch sizes"
_DURATIONS = (
    ("request", "Cumulative inference request duration in microseconds (includes cached requests)"),
    ("queue", "Cumulative inference queuing duration in microseconds (includes cached requests)"),
    ("compute_input", "Cumulative compute input duration in microseconds (does not include cached requests)"),
    ("compute_infer", "Cumulative compute inference duration in microseconds (does not include cached requests)"),
    ("compute_output", "Cumulative inference compute output duration in microseconds (does not include cached requests)"),
)
_SUMMARY_HELP = {
    "request": "Summary of inference request duration in microseconds (includes cached requests)",
    "queue": "Summary of inference queuing duration in microseconds (includes cached requests)",
}
_GPU = (
    ("gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
    ("gpu_memory_total_bytes", "GPU total memory, in bytes"),
    ("gpu_memory_used_bytes", "GPU used memory, in bytes"),
    ("gpu_power_usage", "GPU power usage in watts"),
    ("gpu_power_limit", "GPU power management limit in watts"),
)
_HOST = (
    ("cpu_utilization", "CPU utilization rate [0.0 - 1.0]"),
    ("cpu_memory_total_bytes", "CPU total memory (RAM), in bytes"),
    ("cpu_memory_used_bytes", "CPU used memory (RAM), in bytes"),
    ("cache_util", "Cache utilization [0.0 - 1.0]"),
    ("cache_num_entries", "Number of responses stored in response cache"),
    ("cache_num_hits", "Number of cache hits in response cache"),
    ("cache_num_misses", "Number of cache misses in response cache"),
    ("cache_num_lookups", "Number of cache lookups in response cache"),
    ("cache_num_evictions", "Number of cache evictions in response cache"),
    ("cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds"),
    ("cache_insertion_duration", "Total cache insertion duration, in microseconds"),
)
# The share of a request's microseconds each duration counter gets.
_SHARE = {"request": 1.0, "queue": 0.1, "compute_input": 0.01, "compute_infer": 0.85, "compute_output": 0.01}


def model_names(model: str, count: int) -> list[str]:
    """The models a server of `count` units serves: `model`, then `model_1`, ..."""
    return [model] + [f"{model}_{i}" for i in range(1, count)]


def render_triton(units: list[StepEngine], model: str, power: float = 70.0) -> str:
    """Triton's `/metrics` for these units (one model each, version 1)."""
    labels = [f'model="{name}",version="1"' for name in model_names(model, len(units))]
    out: list[str] = []

    def family(name: str, typ: str, help_: str) -> None:
        out.append(f"# HELP nv_{name} {help_}\n# TYPE nv_{name} {typ}\n")

    def per_model(name: str, typ: str, help_: str, values: list[float]) -> None:
        family(name, typ, help_)
        out.extend(f"nv_{name}{{{lab}}} {plain(v)}\n" for lab, v in zip(labels, values))

    micros = [e.hists["seconds"].sum * 1e6 for e in units]
    per_model("inference_request_success", "counter", _REQUEST_HELP.format("successful"), [e.success for e in units])
    per_model("inference_request_failure", "counter", _REQUEST_HELP.format("failed"), [0.0 for _ in units])
    per_model("inference_count", "counter", "Number of inferences performed (does not include cached requests)", [e.generation_tokens for e in units])
    per_model("inference_exec_count", "counter", "Number of model executions performed (does not include cached requests)", [float(e.steps) for e in units])
    for key, help_ in _DURATIONS:
        per_model(f"inference_{key}_duration_us", "counter", help_, [round(m * _SHARE[key]) for m in micros])
    family("energy_consumption", "counter", "GPU energy consumption in joules since the Triton Server started")
    out.append(f"nv_energy_consumption{{{GPU}}} {plain(sum(e.steps for e in units) * power * 0.05)}\n")
    per_model(
        "inference_pending_request_count",
        "gauge",
        "Instantaneous number of pending requests awaiting execution per-model.",
        [e.running + e.waiting for e in units],
    )
    busy = any(e.running or e.waiting for e in units) and all(e.mode != "hung" for e in units)
    gpu = {
        "gpu_utilization": 0.9 if busy else 0.0,
        "gpu_memory_total_bytes": 16106127360,
        "gpu_memory_used_bytes": 266338304,
        "gpu_power_usage": power if busy else 32.09,
        "gpu_power_limit": power,
    }
    for name, help_ in _GPU:
        family(name, "gauge", help_)
        out.append(f"nv_{name}{{{GPU}}} {plain(gpu[name])}\n")
    host = {"cpu_memory_total_bytes": 33164935168, "cpu_memory_used_bytes": 2249916416, "cache_util": 0.0001220703125}
    for name, help_ in _HOST:
        family(name, "gauge", help_)
        out.append(f"nv_{name} {plain(host.get(name, 0))}\n")
    for key, help_ in _DURATIONS:
        family(f"inference_{key}_summary_us", "summary", _SUMMARY_HELP.get(key, help_))
        for lab, e, m in zip(labels, units, micros):
            name = f"nv_inference_{key}_summary_us"
            share = m * _SHARE[key]
            out.append(f"{name}_count{{{lab}}} {plain(e.success)}\n{name}_sum{{{lab}}} {plain(round(share))}\n")
            each = round(share / e.success) if e.success else 0
            out.extend(f'{name}{{{lab},quantile="{q}"}} {plain(each)}\n' for q in _QUANTILES)
    return "".join(out)


def _units(server: Served) -> list[StepEngine]:
    units = [e for e in server.engines if isinstance(e, StepEngine)]
    assert len(units) == len(server.engines)
    return units


class TritonSim(OpenAIFlavor):
    profile = TRITON
    owned_by = "triton"

    def make_engines(self, count: int, max_model_len: int) -> list[SimEngine]:
        return [StepEngine(engine="1", max_model_len=max_model_len) for _ in range(count)]

    def payload(self, server: Served) -> str:
        return render_triton(_units(server), server.model)
