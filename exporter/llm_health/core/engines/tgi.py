"""Text Generation Inference (TGI): the series of its `/metrics` (one unit, no labels).

Its queue is counted by the router, in front of the model shards: `tgi_queue_size` rises
as requests arrive while the shards are hung, so it is work in flight, never progress."""

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
    counters=(
        "tgi_batch_inference_count",
        "tgi_batch_inference_success",
        "tgi_request_success",
        "tgi_request_generated_tokens_sum",
    ),
    output=("tgi_request_success", "tgi_request_generated_tokens_sum"),
    gauges=("tgi_batch_current_size", "tgi_batch_current_max_tokens"),
)
