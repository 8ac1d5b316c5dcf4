"""Text Generation Inference (TGI): the series of its `/metrics` (one unit, no labels).

Its queue is counted by the router, in front of the model shards: `tgi_queue_size` rises
as requests arrive while the shards are hung, so it is work in flight, never progress; so
are `tgi_request_count` (arrivals) and `tgi_request_failure` (refusals at arrival)."""

from __future__ import annotations

from .profile import Profile

TGI = Profile(
    name="tgi",
    title="TGI",
    prefix="tgi_",
    marker="tgi_batch_current_size",
    running=("tgi_batch_current_size",),
    waiting=("tgi_queue_size",),
    steps="tgi_batch_inference_count",
    generation_tokens="tgi_request_generated_tokens_sum",
    counters={
        "tgi_batch_inference_count": "batch_inferences",
        "tgi_batch_inference_success": "batch_successes",
        "tgi_batch_concat": "batch_concats",
        "tgi_request_success": "request_successes",
        "tgi_request_generated_tokens_sum": "generated_tokens",
    },
    output=("tgi_request_success", "tgi_request_generated_tokens_sum"),
    # Set by the router's batching task, which waits on the shards.
    gauges={"tgi_batch_current_size": "batch_size", "tgi_batch_current_max_tokens": "batch_max_tokens"},
    rules="tgi",
    payloads=("tests/data/real-world/metrics/tgi-*.prom",),
)
