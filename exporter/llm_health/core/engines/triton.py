"""Triton Inference Server: no "running" gauge; pending requests are the work in flight,
and executions the progress. One unit per model and version. The pending count is kept by
Triton's core as requests arrive, in front of a backend that may be hung: never progress;
nor is `nv_inference_request_failure` (refused at arrival, timed out in the queue)."""

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
    # Every one moves when an execution or a request ends (the cumulative durations too).
    counters={
        "nv_inference_exec_count": "executions",
        "nv_inference_count": "inferences",
        "nv_inference_request_success": "successes",
        "nv_inference_request_duration_us": "request_us",
        "nv_inference_queue_duration_us": "queue_us",
        "nv_inference_compute_input_duration_us": "input_us",
        "nv_inference_compute_infer_duration_us": "infer_us",
        "nv_inference_compute_output_duration_us": "output_us",
    },
    unit_labels=("model", "version"),
    aliases=("tritonserver",),
    rules="triton",
    rules_by=("model", "version"),
    payloads=("tests/data/real-world/metrics/triton-*.prom",),
)
