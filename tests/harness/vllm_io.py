"""What the vLLM harness (tests/harness/vllm.py) reads and sends, stdlib only: vLLM's own
counters read from /metrics with a regex (nothing here imports llm_health), plain HTTP
GET and JSON POST, a streamed answer followed to its end, and the completions a load runs
in background threads."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)",
    re.M,
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of exactly `name` as (labels, value)."""
    out = []
    for m in _SAMPLE.finditer(text):
        if m.group("name") != name:
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        out.append((labels, float(m.group("value"))))
    return out


def metric_sum(text: str, name: str, **match: str) -> float | None:
    """Sum of `name` over label sets that match; None if the series is absent."""
    vals = [v for labels, v in samples(text, name) if all(labels.get(k) == want for k, want in match.items())]
    return sum(vals) if vals else None


COUNTER_NAMES = {
    "request_success_total": "vllm:request_success_total",
    "prompt_tokens_total": "vllm:prompt_tokens_total",
    "generation_tokens_total": "vllm:generation_tokens_total",
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "iteration_tokens_total_count": "vllm:iteration_tokens_total_count",
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "process_start_time_seconds": "process_start_time_seconds",
}


def vllm_counters(text: str) -> dict[str, float | None]:
    return {k: metric_sum(text, n) for k, n in COUNTER_NAMES.items()}


# ---------------------------------------------------------------------------
# HTTP (stdlib)


def http_get(url: str, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post_json(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


@dataclass
class LoadResult:
    status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Load:
    """Completions running in background threads; `wait()` joins them."""

    threads: list[threading.Thread] = field(default_factory=list)
    results: list[LoadResult] = field(default_factory=list)

    def wait(self, timeout: float | None = None) -> list[LoadResult]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self.threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.results

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)


def follow_stream(resp: Any, req: Any) -> None:
    """Read a streamed (SSE) answer to its end, setting on ``req`` when its first event came
    (``first``, epoch seconds) and the longest gap between two of its events
    (``longest_gap``, seconds)."""
    last = 0.0
    while line := resp.readline():
        if line.startswith(b"data: {"):
            now = time.time()
            if req.first is not None:
                req.longest_gap = max(req.longest_gap, now - last)
            req.first = req.first or now
            last = now
