"""The demo's admission route: `llm-health gate` (route `chat`, its queue in the demo's
Redis) in front of a simulated worker, with the retry drill's traffic (sim.drills'
retry proxy: the same id resent after a 503 until a timely answer or a refusal).

Scaled to half the drill's times: every request has a 1500 ms deadline; a `slow-` request
takes the worker 2000 ms and ends in a 503 (its tokens spent), so its retry is sent after
its deadline and the gate must refuse it; a `fresh-` request takes 1250 ms and is
answered in time. Two clients, out of step, and a batch scheduler's waiting room that
records its requests in the route's queue and serves each after 400 ms (`_waiting_room`).
A second route, `engine`, sends to a simulated engine whose queue is inside it (the
`overloaded` backend, its queue aging past the deadline, then draining) and names it in
`backends:`: its client's fresh requests are refused while that queue is older than
their 1.5 s, admitted again once it drained (`_engine_client`). The gate stamps each admitted request with its
`x-queue-age-ms` and `x-deadline-slack-ms` (read here at the worker) and puts the slack in
each refusal; the exporter reads the route's queue from Redis. Counted from the clients'
own answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from ..config.gate import parse_gate_config
from ..gate.app import Gate
from ..store.queue import AdmissionQueue
from .drills import COMPLETION_TOKENS, PROMPT_TOKENS, Timeline, retry_proxy
from .servers import serve_app

SCALE = 0.5
DEADLINE_MS = 3000 * SCALE
SLOW_MS, NORMAL_MS = 4000 * SCALE, 2500 * SCALE
ENGINE_ROUTE, ENGINE_EVERY_S = "engine", 0.5  # the route whose queue is inside its engine, a fresh request this often
ROOM_TICK_S, ROOM_WAIT_MS = 0.2, 400  # the waiting room: one request in per tick, each served after 400 ms


@dataclass
class RouteFigures:
    fresh_sent: int = 0
    fresh_admitted: int = 0  # first attempts the gate let through to the worker
    fresh_refused: int = 0
    # For each refused first attempt, the span in which a stall could have made it late
    # (from a deadline before it was sent, the queue ahead of it aging, to its refusal;
    # monotonic), for the verdict to ask sim.stalls.
    refused_windows: list[tuple[float, float]] = field(default_factory=list)
    retries_sent: int = 0
    late_retries_refused: int = 0
    late_retries_admitted: int = 0  # retries sent after their deadline that reached the worker
    worker_calls: int = 0
    room_enqueued: int = 0  # the batch scheduler's requests, recorded in the route's queue
    room_served: int = 0
    # What the gate stamped on the last request it admitted (x-queue-age-ms,
    # x-deadline-slack-ms, forwarded to the worker) and said in its last refusal.
    admitted_age_ms: float | None = None
    admitted_slack_ms: float | None = None
    refused_slack_ms: float | None = None
    ages_ms: list[float] = field(default_factory=list)  # every admitted request's x-queue-age-ms
    last: list[str] = field(default_factory=list)
    # The engine route: fresh requests to a backend whose queue is inside its engine.
    engine_sent: int = 0
    engine_refused_old: int = 0  # reject_age_beats_slack on the engine's queue age
    engine_refused_ages_ms: list[float] = field(default_factory=list)
    engine_admitted: int = 0
    engine_admitted_after_drain: int = 0  # admitted after a refusal: the queue drained
    engine_other: dict[str, int] = field(default_factory=dict)  # any other answer, by decision or status


class RetryTraffic:
    def __init__(self, redis_url: str, route: str = "chat", clients: int = 2, engine: tuple[str, str, str] | None = None):
        """``engine``: (url, model, exporter backend name) of a simulated engine whose queue
        is inside it, for a second route, ENGINE_ROUTE, that names it in `backends:`."""
        self.redis_url, self.route, self.clients, self.engine = redis_url, route, clients, engine
        self.figures = RouteFigures()
        self.gate_url = ""
        self._runners: list[web.AppRunner] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._ids = itertools.count(1)
        self._stopping = False
        self._queue: AdmissionQueue | None = None

    async def _worker(self, request: web.Request) -> web.Response:
        rid = request.headers.get("X-Request-Id", "?")
        self.figures.worker_calls += 1
        with contextlib.suppress(KeyError, ValueError):
            self.figures.admitted_age_ms = float(request.headers["x-queue-age-ms"])
            self.figures.admitted_slack_ms = float(request.headers["x-deadline-slack-ms"])
            self.figures.ages_ms.append(self.figures.admitted_age_ms)
        await request.read()
        slow = rid.startswith("slow-")
        await asyncio.sleep((SLOW_MS if slow else NORMAL_MS) / 1000)
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS, "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}
        if slow:
            return web.json_response({"error": {"message": "worker overloaded"}, "usage": usage}, status=503)
        return web.json_response({"id": rid, "choices": [{"text": "ok"}], "usage": usage})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._worker)
        wrunner, wport = await serve_app(app)
        self._runners.append(wrunner)
        routes: dict[str, dict[str, object]] = {self.route: {"upstream": f"http://127.0.0.1:{wport}"}}
        if self.engine is not None:
            url, _model, backend = self.engine
            # Its queue is inside the engine: the exporter publishes its age, the gate reads it.
            routes[ENGINE_ROUTE] = {"upstream": url, "backends": [backend], "default_deadline_ms": DEADLINE_MS, "engine_age_unknown": "open"}
        cfg = parse_gate_config(
            {
                "admission": {"reject_if_queue_age_ms_gte": DEADLINE_MS, "reject_if_retry_count_gte": 1, "ignore_worker_util_when_slack_ms_lte": 0},
                "gate": {"redis": self.redis_url, "routes": routes},
            },
            "<demo>",
        )
        self.gate = Gate(cfg)
        grunner, gport = await serve_app(self.gate.app())
        self._runners.append(grunner)
        self.gate_url = f"http://127.0.0.1:{gport}"
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        self._queue = AdmissionQueue.from_url(self.redis_url)
        self._tasks.append(asyncio.create_task(self._waiting_room()))
        if self.engine is not None:
            self._tasks.append(asyncio.create_task(self._engine_client()))

    async def _engine_client(self) -> None:
        """A fresh request to ENGINE_ROUTE every ENGINE_EVERY_S, 1.5 s to live: refused
        while the engine's queue is older than that, admitted once it has drained."""
        assert self._session is not None and self.engine is not None
        f = self.figures
        while not self._stopping:
            body = {"model": self.engine[1], "prompt": "hi", "max_tokens": 1}
            headers = {"X-Route": ENGINE_ROUTE, "X-Request-Timeout-Ms": str(int(DEADLINE_MS))}
            f.engine_sent += 1
            try:
                async with self._session.post(self.gate_url + "/v1/completions", json=body, headers=headers) as r:
                    await r.read()
                    decision = r.headers.get("X-LLM-Health-Decision", str(r.status))
                    age = r.headers.get("x-queue-age-ms")
            except (aiohttp.ClientError, TimeoutError) as exc:
                decision, age = type(exc).__name__, None
            if decision == "reject_age_beats_slack":
                f.engine_refused_old += 1
                if age is not None:
                    f.engine_refused_ages_ms.append(float(age))
            elif decision == "admit_once":
                f.engine_admitted += 1
                f.engine_admitted_after_drain += f.engine_refused_old > 0
            else:
                f.engine_other[decision] = f.engine_other.get(decision, 0) + 1
            await asyncio.sleep(ENGINE_EVERY_S)

    async def _waiting_room(self) -> None:
        """A second door on the route: a batch scheduler that records its waiting requests
        in the route's queue (the Redis contract, store.queue), one every ROOM_TICK_S, and
        serves each once it has waited ROOM_WAIT_MS. The oldest has waited up to about
        ROOM_WAIT_MS: the age the gate weighs against each request's slack, and the
        exporter exports."""
        assert self._queue is not None
        waiting: collections.deque[int] = collections.deque()  # enqueue times, oldest first
        for n in itertools.count(1):
            if self._stopping:
                return
            now = int(time.time() * 1000)
            await self._queue.enqueue(f"batch/b-{n}", self.route, "batch", deadline_ms=now + int(2 * DEADLINE_MS))
            waiting.append(now)
            self.figures.room_enqueued += 1
            while waiting and int(time.time() * 1000) - waiting[0] >= ROOM_WAIT_MS:
                record = await self._queue.pop_oldest(self.route)
                waiting.popleft()
                if record is None:
                    break
                await self._queue.complete(record.request_id, 200, route=self.route)
                self.figures.room_served += 1
            await asyncio.sleep(ROOM_TICK_S)

    async def _client(self, i: int) -> None:
        await asyncio.sleep(i * 0.7)
        for n in itertools.count():
            if self._stopping:
                return
            slow = (n + i) % 2 == 0
            rid = f"{'slow' if slow else 'fresh'}-{next(self._ids)}"
            deadline_ms = int(time.time() * 1000 + DEADLINE_MS)  # Unix ms, as the header says
            assert self._session is not None
            tl = Timeline()
            sent = time.monotonic()
            statuses, rejection = await retry_proxy(self._session, self.gate_url, rid, deadline_ms, 4, tl)
            self._count(statuses, rejection is not None, rejection.code if rejection else "", (sent - DEADLINE_MS / 1000, time.monotonic()))
            if rejection is not None and rejection.deadline_slack_ms is not None:
                self.figures.refused_slack_ms = rejection.deadline_slack_ms
            self.figures.last = [*self.figures.last[-3:], f"{rid}: " + " -> ".join(str(s) for s in statuses) + (f" ({rejection.code})" if rejection else "")]
            await asyncio.sleep(0.3)

    def _count(self, statuses: list[int], refused_last: bool, code: str, window: tuple[float, float]) -> None:
        f = self.figures
        f.fresh_sent += 1
        first_refused = refused_last and len(statuses) == 1
        f.fresh_refused += first_refused
        if first_refused and len(f.refused_windows) < 1000:
            f.refused_windows.append(window)
        f.fresh_admitted += not first_refused
        retries = len(statuses) - 1
        f.retries_sent += retries
        if retries:
            refused = 1 if refused_last else 0
            f.late_retries_refused += refused if code == "reject_retry_late" else 0
            # Every retry here follows a 503 that came after the deadline: a late retry.
            f.late_retries_admitted += retries - refused

    async def stop(self) -> None:
        # Let each client finish the exchange it is in (a cut connection would leave the
        # gate writing to a closed socket), then stop.
        self._stopping = True
        _, pending = await asyncio.wait(self._tasks, timeout=5.0) if self._tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session:
            await self._session.close()
        if self._queue is not None:
            await self._queue.aclose()
        for r in reversed(self._runners):
            await r.cleanup()
