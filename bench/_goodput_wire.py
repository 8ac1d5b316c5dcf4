"""bench_goodput's wire on a real vLLM (bench/_goodput_real.py runs it): the counting
pass-through in front of the engine, the TTL-shedding proxy, a small aiohttp server for
either, and the openai SDK's transport that records each attempt's status and each age
refusal's figures."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx2 as httpx
from aiohttp import web
from tests.harness.processes import free_port

from bench._goodput_model import AgeRefusal, Outcome


class Upstream:
    """The counting pass-through in front of vLLM."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.seen: dict[str, list[float]] = defaultdict(list)  # id -> monotonic arrival of each copy
        self.session: aiohttp.ClientSession | None = None
        self.inflight: dict[int, float] = {}  # every copy at the engine now: when it arrived
        self.spans: list[tuple[float, float]] = []  # every copy that has left: (arrived, left), monotonic
        self.tokens = itertools.count()

    def clear(self) -> None:
        self.seen.clear()
        self.spans.clear()

    def oldest_waiting_s(self, slots: int, at: float) -> float:
        """The client-side truth at monotonic `at`: vLLM schedules first come, first served,
        so with `slots` sequences running the oldest copy waiting is the (slots + 1)-th
        oldest of those in flight then."""
        times = sorted([a for a, left in self.spans if a <= at < left] + [a for a in self.inflight.values() if a <= at])
        return at - times[slots] if len(times) > slots else 0.0

    def free_share(self, slots: int, start: float, end: float) -> float:
        """The share of [start, end) (monotonic) when fewer than `slots` copies were at the
        engine: a sequence it could have run was free. Tells a door that kept work from an
        engine with room apart from an engine that ran slower."""
        events = sorted(
            [(max(a, start), 1) for a, left in self.spans if a < end and left > start]
            + [(min(left, end), -1) for a, left in self.spans if a < end and left > start]
            + [(max(a, start), 1) for a in self.inflight.values() if a < end]
        )
        free, held, at = 0.0, 0, start
        for t, step in events:
            if held < slots:
                free += t - at
            held, at = held + step, t
        if held < slots:
            free += end - at
        return free / (end - start) if end > start else 0.0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        rid = request.headers.get("X-Request-Id", "")
        token = next(self.tokens)
        self.seen[rid].append(now := time.monotonic())
        self.inflight[token] = now
        assert self.session is not None
        try:
            async with self.session.post(self.engine + request.raw_path, data=body, headers={"Content-Type": "application/json"}) as up:
                data = await up.read()
                return web.Response(status=up.status, body=data, content_type="application/json")
        finally:
            self.spans.append((self.inflight.pop(token), time.monotonic()))


class TTLProxy:
    """llm-d's router's queue TTL, simply: at most `slots` attempts sent on at once, FIFO;
    an attempt that waited `ttl_s` for its turn is answered 503."""

    def __init__(self, upstream: str, slots: int, ttl_s: float) -> None:
        self.upstream, self.ttl_s = upstream, ttl_s
        self.sem = asyncio.Semaphore(slots)
        self.shed = 0
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            async with asyncio.timeout(self.ttl_s):
                await self.sem.acquire()
        except TimeoutError:
            self.shed += 1
            return web.json_response({"error": {"message": "queue TTL expired", "type": "ttl"}}, status=503)
        try:
            assert self.session is not None
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("x-request-id", "x-request-deadline-ms", "content-type")}
            async with self.session.post(self.upstream + request.raw_path, data=body, headers=headers) as up:
                return web.Response(status=up.status, body=await up.read(), content_type="application/json")
        finally:
            self.sem.release()


async def serve(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application(client_max_size=1 << 20)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@dataclass(frozen=True)
class Refused:
    """A door's `reject_age_beats_slack` as the client read it: its age and slack (ms), the
    instant the door decided (monotonic: the request's deadline less that slack, on the
    door's clock, which is this machine's), and whether it was the caller's first attempt."""

    door_ms: float
    slack_ms: float
    decided: float
    fresh: bool

    def against(self, up: Upstream, slots: int) -> AgeRefusal:
        return AgeRefusal(self.door_ms, self.slack_ms, up.oldest_waiting_s(slots, self.decided) * 1000, self.fresh)


class Recording(httpx.AsyncHTTPTransport):
    """The SDK's transport, recording each attempt's status by X-Request-Id, and each age
    refusal's figures (Refused)."""

    def __init__(self, outcomes: dict[str, Outcome]) -> None:
        super().__init__(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.outcomes = outcomes
        self.ages: list[Refused] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        o = self.outcomes.get(request.headers.get("x-request-id", ""))
        if o is not None:
            o.attempts += 1
        sent = time.monotonic()
        response = await super().handle_async_request(request)
        read = time.monotonic()
        if o is not None:
            o.codes.append(str(response.status_code))
        h = response.headers
        if h.get("x-llm-health-decision") == "reject_age_beats_slack" and "x-queue-age-ms" in h and "x-deadline-slack-ms" in h:
            slack_ms = float(h["x-deadline-slack-ms"])
            # monotonic = wall + (monotonic - wall now); clamped to the attempt's own span
            # against the slack's rounding to the millisecond
            decided = (float(request.headers["x-request-deadline-ms"]) - slack_ms) / 1000 + (time.monotonic() - time.time())
            fresh = request.headers.get("x-stainless-retry-count", "0") == "0"
            self.ages.append(Refused(float(h["x-queue-age-ms"]), slack_ms, min(max(decided, sent), read), fresh))
        return response
