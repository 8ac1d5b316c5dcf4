"""What a simulated engine does that differs from one engine to another: `SimFlavor`, the
base each engine's simulation fills (its engines, its `/metrics` body and headers, its
`/v1/models`, completions and health answers), with the core profile it simulates.
`sim.servers.SimServer` serves it and keeps the state every engine shares."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Protocol

from aiohttp import web

from ...core.engines import Profile
from ..render import SimEngine, _Hist

# An admission door's stamp on a request it forwards (gate.decision.DECISION_HEADER): the
# demo's traffic, not a health check; a lifecycle engine serves it in its turn.
ADMITTED_HEADER = "X-LLM-Health-Decision"


class Served(Protocol):
    """What a flavor reads and changes on its server (sim.servers.SimServer)."""

    model: str
    engines: list[SimEngine]
    start_time: float
    start_us: int
    loading: bool
    loop_stuck: bool
    multiprocess: bool
    probe_hangs: bool

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def authorised(self, request: web.Request) -> bool: ...


def one_token_answer(model: str, usage: bool = True) -> web.Response:
    """The answer to a 1-token completion (the probe), as an OpenAI-compatible server gives it."""
    body: dict = {"id": "cmpl-sim", "object": "text_completion", "model": model, "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]}
    if usage:
        body["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return web.json_response(body)


class SimFlavor:
    """One engine's simulation. `profile` is the core profile its payload must be read as
    (its sleep and pause paths are served; its payload serves every signal the profile
    reads: tests/unit/test_engine_signals.py); `kind`, the name `SimServer(kind=...)` takes,
    is the profile's: its rules section (the engine's scrape job: `vllm` for vLLM's two
    profiles), else its name."""

    kind: str
    profile: Profile
    one_engine = False  # the server has one inference loop: engines=1 only

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "profile" in vars(cls) and "kind" not in vars(cls):
            cls.kind = cls.profile.rules or cls.profile.name

    def make_engines(self, count: int, max_model_len: int) -> list[SimEngine]:
        raise NotImplementedError

    def payload(self, server: Served) -> str:
        raise NotImplementedError

    def metrics_headers(self, server: Served) -> dict[str, str]:
        return {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}

    def after_metrics_read(self, server: Served) -> None:
        """What a `/metrics` read changes on the server (nothing, for most engines)."""

    def loading_response(self) -> web.Response:
        """`/metrics`, `/health` and completions while the model loads."""
        return web.Response(status=503, text="loading")

    async def models(self, server: Served, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def completion(self, server: Served, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def health(self, server: Served, request: web.Request) -> web.Response:
        return web.Response(status=200)


# What a StepEngine's histograms observe per finished request, by these keys; each flavor
# gives their bounds and renders them under its engine's own names.
REQUEST_HISTS = ("prompt_tokens", "generation_tokens", "seconds", "queue_seconds", "first_token_seconds", "token_seconds")


@dataclass
class StepEngine(SimEngine):
    """An engine unit whose progress is forward passes and tokens, without vLLM's
    histograms: the simulation of an engine whose series are counts, gauges and plain histograms.

    `mode`: `idle`, `decode` (each running request makes a token per step,
    `tokens_per_second` steps a second), `prefill` (one long prompt: a prefill pass per
    `seconds_per_prefill`, no token counted before its end), `hung` (nothing moves, the
    counts stay), `sleeping`. With `max_num_seqs` the request lifecycle of SimEngine
    (arrivals, first come first served, `request_tokens` steps a request) runs in decode.
    `hist_bounds` gives the flavor's bucket bounds for each key of REQUEST_HISTS.
    """

    model: str = ""
    prefill_steps: float = 0.0
    decode_steps: float = 0.0
    seconds_per_prefill: float = 1.0
    hist_bounds: dict[str, tuple[float, ...]] | None = None

    def __post_init__(self) -> None:
        bounds = self.hist_bounds or {}
        self.hists = {key: _Hist(bounds.get(key, (1.0,))) for key in REQUEST_HISTS}

    @property
    def steps(self) -> int:
        return int(self.prefill_steps + self.decode_steps)

    def _decoded(self, steps: int) -> None:
        self.decode_steps += steps

    def _prefilling(self, seconds: float) -> None:
        if self.running > 0 or self.waiting > 0:  # a pass per seconds_per_prefill
            self.prefill_steps += self._whole(seconds / self.seconds_per_prefill)
            self.kv_usage = min(0.95, self.kv_usage + 0.01 * seconds)

    def finish_prefill(self, prompt_tokens: int) -> None:
        """The long prompt read to its end: its tokens are counted, decoding begins."""
        self.prompt_tokens += prompt_tokens
        self.prefill_steps += 1
        self.mode = "decode"

    def finish(self, n: int = 1, prompt_tokens: int = 256, generation_tokens: int = 256, seconds: float = 30.0) -> None:
        """`n` requests ended: counted, and observed in the request histograms."""
        for key, value in (
            ("prompt_tokens", prompt_tokens),
            ("generation_tokens", generation_tokens),
            ("seconds", seconds),
            ("queue_seconds", 0.01),
            ("first_token_seconds", 0.05),
            ("token_seconds", seconds / max(generation_tokens, 1)),
        ):
            self.hists[key].observe(value, n)
        self.success += n
        self.prompt_tokens += prompt_tokens * n

    def reset(self) -> None:
        """A new process: every count from 0, nothing in flight; the unit's shape kept."""
        shape = {"engine", "model", "tokens_per_second", "max_model_len", "seconds_per_prefill", "hist_bounds"}
        fresh = type(self)(**{name: getattr(self, name) for name in shape})
        for f in fields(self):
            if f.name not in shape:
                setattr(self, f.name, getattr(fresh, f.name))


def plain(value: float) -> str:
    """A number as Rust's and prometheus-cpp's exposition write it: a whole number without
    a decimal point (`109`), others in their shortest round-trip digits, never an exponent."""
    value = float(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    text = repr(value)
    return format(Decimal(text), "f") if "e" in text else text


class OpenAIFlavor(SimFlavor):
    """A simulation whose server speaks the OpenAI-compatible API (`/v1/models`,
    completions) over StepEngine units: a completion waits behind the work in flight, as
    on a real engine, and an idle server answers it in one step."""

    owned_by = "sim"

    async def models(self, server: Served, request: web.Request) -> web.Response:
        if not server.authorised(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"object": "list", "data": [{"id": server.model, "object": "model", "owned_by": self.owned_by}]})

    async def completion(self, server: Served, request: web.Request) -> web.Response:
        if not server.authorised(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        await request.json()
        if server.probe_hangs or server.running or server.waiting or any(e.mode == "hung" for e in server.engines):
            await asyncio.sleep(3600)
        engine = server.engines[0]
        engine.finish(1, prompt_tokens=1, generation_tokens=1, seconds=0.01)
        if isinstance(engine, StepEngine):
            engine.decode_steps += 1
            engine.generation_tokens += 1
        return one_token_answer(server.model)
