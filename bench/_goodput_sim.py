"""bench_goodput on a simulated fleet: 16 engines in virtual time (a discrete-event model,
fast and exact for its inputs, so the smoke test runs it), the same schedule, clients and
policies as the real run, beyond one engine.

Each engine runs `slots` sequences at once, FIFO, each taking its own service time (the
unloaded S x 0.75..1.25, seeded) and generating TOKENS tokens evenly over it; an attempt
its client abandons leaves the queue, or stops generating where it runs (vLLM aborts a
request whose client disconnects). The router in front sends each attempt to the engine
with the fewest requests (running + waiting). Clients behave as the openai SDK does with
its defaults (bench/_goodput_real.py runs the SDK itself): a per-attempt timeout equal to
the request's deadline, up to 2 retries of a timeout, a 408/409/429 or a 5xx, after the
`Retry-After` where one of at most 60 s is sent, else 0.5 s x 2^n (at most 8 s) less up
to 25% jitter; a 422 with `x-should-retry: false` is final.

Policies: direct; a vLLM queue cap (`--max-num-queued-reqs`: an engine with that many
waiting answers 503 at once); a fixed queue TTL (llm-d's router: an attempt waits in the
router until an engine has a free sequence, and is shed with a 503 once it waited the
TTL); the age-first door: `llm_health.core.admission.decide` itself, on the route's
engine queue age as the gate reads it (the youngest oldest-waiting age among the
engines, as of the last 1 s exporter round: the figure as it should be, within a round
of the truth), the wait it projects (`core.queue_age.door_ahead` and `door_wait`: every
attempt in flight now, against the most sequences each engine was seen running at a round,
once every engine has been seen full at one; none projected before), the request's slack,
and its retry count (the door knows every attempt by its X-Request-Id), configured as
docs/admission.md advises under overload (`expected_service_ms` = S, a request's service
here whatever the engine runs beside it; `reject_if_queue_age_ms_gte` = AGE_CAP_SERVICES x
S). Both doors run the same decision, so the simulation has one door row.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from bench._goodput_model import AGE_CAP_SERVICES, SDK_MAX_RETRIES, TOKENS, Arrival, Outcome, Result, schedule
from llm_health.core import admission
from llm_health.core.queue_age import door_ahead, door_wait

ROUND_S = 1.0  # the exporter's round


@dataclass
class Job:
    outcome: Outcome
    attempt: int
    service: float
    sent: float
    engine: int = -1
    queued: bool = False  # in a waiting queue (the router's or its engine's)
    started: float | None = None
    done: bool = False  # answered, refused or abandoned: no further event acts on it


@dataclass
class Engine:
    slots: int
    running: list[Job] = field(default_factory=list)
    waiting: deque[Job] = field(default_factory=deque)  # abandoned jobs stay in it, done, until they reach its head
    queued: int = 0  # the live jobs in `waiting`

    def head(self) -> Job | None:
        while self.waiting and self.waiting[0].done:
            self.waiting.popleft()
        return self.waiting[0] if self.waiting else None


class Fleet:
    def __init__(self, policy: str, engines: int, slots: int, service_s: float, seed: int, cap: int | None = None, ttl_s: float | None = None):
        self.policy, self.cap, self.ttl_s, self.service_s = policy, cap, ttl_s, service_s
        self.engines = [Engine(slots) for _ in range(engines)]
        self.router: deque[Job] = deque()  # the TTL policy's queue (abandoned or shed jobs stay in it, done)
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.generated = 0.0
        self.now = 0.0
        self.door_age_s = 0.0  # the route's engine queue age as of the last round
        self.most_running = [0] * engines  # the most sequences each engine ran at once, as the rounds saw
        self.seen_full = [False] * engines  # and whether a round found it full (QueueAges.slots)
        longest = max(60.0, service_s * 30 * 1000)
        self.policy_cfg = admission.Policy(
            reject_if_queue_age_ms_gte=AGE_CAP_SERVICES * service_s * 1000, default_deadline_ms=longest, expected_service_ms=service_s * 1000
        )

    def at(self, t: float, kind: str, what: object) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, what))

    # -- the engines --------------------------------------------------------------------

    def _start(self, e: Engine, job: Job) -> None:
        job.started = self.now
        e.running.append(job)
        self.at(self.now + job.service, "finish", job)

    def _fill(self, i: int) -> None:
        e = self.engines[i]
        while len(e.running) < e.slots and (job := e.head()) is not None:
            e.waiting.popleft()
            e.queued -= 1
            job.queued = False
            self._start(e, job)
        while self.router and any(len(x.running) < x.slots for x in self.engines):  # the TTL router's queue
            job = self.router.popleft()
            if not job.done:
                job.queued = False
                self._dispatch(job)

    def _pick(self) -> int:
        return min(range(len(self.engines)), key=lambda i: (len(self.engines[i].running) + self.engines[i].queued, i))

    def _dispatch(self, job: Job) -> None:
        i = self._pick()
        e = self.engines[i]
        job.engine = i
        job.outcome.copies += 1
        if self.now > job.outcome.arrival.at + job.outcome.arrival.deadline_s:
            job.outcome.copies_late += 1
        if self.cap is not None and len(e.running) >= e.slots and e.queued >= self.cap:
            self._answer(job, 503, None)
            return
        e.waiting.append(job)
        e.queued += 1
        job.queued = True
        self._fill(i)

    def _oldest_waiting_s(self) -> float:
        return min(self.now - h.sent if (h := e.head()) is not None else 0.0 for e in self.engines)

    # -- the client ---------------------------------------------------------------------

    def send(self, outcome: Outcome, attempt: int) -> None:
        a = outcome.arrival
        outcome.attempts += 1
        job = Job(outcome, attempt, self.service_s * self.rng.uniform(0.75, 1.25), self.now)
        self.at(self.now + a.deadline_s, "timeout", job)  # the per-attempt timeout
        if self.policy == "door":
            slack_ms = (a.at + a.deadline_s - self.now) * 1000
            in_flight = [0.0] * sum(len(e.running) + e.queued for e in self.engines)  # the door sees every attempt it sent
            slots = sum(self.most_running) if all(self.seen_full) else None  # the route's S summed, unknown while any is
            wait = door_wait(door_ahead(in_flight, slots, 0, True), slots, self.policy_cfg.expected_service_ms)
            req = admission.Request(queue_age_ms=self.door_age_s * 1000, deadline_slack_ms=slack_ms, retry_count=attempt, wait_ms=wait)
            d = admission.decide(req, self.policy_cfg)
            if not d.admitted:
                self._answer(job, d.status, d.retry_after_s if d.retryable else None, final=not d.retryable)
                return
        if self.policy == "ttl":
            if any(len(e.running) < e.slots for e in self.engines):
                self._dispatch(job)
            else:
                self.router.append(job)
                job.queued = True
                self.at(self.now + (self.ttl_s or 0.0), "ttl", job)
            return
        self._dispatch(job)

    def _answer(self, job: Job, status: int, retry_after: float | None, final: bool = False) -> None:
        if job.done:
            return
        job.done = True
        o = job.outcome
        o.codes.append(str(status))
        if status == 200:
            o.ok, o.done_at, o.tokens = True, self.now, TOKENS
            return
        retryable = not final and (status in (408, 409, 429) or status >= 500)
        self._retry(job, retryable, retry_after)

    def _retry(self, job: Job, retryable: bool, retry_after: float | None) -> None:
        if not retryable or job.attempt >= SDK_MAX_RETRIES:
            return
        if retry_after is not None and 0 < retry_after <= 60:
            wait = retry_after
        else:
            wait = min(0.5 * 2**job.attempt, 8.0) * (1 - 0.25 * self.rng.random())
        self.at(self.now + wait, "retry", (job.outcome, job.attempt + 1))

    def _abandon(self, job: Job) -> None:
        """The client's per-attempt timeout: the attempt leaves wherever it is."""
        if job.done:
            return
        job.done = True
        job.outcome.codes.append("timeout")
        if job.queued:  # left where it waits, as done (the router's queue, or an engine's)
            if job.engine >= 0:
                self.engines[job.engine].queued -= 1
        elif job.engine >= 0:
            e = self.engines[job.engine]
            if job in e.running:
                e.running.remove(job)
                self.generated += TOKENS * (self.now - (job.started or self.now)) / job.service
                self._fill(job.engine)
        self._retry(job, True, None)

    # -- the run ------------------------------------------------------------------------

    def run(self, arrivals: list[Arrival], seconds: float) -> list[Outcome]:
        outcomes = [Outcome(a) for a in arrivals]
        for o in outcomes:
            self.at(o.arrival.at, "retry", (o, 0))
        self.at(0.0, "tick", None)
        while self.events:
            t, _, kind, what = heapq.heappop(self.events)
            if t > seconds:
                break
            self.now = t
            if kind == "tick":
                self.door_age_s = self._oldest_waiting_s()
                for i, e in enumerate(self.engines):
                    self.most_running[i] = max(self.most_running[i], len(e.running))
                    self.seen_full[i] = self.seen_full[i] or e.head() is not None
                self.at(t + ROUND_S, "tick", None)
            elif kind == "retry":
                assert isinstance(what, tuple)
                self.send(*what)
            elif kind == "finish":
                job = what
                assert isinstance(job, Job)
                if job.done:
                    continue
                self.engines[job.engine].running.remove(job)
                self.generated += TOKENS
                self._answer(job, 200, None)
                self._fill(job.engine)
            elif kind == "timeout":
                assert isinstance(what, Job)
                self._abandon(what)
            elif kind == "ttl":
                job = what
                assert isinstance(job, Job)
                if not job.done and job.queued and job.engine < 0:
                    self._answer(job, 503, None)  # done: the router skips it
        for e in self.engines:  # the window's end: what runs has generated its share so far
            self.generated += sum(TOKENS * (seconds - (j.started or seconds)) / j.service for j in e.running)
        return outcomes


def capacity(engines: int, slots: int, service_s: float, seed: int, seconds: float) -> float:
    """Answers per second when saturated with no deadline: 3x the nominal rate, deadlines
    far away, the answers of the last three quarters of the window."""
    rate = 3 * engines * slots / service_s
    arrivals = [Arrival(a.id, a.at, 1e9) for a in schedule(seed, rate, seconds, service_s, "cap")]
    fleet = Fleet("direct", engines, slots, service_s, seed)
    outs = fleet.run(arrivals, seconds)
    done = [o for o in outs if o.ok and o.done_at is not None and o.done_at >= seconds / 4]
    return len(done) / (seconds * 0.75)


def run_all(
    loads: list[float], seconds: float, seed: int, engines: int = 16, slots: int = 4, service_s: float = 2.0, caps: tuple[int, ...] = (2, 8, 32)
) -> tuple[float, list[Result]]:
    c = capacity(engines, slots, service_s, seed, max(seconds, 60.0))
    ttl = 10 * service_s
    policies: list[tuple[str, dict]] = [("direct", {}), *((f"vllm cap {q}", {"cap": q}) for q in caps), (f"ttl {ttl:g} s", {"ttl_s": ttl}), ("door", {})]
    results = []
    for load in loads:
        arrivals = schedule(seed, load * c, seconds, service_s, f"sim{load:g}")
        for name, kw in policies:
            mode = "door" if name == "door" else "ttl" if name.startswith("ttl") else "direct"
            fleet = Fleet(mode, engines, slots, service_s, seed, **kw)
            outs = fleet.run(arrivals, seconds)
            results.append(Result(name, load, seconds, c, outs, fleet.generated))
    return c, results
