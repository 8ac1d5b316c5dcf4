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
    counters=("llamacpp:n_decode_total", "llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"),
    gauges=("llamacpp:requests_processing", "llamacpp:requests_deferred"),
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
)
