"""The simulated llama.cpp `llama-server`: one inference loop (`LlamaCppEngine`, its
slots and its counters), its `/metrics` as llama-server b11434 writes it (checked against
live payloads by tests/integration/test_sim_format.py) with the `Process-Start-Time-Unix`
header, `/health` answered beside the loop, `/v1/models` and completions behind it, and no
sleep endpoints."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, fields

from aiohttp import web

from ...core.engines import LLAMACPP
from ..render import SimEngine
from .base import Served, SimFlavor

# llama-server's /metrics (tools/server, build b11434): (type, name, help) in the order it
# writes them. It keeps its metric definitions in a JSON object keyed by type, so every
# counter comes before every gauge. Names get the `llamacpp:` prefix; there are no labels.
_LLAMACPP_METRICS = (
    ("counter", "prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens"),
    ("counter", "prompt_tokens_cached_total", "Number of prompt tokens reused from the cache"),
    ("counter", "prompt_seconds_total", "Total time spent processing prompts"),
    ("counter", "tokens_predicted_total", "Number of generation tokens processed"),
    ("counter", "tokens_predicted_seconds_total", "Total time spent generating tokens"),
    ("counter", "n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding"),
    ("counter", "n_tokens_max", "Largest observed sequence length (prompt + generation)"),
    ("counter", "spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated"),
    ("counter", "spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model"),
    ("counter", "spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps"),
    ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s"),
    ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s"),
    ("gauge", "requests_processing", "Number of requests processing"),
    ("gauge", "requests_deferred", "Number of requests deferred"),
    ("gauge", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call"),
)


def _g(value: float) -> str:
    """A double as C++'s `ostream << double` writes it (6 significant digits, like %g):
    `0`, `19`, `0.036336`, `1.9187`, `1e-06`, `1.23457e+06`."""
    return format(float(value), "g")


@dataclass
class LlamaCppEngine(SimEngine):
    """llama.cpp's `llama-server`: one inference loop, its slots and its counters.

    The scenario fields are SimEngine's: `running` is `requests_processing` (busy slots),
    `waiting` is `requests_deferred`; `mode` is `idle`, `decode` (every busy slot makes a
    token per step, `tokens_per_second` steps a second, each step one llama_decode()),
    `prefill` (one long prompt read in `batch`-token chunks, one llama_decode() per
    `seconds_per_chunk`), `hung` (the loop stopped inside a decode: nothing moves, /metrics
    answers the same snapshot). As on the live server, the token counters move only when a
    prompt has been read to its end (prompt tokens) or a request ends (predicted tokens);
    while requests are in flight only `n_decode_total` and `n_tokens_max` move.
    """

    n_decode: float = 0.0
    tokens_predicted: float = 0.0
    tokens_predicted_seconds: float = 0.0
    prompt_tokens_cached: float = 0.0
    prompt_seconds: float = 0.0
    n_tokens_max: float = 0.0
    n_busy_slots: float = 0.0  # busy slots summed over every decode (for the lifetime average)
    batch: int = 512  # -b: the prompt tokens one llama_decode() reads
    n_ctx: int = 8192  # tokens per slot
    seconds_per_chunk: float = 1.0
    request_tokens: int = 256  # tokens a request generates before it ends (decode mode)
    request_prompt_tokens: int = 8
    seq_len: int = 0  # tokens in the longest busy slot
    # since the last /metrics read, which resets them (prompt_tokens_seconds, predicted_tokens_seconds)
    bucket_prompt_tokens: float = 0.0
    bucket_prompt_seconds: float = 0.0
    bucket_predicted_tokens: float = 0.0
    bucket_predicted_seconds: float = 0.0
    _generated: float = 0.0
    _probed: bool = False

    def __post_init__(self) -> None:
        """No vLLM histograms: llama-server has none."""

    @property
    def steps(self) -> int:
        return int(self.n_decode)

    def _decode(self, n: int, busy: int, tokens: int) -> None:
        """`n` llama_decode() calls with `busy` slots, each call adding `tokens` to a slot."""
        self.n_decode += n
        self.n_busy_slots += n * busy
        self.seq_len = min(self.n_ctx, self.seq_len + n * tokens)
        self.n_tokens_max = float(max(self.n_tokens_max, self.seq_len))

    def advance(self, seconds: float) -> None:
        if self.mode == "decode" and self.running > 0:
            steps = self._whole(seconds * self.tokens_per_second)
            while steps:
                now = min(steps, max(1, int(self.request_tokens - self._generated)))
                self._decode(now, self.running, 1)
                self._generated += now
                steps -= now
                if self._generated >= self.request_tokens:
                    # The batch's requests end and as many new ones take the slots.
                    self.finish(self.running, self.request_prompt_tokens, self.request_tokens, self.request_tokens / self.tokens_per_second)
                    self._generated = 0.0
                    self.seq_len = self.request_prompt_tokens
        elif self.mode == "prefill" and (self.running > 0 or self.waiting > 0):
            chunks = self._whole(seconds / self.seconds_per_chunk)
            if chunks:
                self._decode(chunks, max(self.running, 1), self.batch)

    def finish_prefill(self, prompt_tokens: int) -> None:
        """The last chunk of a long prompt decoded: only now are its tokens counted."""
        seconds = prompt_tokens / self.batch * self.seconds_per_chunk
        self.prompt_tokens += prompt_tokens
        self.prompt_seconds += seconds
        self.bucket_prompt_tokens += prompt_tokens
        self.bucket_prompt_seconds += seconds
        self.mode = "decode"

    def finish(self, n: int = 1, prompt_tokens: int = 256, generation_tokens: int = 256, seconds: float = 30.0) -> None:
        """`n` requests ended: their predicted tokens are counted now (their prompt tokens
        too, for requests whose prompt was read since the last call)."""
        prompt_seconds = prompt_tokens / self.batch * 0.01
        self.prompt_tokens += prompt_tokens * n
        self.prompt_seconds += prompt_seconds * n
        self.tokens_predicted += generation_tokens * n
        self.tokens_predicted_seconds += seconds * n
        self.bucket_prompt_tokens += prompt_tokens * n
        self.bucket_prompt_seconds += prompt_seconds * n
        self.bucket_predicted_tokens += generation_tokens * n
        self.bucket_predicted_seconds += seconds * n
        self.success += n

    def probe(self) -> None:
        """A 1-token completion of the prompt `ok` (BOS and one token) on an idle server: one
        decode; every prompt token new the first time, the BOS taken from the cache after."""
        new, cached = (1, 1) if self._probed else (2, 0)
        self._probed = True
        self._decode(1, 1, 0)
        self.seq_len = 0
        self.n_tokens_max = float(max(self.n_tokens_max, 2))
        self.prompt_tokens_cached += cached
        self.finish(1, prompt_tokens=new, generation_tokens=1, seconds=1e-06)

    def reset(self) -> None:
        """A new process: every counter from 0, nothing in flight; the server's shape kept."""
        shape = {"engine", "tokens_per_second", "max_model_len", "batch", "n_ctx", "seconds_per_chunk", "request_tokens", "request_prompt_tokens"}
        fresh = LlamaCppEngine(**{name: getattr(self, name) for name in shape})
        for f in fields(self):
            if f.name not in shape:
                setattr(self, f.name, getattr(fresh, f.name))

    def values(self) -> dict[str, float]:
        """Each series of the payload by its name without the prefix."""

        def per_second(tokens: float, seconds: float) -> float:
            return tokens / seconds if seconds > 0 else 0.0

        return {
            "prompt_tokens_total": self.prompt_tokens,
            "prompt_tokens_cached_total": self.prompt_tokens_cached,
            "prompt_seconds_total": self.prompt_seconds,
            "tokens_predicted_total": self.tokens_predicted,
            "tokens_predicted_seconds_total": self.tokens_predicted_seconds,
            "n_decode_total": self.n_decode,
            "n_tokens_max": self.n_tokens_max,
            "spec_decode_num_draft_tokens_total": 0.0,
            "spec_decode_num_accepted_tokens_total": 0.0,
            "spec_decode_num_drafts_total": 0.0,
            "prompt_tokens_seconds": per_second(self.bucket_prompt_tokens, self.bucket_prompt_seconds),
            "predicted_tokens_seconds": per_second(self.bucket_predicted_tokens, self.bucket_predicted_seconds),
            "requests_processing": float(self.running),
            "requests_deferred": float(self.waiting),
            "n_busy_slots_per_decode": self.n_busy_slots / max(self.n_decode, 1.0),
        }

    def reset_bucket(self) -> None:
        """What every /metrics read does to the two throughput gauges."""
        self.bucket_prompt_tokens = self.bucket_prompt_seconds = 0.0
        self.bucket_predicted_tokens = self.bucket_predicted_seconds = 0.0


def render_llamacpp(values: dict[str, float]) -> str:
    """A llama-server `/metrics` body for these values (LlamaCppEngine.values(); a name
    missing is 0), byte for byte as b11434 writes it: HELP, TYPE and one sample per series,
    no labels, no `# EOF`."""
    out: list[str] = []
    for typ, name, help_ in _LLAMACPP_METRICS:
        out.append(f"# HELP llamacpp:{name} {help_}\n# TYPE llamacpp:{name} {typ}\nllamacpp:{name} {_g(values.get(name, 0.0))}\n")
    return "".join(out)


def _json(data: object, status: int = 200) -> web.Response:
    """JSON as llama-server sends it: compact, `application/json; charset=utf-8`."""
    return web.Response(
        text=json.dumps(data, separators=(",", ":")), status=status, content_type="application/json", charset="utf-8", headers={"Server": "llama.cpp"}
    )


def _error(status: int, message: str, kind: str) -> web.Response:
    return _json({"error": {"code": status, "message": message, "type": kind}}, status)


def _models(alias: str) -> dict[str, object]:
    """llama-server b11434's `/v1/models` for one model served under `alias` (trimmed: the
    fields llama-server fills in for a GGUF without metadata)."""
    return {
        "models": [{"name": alias, "model": alias, "type": "model", "capabilities": ["completion"], "details": {"format": "gguf"}}],
        "object": "list",
        "data": [
            {
                "id": alias,
                "aliases": [alias],
                "tags": [],
                "object": "model",
                "created": int(time.time()),
                "owned_by": "llamacpp",
                "meta": {"vocab_type": 1, "n_vocab": 32000, "n_ctx": 8192, "n_ctx_train": 8192},
            }
        ],
    }


def _loop(server: Served) -> LlamaCppEngine:
    engine = server.engines[0]
    assert isinstance(engine, LlamaCppEngine)
    return engine


class LlamaCppSim(SimFlavor):
    """`loading`: the model still loads, `/metrics`, `/health` and completions answer 503.
    `loop_stuck`: the inference loop stopped outside a decode: `/metrics` (a task on that
    loop) and `/v1/models` (which takes the loop's queue lock) never answer, `/health` does."""

    profile = LLAMACPP
    one_engine = True

    def make_engines(self, count: int, max_model_len: int) -> list[SimEngine]:
        return [LlamaCppEngine(engine="")]

    def payload(self, server: Served) -> str:
        return render_llamacpp(_loop(server).values())

    def metrics_headers(self, server: Served) -> dict[str, str]:
        assert LLAMACPP.start_header
        return {"Content-Type": "text/plain; version=0.0.4", "Server": "llama.cpp", LLAMACPP.start_header: str(server.start_us)}

    def after_metrics_read(self, server: Served) -> None:
        _loop(server).reset_bucket()  # every /metrics read resets the throughput gauges

    def loading_response(self) -> web.Response:
        return _error(503, "Loading model", "unavailable_error")

    async def models(self, server: Served, request: web.Request) -> web.Response:
        if server.loop_stuck:
            await asyncio.sleep(3600)
        return _json(_models(server.model))

    async def completion(self, server: Served, request: web.Request) -> web.Response:
        """llama-server serves its one model whatever name a request gives."""
        if not server.authorised(request):
            return _error(401, "Invalid API Key", "authentication_error")
        if server.loading:
            return self.loading_response()
        await request.json()
        if server.probe_hangs or server.loop_stuck or server.running or server.waiting or any(e.mode == "hung" for e in server.engines):
            # The loop does not take it, or it waits behind the work in flight.
            await asyncio.sleep(3600)
        _loop(server).probe()
        created = int(time.time())
        return _json(
            {
                "choices": [{"text": " ok", "index": 0, "logprobs": None, "finish_reason": "length"}],
                "created": created,
                "model": server.model,
                "system_fingerprint": "b11434-sim",
                "object": "text_completion",
                "usage": {"completion_tokens": 1, "prompt_tokens": 2, "total_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}},
                "id": f"chatcmpl-sim{created}",
            }
        )

    async def health(self, server: Served, request: web.Request) -> web.Response:
        # answered by the HTTP thread, beside the inference loop
        if server.loading:
            return self.loading_response()
        return _json({"status": "ok"})
