"""vLLM, V1 and V0 engines: the series, sleep and pause endpoints, the routes of its API
server (read from vLLM 0.32.0's own code: tests/data/engine-routes/) and its admin
endpoints, never forwarded. One rules section (`vllm`) for both: its rules watch the
signals of the two."""

from __future__ import annotations

from dataclasses import replace

from .profile import Profile

# Progress: the steps, the tokens, finished requests, preemptions; KV usage (which alone
# moves while V1 prefills a long prompt in chunks), running and waiting (updated on steps).
_COUNTERS = {
    "vllm:iteration_tokens_total_count": "steps",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_success_total": "request_success",
    "vllm:num_preemptions_total": "preemptions",
}
_RUNNING_WAITING = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}

ROUTES = (
    "GET /v1/responses/*",
    "POST /v1/responses/*/cancel",
    "POST /v1/score",
    "POST /v2/rerank",
    "POST /v2/embed",
    "POST /rerank",
    "POST /score",
    "POST /pooling",
    "POST /classify",
    "POST /invocations",
    "POST /tokenize",
    "POST /detokenize",
)

# Sleep mode, caches, profiling, RPC on workers, weights and adapters, scaling.
NEVER = (
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/pause",
    "/resume",
    "/is_paused",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/release_kv_cache_memory",
    "/start_profile",
    "/stop_profile",
    "/collective_rpc",
    "/abort_requests",
    "/inference/v1/abort_requests",
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    "/update_weights",
    "/update_weight_version",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/finish_weight_update",
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/weight_checker",
    "/weight_info",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/server_info",
    "/get_world_size",
    "/kv_event_sources",
    "/fault_tolerance",
)

VLLM_V1 = Profile(
    name="vllm_v1",
    title="vLLM",
    prefix="vllm:",
    marker="vllm:kv_cache_usage_perc",
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    steps="vllm:iteration_tokens_total_count",
    generation_tokens="vllm:generation_tokens_total",
    counters=_COUNTERS,
    gauges={"vllm:kv_cache_usage_perc": "kv_cache_usage", **_RUNNING_WAITING},
    unit_labels=("model_name", "engine"),
    sleep_awake="vllm:engine_sleep_state",
    sleep_path="/is_sleeping",
    pause_path="/is_paused",
    # Output: a token generated or a request finished (a pooling model generates none).
    output=("vllm:generation_tokens_total", "vllm:request_success_total"),
    # Finished requests per unit: the queue age's arrival curve (core.queue_age).
    finished="vllm:request_success_total",
    # 0.32's `--max-num-queued-reqs` / `--max-num-queued-tokens` answer 503 and count here
    # (`vllm/v1/metrics/loggers.py`: labels model_name and reason, no engine rank).
    refusals="vllm:admission_rejections_total",
    refusal_reasons=("max_num_queued_reqs", "max_num_queued_tokens"),
    routes=ROUTES,
    never=NEVER,
    rules="vllm",
    rules_by=("model_name", "engine"),
    payloads=("tests/data/vllm-real/*.prom", "tests/data/real-world/metrics/vllm-v1-*.prom"),
)

VLLM_V0 = replace(
    VLLM_V1,
    name="vllm_v0",
    marker="vllm:gpu_cache_usage_perc",
    waiting=("vllm:num_requests_waiting", "vllm:num_requests_swapped"),
    gauges={"vllm:gpu_cache_usage_perc": "gpu_cache_usage", **_RUNNING_WAITING},
    sleep_awake=None,
    refusals=None,  # the admission counter came with V1 (0.32)
    refusal_reasons=(),
    # Older or partial vLLM payloads without a cache-usage gauge.
    fallback_markers=("vllm:num_requests_running", "vllm:iteration_tokens_total_count"),
    payloads=("tests/data/real-world/metrics/vllm-v0-*.prom", "tests/data/real-world/metrics/vllm-late-v0engine-*.prom"),
)
