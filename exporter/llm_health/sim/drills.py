"""`llm-health drill retry|watchdog`: two drills a user can run.

`retry`, real HTTP on loopback and a real Redis:
`client -> retry_proxy -> [admission gate] -> fake_worker`, a 256-token prompt, a
3000 ms deadline, a worker that takes 2500 ms normally and 4000 ms under fault (then
answers 503, having spent the tokens), and a retry proxy that tries up to 4 times.
Uncapped, the same id is sent again and again; with the gate, the first retry (sent after
the deadline has passed) is rejected. Token units per id are counted at the worker for
both; the verdict's times are the run's own timeline.

`watchdog`: the day replay of `sim.replay` (the same code as the decision-quality
benchmark): naive watchdogs against llm-health on one server with a batch job and one
real hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from .launch import temporary_redis
from .replay import DayPlan, format_table, replay
from .servers import serve_app

__all__ = ["RetryDrillResult", "format_retry", "run_retry", "temporary_redis", "watchdog_report"]

PROMPT_TOKENS = 256
COMPLETION_TOKENS = 16


@dataclass
class Timeline:
    t0: float = field(default_factory=time.monotonic)
    events: list[tuple[float, str]] = field(default_factory=list)

    def add(self, what: str) -> float:
        at = (time.monotonic() - self.t0) * 1000
        self.events.append((at, what))
        return at

    def render(self, scale: float) -> str:
        # Times are shown in the drill's own milliseconds (divided by the time scale).
        return "\n".join(f"  T+{ms / scale:6.0f} ms  {what}" for ms, what in self.events)


class FakeWorker:
    """Sleeps `normal_ms` (or `fault_ms` under fault), then answers; counts token units per id."""

    def __init__(self, normal_ms: float, fault_ms: float, fault: bool, timeline: Timeline):
        self.normal_ms, self.fault_ms, self.fault, self.timeline = normal_ms, fault_ms, fault, timeline
        self.units: dict[str, int] = {}
        self.calls = 0

    async def handle(self, request: web.Request) -> web.Response:
        rid = request.headers.get("X-Request-Id", "?")
        self.calls += 1
        await request.read()
        await asyncio.sleep((self.fault_ms if self.fault else self.normal_ms) / 1000)
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS, "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS}
        self.units[rid] = self.units.get(rid, 0) + usage["total_tokens"]
        if self.fault:
            self.timeline.add(f"fake_worker: {rid} returns 503 (tokens already spent: {usage['total_tokens']})")
            return web.json_response({"error": {"message": "worker overloaded"}, "usage": usage}, status=503)
        self.timeline.add(f"fake_worker: {rid} replies 200")
        return web.json_response({"id": rid, "choices": [{"text": "ok"}], "usage": usage})


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner, port = await serve_app(app)
    return runner, f"http://127.0.0.1:{port}"


@dataclass
class Rejection:
    at_ms: float  # on the timeline (real ms since T+0)
    status: int
    code: str
    deadline_slack_ms: float | None  # as the gate's error body says


async def retry_proxy(
    session: aiohttp.ClientSession, upstream: str, request_id: str, deadline_ms: int, attempts: int, tl: Timeline
) -> tuple[list[int], Rejection | None]:
    """The client's retry sidecar: resend the same id until a timely 200, a non-retryable
    answer, or `attempts` tries. Returns the statuses it got and the refusal, if any."""
    statuses = []
    rejection = None
    body = {"model": "drill", "prompt": "x " * PROMPT_TOKENS, "max_tokens": COMPLETION_TOKENS}
    for attempt in range(attempts):
        headers = {"X-Request-Id": request_id, "X-Request-Deadline-Ms": str(deadline_ms), "X-Retry-Count": str(attempt)}
        tl.add(f"retry_proxy: sends {request_id} (attempt {attempt + 1}, retry_count {attempt})")
        async with session.post(upstream + "/v1/completions", json=body, headers=headers) as resp:
            text = await resp.text()
            statuses.append(resp.status)
            late = time.time() * 1000 > deadline_ms
            if resp.status in (422, 400, 410):
                try:
                    error = json.loads(text)["error"]
                    code, slack = str(error["code"]), error.get("deadline_slack_ms")
                except (ValueError, KeyError, TypeError, AttributeError):
                    code, slack = "?", None
                at = tl.add(f"admission: REJECTS {request_id} with {resp.status} {code}: not retryable, the retry proxy stops")
                rejection = Rejection(at, resp.status, code, slack if isinstance(slack, (int, float)) else None)
                break
            if resp.status == 200 and not late:
                tl.add(f"retry_proxy: {request_id} done in time")
                break
            nxt = "schedules a retry" if attempt + 1 < attempts else f"gives up after {attempts} attempts"
            tl.add(f"retry_proxy: got {resp.status}{' after the deadline' if late else ''}; {nxt}")
        await asyncio.sleep(0.001)
    return statuses, rejection


@dataclass
class RetryDrillResult:
    gated: bool
    attempts_sent: int
    worker_calls: int
    token_units: int
    statuses: list[int]
    timeline: str
    rejection: Rejection | None
    scale: float

    @property
    def first_retry_rejected(self) -> bool:
        return self.rejection is not None and len(self.statuses) == 2  # the first retry was the one refused


async def run_retry(redis_url: str, gated: bool, scale: float = 1.0, fault: bool = True) -> RetryDrillResult:
    # The gate needs the `redis` extra; the watchdog drill does not.
    from ..config.gate import parse_gate_config
    from ..gate.app import Gate

    tl = Timeline()
    worker = FakeWorker(2500 * scale, 4000 * scale, fault, tl)
    wapp = web.Application()
    wapp.router.add_post("/v1/completions", worker.handle)
    wrunner, wurl = await _serve(wapp)
    grunner = None
    target = wurl
    gate = None
    if gated:
        cfg = parse_gate_config(
            {
                "admission": {"reject_if_queue_age_ms_gte": 3000 * scale, "reject_if_retry_count_gte": 1, "ignore_worker_util_when_slack_ms_lte": 0},
                "gate": {"redis": redis_url, "queue_prefix": f"drill:{time.time_ns()}:", "routes": {"lab": {"upstream": wurl}}},
            },
            "<drill>",
        )
        gate = Gate(cfg)
        grunner, target = await _serve(gate.app())
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            tl.t0 = time.monotonic()
            deadline_ms = int(time.time() * 1000 + 3000 * scale)
            tl.add(f"client: sends lab-1, deadline T+3000 ms{' (fault: worker takes 4000 ms)' if fault else ''}")
            statuses, rejection = await retry_proxy(session, target, "lab-1", deadline_ms, 4, tl)
    finally:
        if grunner:
            await grunner.cleanup()
        await wrunner.cleanup()
    return RetryDrillResult(gated, len(statuses), worker.calls, worker.units.get("lab-1", 0), statuses, tl.render(scale), rejection, scale)


def format_retry(uncapped: RetryDrillResult, gated: RetryDrillResult) -> tuple[str, bool]:
    one = PROMPT_TOKENS + COMPLETION_TOKENS
    ok = gated.first_retry_rejected and gated.token_units == one and uncapped.attempts_sent > 1
    lines = [
        "retry drill: client -> retry_proxy -> admission -> fake_worker (deadline 3000 ms, worker 4000 ms under fault, up to 4 attempts)",
        "",
        "uncapped (retry_proxy -> fake_worker):",
        uncapped.timeline,
        "",
        "gated (retry_proxy -> llm-health gate -> fake_worker):",
        gated.timeline,
        "",
        f"{'':<10} {'attempts':>8} {'worker calls':>12} {'token units for lab-1':>22} {'x one attempt':>14}",
        f"{'uncapped':<10} {uncapped.attempts_sent:>8} {uncapped.worker_calls:>12} {uncapped.token_units:>22} {uncapped.token_units / one:>14.1f}",
        f"{'gated':<10} {gated.attempts_sent:>8} {gated.worker_calls:>12} {gated.token_units:>22} {gated.token_units / one:>14.1f}",
        "",
        "verdict: " + (_passed(gated) if ok else "FAIL: the gate admitted a late retry"),
    ]
    return "\n".join(lines), ok


def _passed(gated: RetryDrillResult) -> str:
    """The verdict, from the run: when the refusal came (the timeline's own clock, in the
    drill's milliseconds) and the slack the gate reported."""
    r = gated.rejection
    assert r is not None  # first_retry_rejected implies a refusal was recorded
    slack = f", deadline slack {r.deadline_slack_ms / gated.scale:.0f} ms" if r.deadline_slack_ms is not None else ""
    return f"PASS: the gate rejected the first retry at T+{r.at_ms / gated.scale:.0f} ms ({r.status} {r.code}{slack}); the id's tokens were spent once"


def watchdog_report() -> tuple[str, bool]:

    plan = DayPlan()
    naive = replay(plan, ("naive",))
    cascade = replay(plan, ("naive", "cascade"))
    ours = replay(plan, ("llm-health",))
    exporter = replay(dataclasses.replace(plan, check_period=plan.check_interval, check_rounds=0), ("llm-health",))
    ours.watchdogs, exporter.watchdogs = ("llm-health check every 5 min",), ("llm-health exporter, 10 s rounds",)

    def clock(t: float) -> str:
        return f"{int(t // 3600):02d}:{int(t % 3600 // 60):02d}:{int(t % 60):02d}"

    lines = [
        "watchdog drill: a day in simulated time (one vLLM server at 8 tokens/s; a batch job keeps 2-4 requests",
        f"running for 30-60 min, 6 times; the engine really hangs at {clock(plan.hang_at)}; a restart costs {plan.restart_seconds:.0f} s and fails what is in flight)",
        "",
        format_table([naive, cascade, ours, exporter]),
        "",
    ]
    for o in (cascade, ours):
        lines.append(f"timeline, {'+'.join(o.watchdogs)}:")
        lines += [f"  {clock(t)}  {what}" for t, what in o.timeline]
        lines.append("")
    ok = all(o.false_restarts == 0 and o.probes_to_busy == 0 and o.true_restarts == 1 for o in (ours, exporter))
    lines.append(
        "verdict: "
        + (
            f"PASS: llm-health restarted only the hung server ({ours.detection_seconds:.0f} s after the hang at a 5-minute check, "
            f"{exporter.detection_seconds:.0f} s with 10 s rounds), sent no request to a busy server; the naive watchdogs made "
            f"{naive.false_restarts} and {cascade.false_restarts} false restarts"
            if ok
            else "FAIL"
        )
    )
    return "\n".join(lines), ok
