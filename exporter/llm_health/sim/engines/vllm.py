"""The simulated vLLM V1 API server: engines of `sim.render.SimEngine`, its `/metrics`
(`render_vllm`), `/v1/models`, completions, `/health`, and the sleep and pause flags of
its profile."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from ...core.engines import VLLM_V1
from ..render import SimEngine, render_vllm
from .base import ADMITTED_HEADER, Served, SimFlavor, one_token_answer


class VllmSim(SimFlavor):
    profile = VLLM_V1

    def make_engines(self, count: int, max_model_len: int) -> list[SimEngine]:
        return [SimEngine(engine=str(i), max_model_len=max_model_len) for i in range(count)]

    def payload(self, server: Served) -> str:
        return render_vllm(server.engines, server.model, None if server.multiprocess else server.start_time)

    async def models(self, server: Served, request: web.Request) -> web.Response:
        if not server.authorised(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return web.json_response({"object": "list", "data": [{"id": server.model, "object": "model", "owned_by": "vllm", "max_model_len": 1024}]})

    async def completion(self, server: Served, request: web.Request) -> web.Response:
        if not server.authorised(request):
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = await request.json()
        if body.get("model") != server.model:
            return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist."}}, status=404)
        if server.probe_hangs or any(e.mode == "hung" for e in server.engines):
            await asyncio.sleep(3600)
        if ADMITTED_HEADER in request.headers and await served_in_turn(server.engines[0]):
            return one_token_answer(server.model, usage=False)
        if server.running or server.waiting:
            # A real engine would queue this behind the batch; the sim makes it wait as long.
            await asyncio.sleep(3600)
        engine = server.engines[0]
        engine.finish(1, prompt_tokens=1, generation_tokens=1, seconds=0.01)
        engine.hists["vllm:iteration_tokens_total"].observe(1)
        return one_token_answer(server.model)


async def served_in_turn(engine: SimEngine, limit_s: float = 120.0) -> bool:
    """A request an admission door let through joins a lifecycle engine's queue (the
    `overloaded` scenario) as one more arrival, first come first served, and is answered
    once the engine has finished it: True then. False: not a lifecycle engine (or not
    served within `limit_s`, a restart in between)."""
    if engine.max_num_seqs <= 0:
        return False
    turn = engine.success + engine.running + engine.waiting + 1
    engine.waiting += 1
    deadline = time.monotonic() + limit_s
    while engine.success < turn and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return engine.success >= turn
