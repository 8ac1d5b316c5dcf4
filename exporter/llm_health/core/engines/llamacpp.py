"""llama.cpp's `llama-server`: its series, its start header, its `/metrics` on the
inference loop, its routes (read from llama-server b11434's own code:
tests/data/engine-routes/) and its admin endpoints, never forwarded.

`llama-server` has no start-time series; it sends its start as the
`Process-Start-Time-Unix` header of `/metrics` (CLOCK_MONOTONIC microseconds at start,
despite the name), and holds one of its HTTP threads for a connection kept open. Its
`/metrics` is a task on the inference loop's own queue, answered within milliseconds under
any load: a timeout while `/health` (answered on its HTTP thread, beside the loop; `/v1/models`
takes the queue's lock) answers is a loop that takes no task. `/slots` is a task on the
same queue: read when the exporter already suspects the server, a timeout there is hang
evidence (issue #27388: generation stopped, `/health` ok, `/slots` hangs).
"""

from __future__ import annotations

from .profile import Profile

ROUTES = (
    "POST /completion",
    "POST /completions",
    "POST /chat/completions",
    "POST /infill",
    "POST /embedding",
    "POST /embeddings",
    "POST /reranking",
    "POST /v1/reranking",
    "POST /apply-template",
)

# Slots (save, restore, erase), adapters, settings, models.
NEVER = (
    "/slots",
    "/lora-adapters",
    "/props",
    "/models/load",
    "/models/unload",
    "/tools",  # runs the server's built-in tools
    "/cors-proxy",  # fetches any URL for the web UI
)

LLAMACPP = Profile(
    name="llamacpp",
    title="llama.cpp",
    prefix="llamacpp:",
    marker="llamacpp:requests_processing",
    running=("llamacpp:requests_processing",),
    waiting=("llamacpp:requests_deferred",),
    steps="llamacpp:n_decode_total",
    generation_tokens="llamacpp:tokens_predicted_total",
    # Every counter and gauge a live llama-server moves while it works, but the two
    # throughput gauges (reset by every /metrics read) and n_busy_slots_per_decode (a
    # lifetime average). It moves none of them inside one llama_decode() call.
    counters={
        "llamacpp:n_decode_total": "decodes",
        "llamacpp:prompt_tokens_total": "prompt_tokens",
        "llamacpp:prompt_tokens_cached_total": "prompt_tokens_cached",
        "llamacpp:prompt_seconds_total": "prompt_seconds",
        "llamacpp:tokens_predicted_total": "tokens_predicted",
        "llamacpp:tokens_predicted_seconds_total": "tokens_predicted_seconds",
        "llamacpp:n_tokens_max": "n_tokens_max",
        "llamacpp:spec_decode_num_draft_tokens_total": "spec_draft_tokens",
        "llamacpp:spec_decode_num_accepted_tokens_total": "spec_accepted_tokens",
        "llamacpp:spec_decode_num_drafts_total": "spec_drafts",
    },
    gauges={"llamacpp:requests_processing": "requests_processing", "llamacpp:requests_deferred": "requests_deferred"},
    output=("llamacpp:tokens_predicted_total",),
    aliases=("llama-server",),
    start_header="Process-Start-Time-Unix",
    metrics_keepalive=False,
    metrics_on_loop=True,
    health_path="/health",
    # `/slots` posts a task to the same queue as `/metrics` and waits for the loop's answer.
    evidence_path="/slots",
    routes=ROUTES,
    never=NEVER,
    rules="llamacpp",
    payloads=("tests/data/llamacpp/*.prom", "tests/data/real-world/metrics/llamacpp-*.prom"),
)
