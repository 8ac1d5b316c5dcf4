"""SGLang: the series of its `/metrics` (one unit per model and data-parallel rank; one
raw-rules verdict per target, as one server runs one scheduler loop). Its progress is what
its only captured payload shows (tests/data/real-world/metrics/sglang-*.prom): the
tokenizer's token counters and request counts, and the scheduler's gauges, set where its
loop logs a prefill batch or every decode_log_interval decode steps. No step counter is
in that payload, so no livelock is read. Left out on purpose: func_latency_seconds (the
tokenizer times each request's arrival there, so requests sent to a hung server move it)."""

from __future__ import annotations

from .profile import Profile

SGLANG = Profile(
    name="sglang",
    title="SGLang",
    prefix="sglang:",
    marker="sglang:num_running_reqs",
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    steps=None,
    generation_tokens="sglang:generation_tokens_total",
    counters={
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:generation_tokens_total": "generation_tokens",
        "sglang:time_to_first_token_seconds_count": "first_tokens",
        "sglang:time_per_output_token_seconds_count": "output_tokens",
        "sglang:e2e_request_latency_seconds_count": "finished",
    },
    output=("sglang:generation_tokens_total",),
    gauges={
        "sglang:num_running_reqs": "running",
        "sglang:num_queue_reqs": "queued",
        "sglang:num_used_tokens": "used_tokens",
        "sglang:token_usage": "token_usage",
        "sglang:gen_throughput": "gen_throughput",
        "sglang:cache_hit_rate": "cache_hit_rate",
    },
    unit_labels=("model_name", "engine"),
    rules="sglang",
    payloads=("tests/data/real-world/metrics/sglang-*.prom",),
)
