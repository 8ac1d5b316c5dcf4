"""Triton Inference Server: no "running" gauge; pending requests are the work in flight,
and executions the progress. One unit per model and version. The pending count is kept by
Triton's core as requests arrive, in front of a backend that may be hung: never progress."""

from __future__ import annotations

from .profile import Profile

TRITON = Profile(
    name="triton",
    title="Triton",
    prefix="nv_inference_",
    marker="nv_inference_pending_request_count",
    running=(),
    waiting=("nv_inference_pending_request_count",),
    steps="nv_inference_exec_count",
    generation_tokens=None,
    counters=("nv_inference_exec_count", "nv_inference_count", "nv_inference_request_success"),
    gauges=(),
    unit_labels=("model", "version"),
    aliases=("tritonserver",),
)
