"""SGLang: the series of its `/metrics` (one unit per model and data-parallel rank)."""

from __future__ import annotations

from .profile import Profile

SGLANG = Profile(
    name="sglang",
    title="SGLang",
    prefix="sglang:",
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
    output=("sglang:generation_tokens_total",),
    gauges=("sglang:num_used_tokens", "sglang:token_usage", "sglang:num_running_reqs", "sglang:num_queue_reqs"),
    unit_labels=("model_name", "engine"),
)
