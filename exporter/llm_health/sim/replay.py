"""A day of watchdogs, replayed in simulated time: naive watchdogs against llm-health.

One vLLM server at about 8 tokens/s. A batch job keeps 2-4 requests running for minutes
at a time and never sets the watchdog's busy flag. At one moment the engine really hangs
with requests in flight. A restart costs `restart_seconds` of downtime (weights reload)
and fails every request in flight with HTTP 500.

Watchdogs (any combination runs against the same server):

* `naive`: a real request every 5 minutes, 45 s timeout, restart after 5 failures in a row.
  A request sent while the batch runs queues behind it and times out: the field report's
  condition (a 45 s timeout behind 2-4 slow batch requests at about 8 tokens/s). With
  `naive_busy_success` above 0, that share of them gets through in time instead (drawn
  from the plan's seed), for a server whose queue sometimes lets a short request by.
* `cascade`: counts HTTP 500s and restarts when it has seen enough since its last look;
  the more restarts it has done, the fewer it needs (each false restart brings
  the next one sooner).
* `llm-health`: the same decision code as `llm-health check` (engines.read on the payload
  the simulator renders, then health.decide), every `check_period`, reading `check_rounds`
  times `check_interval` apart; restarts only on `hung`. Or with `check_period=interval`,
  the exporter's continuous rounds.

Pure and deterministic: the server is a `sim.SimServer` advanced by the replay's clock,
never started as an HTTP server. Used by `bench/bench_decision.py` and `llm-health drill
watchdog`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..core import engines
from ..core.health import Memory, Observation, Settings, after_probe, decide
from . import servers as sim

DAY = 24 * 3600


@dataclass(frozen=True)
class DayPlan:
    seed: int = 1
    sessions: int = 6  # batch job sessions over the day
    session_minutes: tuple[int, int] = (30, 60)
    hang_at: float = 15 * 3600 + 7 * 60  # the one real hang
    tokens_per_second: float = 8.0
    restart_seconds: float = 180.0  # ~19 GB of weights to reload
    naive_period: float = 300.0
    naive_timeout: float = 45.0
    naive_failures: int = 5
    naive_busy_success: float = 0.0  # share of naive requests to a busy server answered in time
    cascade_period: float = 600.0
    cascade_threshold: int = 4
    check_period: float = 300.0
    check_interval: float = 10.0
    check_rounds: int = 3  # reads per check; 0: continuous rounds, as the exporter runs
    hung_after_seconds: float = 20.0
    probe_interval: float = 60.0


@dataclass
class Restart:
    at: float
    by: str
    hung: bool  # true restart: the engine really was hung
    failed_requests: int


@dataclass
class Outcome:
    watchdogs: tuple[str, ...]
    restarts: list[Restart] = field(default_factory=list)
    probes_sent: int = 0
    probes_to_busy: int = 0
    hang_detected_at: float | None = None
    hang_detected_rounds: int | None = None  # llm-health reads after the hang began
    hang_at: float = 0.0
    timeline: list[tuple[float, str]] = field(default_factory=list)

    @property
    def false_restarts(self) -> int:
        return sum(1 for r in self.restarts if not r.hung)

    @property
    def true_restarts(self) -> int:
        return sum(1 for r in self.restarts if r.hung)

    @property
    def requests_failed(self) -> int:
        return sum(r.failed_requests for r in self.restarts)

    @property
    def detection_seconds(self) -> float | None:
        return None if self.hang_detected_at is None else self.hang_detected_at - self.hang_at

    def summary(self) -> dict:
        return {
            "watchdogs": "+".join(self.watchdogs),
            "restarts": len(self.restarts),
            "false_restarts": self.false_restarts,
            "true_restarts": self.true_restarts,
            "requests_failed_by_restarts": self.requests_failed,
            "probes_sent": self.probes_sent,
            "probes_to_busy_server": self.probes_to_busy,
            "hang_detection_seconds": self.detection_seconds,
            "hang_detection_rounds": self.hang_detected_rounds,
        }


def batch_sessions(plan: DayPlan) -> list[tuple[float, float, int]]:
    """(start, end, requests running) for each batch session, spread over the day."""
    rng = random.Random(plan.seed)
    out = []
    slot = DAY / plan.sessions
    for i in range(plan.sessions):
        length = rng.randint(*plan.session_minutes) * 60
        start = i * slot + rng.uniform(0, max(0.0, slot - length))
        out.append((start, start + length, rng.randint(2, 4)))
    return out


class _Server:
    """The simulated server of the day, with its availability and in-flight requests."""

    def __init__(self, plan: DayPlan):
        self.plan = plan
        self.sim = sim.SimServer("day")
        self.up_at = 0.0  # restarting until then
        self.hung = False
        self.hang_done = False
        self.sessions = batch_sessions(plan)

    def batch_running(self, t: float) -> int:
        for start, end, n in self.sessions:
            if start <= t < end:
                return n
        return 0

    def step(self, t: float, dt: float) -> None:
        e = self.sim.engines[0]
        if t < self.up_at:
            return
        if not self.hang_done and t >= self.plan.hang_at:
            self.hang_done, self.hung = True, True
            if e.running == 0:
                e.running = 2  # the hang happens with requests in flight
            e.mode = "hung"
        if self.hung:
            return
        n = self.batch_running(t)
        if n and (e.mode != "decode" or e.running != n):
            e.mode, e.running, e.tokens_per_second = "decode", n, self.plan.tokens_per_second
        elif not n and e.running:
            e.finish(e.running, generation_tokens=4000, seconds=500)
            e.mode, e.running = "idle", 0
        e.advance(dt)

    @property
    def busy(self) -> bool:
        e = self.sim.engines[0]
        return e.running > 0 or e.waiting > 0

    def restart(self, t: float) -> int:
        failed = self.sim.running + self.sim.waiting if t >= self.up_at else 0
        self.sim.restart()
        self.sim.start_time = t + self.plan.restart_seconds
        self.hung = False
        self.up_at = t + self.plan.restart_seconds
        return failed


def replay(plan: DayPlan = DayPlan(), watchdogs: tuple[str, ...] = ("naive",), tick: float = 1.0) -> Outcome:
    server = _Server(plan)
    out = Outcome(watchdogs=watchdogs, hang_at=plan.hang_at)
    naive_failures = 0
    naive_pending: float | None = None  # when the outstanding naive request resolves
    naive_luck = random.Random(plan.seed + 1)  # which busy-time requests get through
    cascade_seen = 0
    cascade_restarts = 0
    # A check probes an idle engine on every run (the check's own period is the limit);
    # the exporter's continuous rounds probe at most once per probe_interval.
    settings = Settings(hung_after_seconds=plan.hung_after_seconds, probe_interval=plan.probe_interval if not plan.check_rounds else 0.0)
    checker_mem: Memory | None = None
    check_next = 0.0
    check_reads_left = 0
    reads_since_hang = 0

    def do_restart(t: float, by: str) -> None:
        nonlocal cascade_seen, checker_mem, check_reads_left, check_next
        hung = server.hung
        failed = server.restart(t)
        out.restarts.append(Restart(t, by, hung, failed))
        out.timeline.append(
            (t, f"{by} restarts the server ({'hung: true restart' if hung else 'not hung: FALSE restart'}; {failed} requests fail with HTTP 500)")
        )
        if "cascade" in watchdogs:
            cascade_seen += failed
        if hung and out.hang_detected_at is None:
            out.hang_detected_at = t
        checker_mem = None
        check_reads_left, check_next = 0, min(check_next, t + plan.restart_seconds)

    t = 0.0
    while t < DAY:
        server.step(t, tick)
        up = t >= server.up_at

        if "naive" in watchdogs:
            if naive_pending is None and t % plan.naive_period < tick:
                out.probes_sent += 1
                if up and server.busy:
                    out.probes_to_busy += 1
                through = up and server.busy and not server.hung and naive_luck.random() < plan.naive_busy_success
                ok = (up and not server.busy and not server.hung) or through
                naive_pending = t + (0.5 if ok and not through else plan.naive_timeout / 2 if through else plan.naive_timeout)
                naive_failures = 0 if ok else naive_failures + 1
            if naive_pending is not None and t >= naive_pending:
                naive_pending = None
                if naive_failures >= plan.naive_failures:
                    naive_failures = 0
                    do_restart(t, "naive watchdog")

        if "cascade" in watchdogs and t % plan.cascade_period < tick and t > 0:
            need = max(1, plan.cascade_threshold - cascade_restarts)
            if cascade_seen >= need:
                cascade_seen = 0
                cascade_restarts += 1
                do_restart(t, "500-counting watchdog")
            else:
                cascade_seen = 0

        if "llm-health" in watchdogs and up:
            if check_reads_left == 0 and t >= check_next:
                if plan.check_rounds:
                    check_reads_left, checker_mem = plan.check_rounds, None
                    check_next = t + plan.check_period
                else:
                    check_reads_left, check_next = -1, DAY  # the exporter: never ends, keeps its memory
                next_read = t
            if check_reads_left and t >= next_read:
                reading = engines.read(server.sim.payload())
                v = decide(checker_mem, Observation(now=t, reading=reading), settings)
                if server.hung:
                    reads_since_hang += 1
                if v.probe_wanted:
                    out.probes_sent += 1
                    if server.busy:
                        out.probes_to_busy += 1
                    v = after_probe(v, not server.hung, t, settings)
                checker_mem = v.memory
                if check_reads_left > 0:
                    check_reads_left -= 1
                next_read = t + plan.check_interval
                if v.state == "hung":
                    out.hang_detected_rounds = reads_since_hang if server.hung else None
                    out.timeline.append((t, f"llm-health: hung ({v.reason})"))
                    do_restart(t, "llm-health")
                elif plan.check_rounds and v.state not in ("stalled", "unknown", "unresponsive"):
                    check_reads_left = 0  # verdict reached: the check ends
        t += tick
    return out


def format_table(outcomes: list[Outcome]) -> str:
    cols = (
        "watchdogs",
        "restarts",
        "false_restarts",
        "true_restarts",
        "requests_failed_by_restarts",
        "probes_sent",
        "probes_to_busy_server",
        "hang_detection_seconds",
    )
    rows = [o.summary() for o in outcomes]
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    lines = [" | ".join(c.ljust(widths[c]) for c in cols)]
    lines.append("-+-".join("-" * widths[c] for c in cols))
    for r in rows:
        lines.append(" | ".join(_fmt(r[c]).ljust(widths[c]) for c in cols))
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}"
    return str(v)
