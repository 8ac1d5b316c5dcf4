"""The health state machine: previous state plus one round's observation gives a verdict.

Pure: no I/O, no clock. The caller (`probe.monitor`) fetches, and feeds in what it saw and
when.

The rules:

* progress is any change in the engine-side fingerprint (step count, prompt and generation
  tokens, finished requests, preemptions, KV usage, running/waiting), not output tokens:
  a vLLM V1 engine prefilling a long prompt moves only KV usage for a while. A field
  that is no number (NaN, infinite) on either side of a comparison did not move: it is
  evidence of nothing, so a field flipping between a number and NaN is not progress (the
  memory keeps each field's last number, so 5, NaN, 6 is);
* work in flight with no progress is `stalled` for one round and `hung` after two
  consecutive rounds and at least `hung_after_seconds` since the last progress seen;
* progress is not output, though: an engine whose step count moves while requests run
  and none of its output counters (the profile's `output`: a generated token, a finished
  request) moves for `no_output_after_seconds`, longer than any honest prefill takes, is
  in a livelock (vLLM #45094: prefill at 20k tokens/s, decode at 0; a preemption loop that
  prefills again and generates nothing): `stalled` at the first such round past that
  bound, `hung` after `hung_rounds` of them. The clock runs only while requests run and
  the output counters are numbers. A round in which no step was counted (KV usage or
  prompt tokens moved: a V1 chunked prefill) is busy however long; a profile without
  output counters or a step count never reads a livelock;
* an idle engine is probed (one 1-token completion) at most once per `probe_interval`;
  a failed probe is `unresponsive`, two in a row `hung`;
* a new process start time, a counter that went backwards or another engine behind the
  same URL is a `restarted` server: counters of two processes are never compared, a new
  baseline is taken;
* an engine whose running or waiting count is no evidence (NaN, infinite, negative) is
  `unknown`: never idle (so never probed), never hung on that count alone;
* a proxy is judged by `/v1/models` alone: behind a least-connection proxy each
  `/metrics` read may come from another backend;
* a slow or timed-out `/metrics` is load, not death, except on an engine whose profile
  says `metrics_on_loop`: its `/metrics` is a task on the inference loop's own queue,
  answered within milliseconds under any load, so a timeout while its health endpoint
  answers is a loop that takes no task: a failed probe (`unresponsive`, then `hung` after
  two in a row spanning `hung_after_seconds`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import timing
from .engines import BY_NAME, EngineReading, Reading
from .evidence import output_digest, progress_digest
from .states import State, worst

STATES: tuple[State, ...] = tuple(State)


@dataclass(frozen=True)
class Settings:
    hung_after_seconds: float = timing.HUNG_AFTER_S
    probe_interval: float = timing.PROBE_INTERVAL_S
    hung_rounds: int = 2  # consecutive rounds without progress before `hung`
    hung_probe_failures: int = 2
    # Requests running, steps moving and no output for this long is a livelock, not work:
    # longer than any honest prefill takes (a prompt of the engine's max_model_len at the
    # prefill rate it shows while healthy), and the 120 s grace a counter heartbeat on vLLM's
    # iteration count ran several days at with no false restart (docs/engines.md).
    no_output_after_seconds: float = 120.0


@dataclass(frozen=True)
class Observation:
    """What one round saw. `reading` is None when `/metrics` gave nothing usable."""

    now: float
    reading: Reading | None = None
    metrics_error: str | None = None  # e.g. "refused", "timeout after 30s", "HTTP 404"
    metrics_timed_out: bool = False
    metrics_refused: bool = False
    models_ok: bool | None = None  # /v1/models answered; None: not asked
    models_error: str | None = None
    sleeping: bool = False  # /is_sleeping said true
    paused: bool = False  # /is_paused said true
    # The profile's evidence endpoint (`Profile.evidence_path`), read because the engine was
    # already suspected: what it said (None: not read), and whether it timed out.
    evidence: str | None = None
    evidence_timed_out: bool = False


@dataclass(frozen=True)
class EngineMemory:
    """What is kept of one engine unit between rounds."""

    at: float
    fingerprint: tuple[float, ...]
    counters: tuple[float, ...]
    steps: float | None
    generation_tokens: float | None
    last_progress_at: float
    rounds_without_progress: int = 0
    output: tuple[float, ...] = ()  # the profile's output counters, each last number carried
    last_output_at: float = 0.0  # output moved (or nothing ran, or no output counter is a number)
    rounds_without_output: int = 0  # consecutive rounds past no_output_after_seconds


@dataclass(frozen=True)
class Memory:
    """What is kept of one backend between rounds."""

    start_time: float | None = None
    profile: str | None = None
    engines: dict[tuple[str, str], EngineMemory] = field(default_factory=dict)
    last_probe_at: float | None = None
    failed_probes: int = 0
    restarts: int = 0
    last_state: State = State.UNKNOWN
    refusals: dict[str, float] | None = None  # the engine's own refusal counter by reason, as last read


@dataclass(frozen=True)
class EngineVerdict:
    model_name: str
    engine: str
    state: State
    reason: str
    running: float
    waiting: float
    steps_per_second: float | None = None
    generation_tokens_per_second: float | None = None
    seconds_since_progress: float = 0.0
    digest: int = 0  # core.evidence.progress_digest of what this round read (output_digest in a livelock)
    # Seconds requests have run with no output counter moving (0: output moved this round);
    # None where the livelock clock does not run (nothing running, no output counter).
    no_output_seconds: float | None = None


@dataclass(frozen=True)
class Verdict:
    state: State
    reason: str
    memory: Memory
    engines: tuple[EngineVerdict, ...] = ()
    probe_wanted: bool = False
    restarted: bool = False
    # Requests the engine refused itself since the last round, by reason (its own queue
    # cap's 503s): it is shedding load, busy and protecting itself; never a state of its own.
    refused: dict[str, float] = field(default_factory=dict)

    @property
    def shedding(self) -> bool:
        return any(n > 0 for n in self.refused.values())

    @property
    def running(self) -> float:
        return sum(e.running for e in self.engines)

    @property
    def waiting(self) -> float:
        return sum(e.waiting for e in self.engines)

    def total(self, attr: str) -> float | None:
        values = [getattr(e, attr) for e in self.engines if getattr(e, attr) is not None]
        return sum(values) if values else None


def same_fingerprint(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """No field moved. Fields are compared only where both sides are numbers: NaN (a series
    absent, or a value that is no evidence: NaN, infinite, negative) on either side is no
    move, so a field flipping between a number and NaN is not progress. `a` is what the
    memory kept, each field's last number carried forward (`carry`), so a field that goes
    5, NaN, 6 has moved."""
    if len(a) != len(b):
        return False
    return all(x == y or math.isnan(x) or math.isnan(y) for x, y in zip(a, b))


def carry(before: tuple[float, ...] | None, after: tuple[float, ...]) -> tuple[float, ...]:
    """`after`, each NaN field replaced by the last number `before` kept for it."""
    if before is None or len(before) != len(after):
        return after
    return tuple(old if math.isnan(new) else new for old, new in zip(before, after))


def _went_back(before: tuple[float, ...], after: tuple[float, ...]) -> bool:
    return any(y < x for x, y in zip(before, after) if not (math.isnan(x) or math.isnan(y)))


def _rate(new: float | None, old: float | None, seconds: float) -> float | None:
    if new is None or old is None or seconds <= 0 or math.isnan(new) or math.isnan(old):
        return None
    return max(0.0, (new - old) / seconds)


def _remember(
    e: EngineReading,
    now: float,
    last_progress_at: float,
    rounds: int = 0,
    prev: EngineMemory | None = None,
    last_output_at: float | None = None,
    rounds_without_output: int = 0,
) -> EngineMemory:
    """What to keep of this reading; `prev` (same process) carries each field's last number."""
    return EngineMemory(
        at=now,
        fingerprint=carry(prev.fingerprint if prev else None, e.fingerprint),
        counters=carry(prev.counters if prev else None, e.counters),
        steps=e.steps,
        generation_tokens=e.generation_tokens,
        last_progress_at=last_progress_at,
        rounds_without_progress=rounds,
        output=carry(prev.output if prev else None, e.output),
        last_output_at=now if last_output_at is None else last_output_at,
        rounds_without_output=rounds_without_output,
    )


def _output_clock(prev: EngineMemory, e: EngineReading, now: float) -> float | None:
    """Since when requests have run with no output: `prev.last_output_at` while requests run
    and no output counter moved; None (the clock restarts) when nothing runs, when an output
    counter moved, or when none is a number (no evidence either way)."""
    if not e.running > 0 or not any(not math.isnan(x) for x in e.output):
        return None
    if not same_fingerprint(prev.output, e.output):
        return None
    return prev.last_output_at


_NO_COUNT = "{e.running:g} running, {e.waiting:g} waiting: a count that is no evidence (NaN, infinite or negative); neither idle nor hung on it"


def _moved(prev: EngineMemory, e: EngineReading) -> bool:
    """The engine made progress since `prev`: its fingerprint moved. With requests waiting
    and none running, its counters only: the waiting count (and what moves with it) rises
    as requests arrive, which is no progress; a scheduler that admits nothing (the queue
    high, 0 running: docs/engines.md) keeps a growing queue and is stalled, then hung."""
    if e.running == 0 and e.waiting > 0:
        return not same_fingerprint(prev.counters, e.counters)
    return not same_fingerprint(prev.fingerprint, e.fingerprint)


def _judge_engine(
    prev: EngineMemory | None, e: EngineReading, obs: Observation, s: Settings, digest: int, livelock_digest: Callable[[], int]
) -> tuple[EngineVerdict, EngineMemory]:
    now = obs.now
    if prev is None:
        mem = _remember(e, now, now)

        def first(state: State, reason: str) -> EngineVerdict:
            return EngineVerdict(e.model_name, e.engine, state, reason, e.running, e.waiting, digest=digest)

        if e.sleeping or obs.sleeping:
            return first(State.SLEEPING, "engine reports sleep mode"), mem
        if obs.paused:
            return first(State.PAUSED, "engine reports paused"), mem
        if not e.known:
            return first(State.UNKNOWN, _NO_COUNT.format(e=e)), mem
        if e.in_flight:
            return first(State.UNKNOWN, f"{e.running:g} running, {e.waiting:g} waiting: first reading, progress unknown until the next"), mem
        return first(State.IDLE, "nothing running or waiting"), mem

    dt = now - prev.at
    steps_ps = _rate(e.steps, prev.steps, dt)
    gen_ps = _rate(e.generation_tokens, prev.generation_tokens, dt)
    progressed = _moved(prev, e)
    quiet_since = _output_clock(prev, e, now)
    quiet = None if quiet_since is None else now - quiet_since

    def verdict(state: State, reason: str, since: float = 0.0, evidence: int = digest) -> EngineVerdict:
        clocked = e.running > 0 and any(not math.isnan(x) for x in e.output)
        return EngineVerdict(
            e.model_name, e.engine, state, reason, e.running, e.waiting, steps_ps, gen_ps, since, evidence, (quiet or 0.0) if clocked else None
        )

    if e.sleeping or obs.sleeping or obs.paused:
        state = State.PAUSED if obs.paused and not (e.sleeping or obs.sleeping) else State.SLEEPING
        # A sleeping engine keeps its requests but takes no steps: restart the clock.
        return verdict(state, f"engine reports {state}; never hung"), _remember(e, now, now, prev=prev)
    if not e.known:
        # Neither idle (no probe) nor hung: the count that would tell is no evidence.
        since = now if progressed else prev.last_progress_at
        return verdict(State.UNKNOWN, _NO_COUNT.format(e=e)), _remember(e, now, since, prev=prev)
    stepped = e.steps is not None and prev.steps is not None and e.steps != prev.steps and not (math.isnan(e.steps) or math.isnan(prev.steps))
    if stepped and quiet is not None and quiet >= s.no_output_after_seconds:
        # Livelock: the engine moves (steps, prompt tokens, KV, preemptions) and nothing
        # comes out, for longer than any honest prefill takes.
        rounds = prev.rounds_without_output + 1
        mem = _remember(e, now, now, prev=prev, last_output_at=quiet_since, rounds_without_output=rounds)
        what = (
            f"{e.running:g} running, {e.waiting:g} waiting, steps moving{f' ({steps_ps:.1f}/s)' if steps_ps else ''} but no token generated "
            f"and no request finished for {quiet:.0f}s, longer than no_output_after_seconds {s.no_output_after_seconds:g}s: a livelock, not work"
        )
        state = State.HUNG if rounds >= s.hung_rounds else State.STALLED
        # The evidence of a livelock: its output, which a fresh read must show unchanged.
        return verdict(state, f"{what} ({rounds} round(s))", quiet, livelock_digest()), mem
    if progressed:
        mem = _remember(e, now, now, prev=prev, last_output_at=quiet_since)
        if e.in_flight:
            if steps_ps:
                how = f", {steps_ps:.1f} steps/s"
            else:  # a V1 long chunked prefill: no step counted, but KV usage (or another series) moved
                how = " (no step counted: KV cache or other engine series moved, as in a long prefill)"
            return verdict(State.BUSY, f"{e.running:g} running, {e.waiting:g} waiting, engine progressing{how}"), mem
        return verdict(State.IDLE, "nothing running or waiting"), mem
    if not e.in_flight:
        return verdict(State.IDLE, "nothing running or waiting"), _remember(e, now, now, prev=prev)

    rounds = prev.rounds_without_progress + 1
    since = now - prev.last_progress_at
    mem = _remember(e, now, prev.last_progress_at, rounds, prev, last_output_at=quiet_since)
    what = f"{e.running:g} running, {e.waiting:g} waiting"
    if e.running == 0:
        what += " (waiting with nothing running)"
    if rounds >= s.hung_rounds and since >= s.hung_after_seconds:
        return verdict(State.HUNG, f"{what}, no engine progress for {rounds} rounds ({since:.0f}s)", since), mem
    return verdict(State.STALLED, f"{what}, no engine progress for {rounds} round(s) ({since:.0f}s)", since), mem


def _restart_reason(prev: Memory, reading: Reading) -> str | None:
    """Why this reading comes from a new process, or None."""
    if not prev.engines:
        return None
    if prev.profile is not None and reading.profile != prev.profile:
        return f"another engine answers: {prev.profile} before, {reading.profile} now"
    if reading.start_time is not None and prev.start_time is not None and reading.start_time != prev.start_time:
        return "process start time changed"
    for key, e in reading.engines.items():
        old = prev.engines.get(key)
        if old is not None and _went_back(old.counters, e.counters):
            return "a counter went backwards"
    return None


def decide(prev: Memory | None, obs: Observation, s: Settings, kind: str = "engine") -> Verdict:
    """One round: previous memory and this round's observation give the verdict, with the
    requests the engine refused itself since the last round (`Verdict.refused`): shedding
    is said in the reason and changes no state but idle (a refusal is a full queue, so
    busy); what the evidence endpoint said is said in the reason too."""
    verdict = _shedding(prev, obs, _decide(prev, obs, s, kind), kind)
    if obs.evidence is not None:
        # Said, never judged alone: the state is what the reads above already prove.
        said = f"{obs.evidence}: the inference loop takes no task (hang evidence)" if obs.evidence_timed_out else obs.evidence
        verdict = replace(verdict, reason=f"{verdict.reason}; {said}")
    return verdict


def _shedding(prev: Memory | None, obs: Observation, verdict: Verdict, kind: str) -> Verdict:
    """The verdict with the refusals since the last round (shedding), a new baseline kept."""
    now = obs.reading.refusals if obs.reading is not None and kind != "proxy" else None
    if now is None:
        return verdict
    before = None if verdict.restarted or prev is None else prev.refusals
    # A reason first seen counts from 0, as a new counter series starts.
    refused = {reason: n - before.get(reason, 0.0) for reason, n in now.items() if before is not None and n > before.get(reason, 0.0)}
    memory = replace(verdict.memory, refusals=now)
    if not refused:
        return replace(verdict, memory=memory)
    said = ", ".join(f"{n:g} {reason}" for reason, n in sorted(refused.items()))
    reason = f"{verdict.reason}; shedding: the engine refused {said} since the last round"
    if verdict.state is State.IDLE:
        # A refusal means the engine's queue was full this round, whatever its gauges say
        # (they come from the scheduler's last step and can trail the front end's count by
        # a round): busy, and never sent the idle probe.
        memory = replace(memory, last_state=State.BUSY)
        reason = f"busy: {verdict.reason} in its gauges, but its queue was full this round; shedding: the engine refused {said} since the last round"
        return replace(verdict, state=State.BUSY, memory=memory, refused=refused, reason=reason, probe_wanted=False)
    return replace(verdict, memory=memory, refused=refused, reason=reason)


def _decide(prev: Memory | None, obs: Observation, s: Settings, kind: str) -> Verdict:
    prev = prev or Memory()
    if kind == "proxy":
        if obs.models_ok:
            return Verdict(State.UP, "proxy: /v1/models answered (its backends are checked directly)", replace(prev, last_state=State.UP))
        return Verdict(State.DOWN, f"proxy: /v1/models failed: {obs.models_error or 'no answer'}", replace(prev, last_state=State.DOWN))

    reading = obs.reading
    if reading is None:
        if obs.models_ok:
            profile = BY_NAME.get(prev.profile or "")
            if obs.metrics_timed_out and profile is not None and profile.metrics_on_loop and prev.engines:
                # The engine answers /metrics from its inference loop's own task queue (the
                # queue's worker answers during a decode, within milliseconds under any load):
                # a /metrics that times out while /health answers is a loop that takes no
                # task, a failed probe. Hung after `hung_probe_failures` in a row and at least
                # `hung_after_seconds` since /metrics last answered; the probe is due as soon
                # as /metrics answers idle again, to confirm the loop is back.
                failed = prev.failed_probes + 1
                silent = obs.now - max(e.at for e in prev.engines.values())
                state = State.HUNG if failed >= s.hung_probe_failures and silent >= s.hung_after_seconds else State.UNRESPONSIVE
                reason = (
                    f"{profile.title} /metrics {obs.metrics_error} while its {profile.health_path} answers: the inference loop takes no task "
                    f"({failed} failed read(s) in a row, {silent:.0f}s since /metrics last answered)"
                )
                return Verdict(state, reason, replace(prev, failed_probes=failed, last_probe_at=None, last_state=state))
            if obs.metrics_timed_out:
                state, reason = State.UNKNOWN, f"/metrics {obs.metrics_error}; /v1/models answered: a slow read is load, not death"
            else:
                state, reason = State.NO_METRICS, f"no usable /metrics ({obs.metrics_error}); /v1/models answered"
            return Verdict(state, reason, replace(prev, last_state=state))
        why = f"/metrics: {obs.metrics_error or 'no answer'}; /v1/models: {obs.models_error or 'no answer'}"
        return Verdict(State.DOWN, why, replace(prev, last_state=State.DOWN))

    restart_reason = _restart_reason(prev, reading)
    if restart_reason is not None:
        engines = {key: _remember(e, obs.now, obs.now) for key, e in reading.engines.items()}
        restarted = tuple(
            EngineVerdict(
                e.model_name, e.engine, State.RESTARTED, restart_reason, e.running, e.waiting, digest=progress_digest(reading.profile, reading.start_time, e)
            )
            for e in reading.engines.values()
        )
        all_idle = not any(e.in_flight for e in reading.engines.values())
        mem = Memory(
            start_time=reading.start_time,
            profile=reading.profile,
            engines=engines,
            last_probe_at=prev.last_probe_at,
            failed_probes=0,
            restarts=prev.restarts + 1,
            last_state=State.RESTARTED,
        )
        reason = f"restarted: {restart_reason}; new baseline" + ("; probing the idle engine" if all_idle else "")
        return Verdict(State.RESTARTED, reason, mem, restarted, probe_wanted=all_idle, restarted=True)

    evs: list[EngineVerdict] = []
    engines = {}
    for key, e in reading.engines.items():
        ev, emem = _judge_engine(
            prev.engines.get(key),
            e,
            obs,
            s,
            progress_digest(reading.profile, reading.start_time, e),
            functools.partial(output_digest, reading.profile, reading.start_time, e),
        )
        evs.append(ev)
        engines[key] = emem
    state = worst(ev.state for ev in evs)

    def memory(state: State, failed_probes: int) -> Memory:
        return replace(prev, start_time=reading.start_time, profile=reading.profile, engines=engines, last_state=state, failed_probes=failed_probes)

    if state is State.IDLE:
        # Only an engine with nothing in flight is ever sent a request.
        due = prev.last_probe_at is None or obs.now - prev.last_probe_at >= s.probe_interval
        if prev.failed_probes:
            state = State.HUNG if prev.failed_probes >= s.hung_probe_failures else State.UNRESPONSIVE
            reason = f"idle but the last {prev.failed_probes} probe(s) failed"
            return Verdict(state, reason, memory(state, prev.failed_probes), tuple(evs), probe_wanted=due)
        return Verdict(State.IDLE, "nothing running or waiting", memory(State.IDLE, 0), tuple(evs), probe_wanted=due)

    # Work showed up and the engine moved: any failed probes are forgotten.
    chosen = next(ev for ev in evs if ev.state == state)
    reason = chosen.reason
    if len(evs) > 1:
        reason = f"engine {chosen.engine or '-'} model {chosen.model_name or '-'}: {reason}"
    return Verdict(state, reason, memory(state, 0), tuple(evs))


def after_probe(v: Verdict, ok: bool, now: float, s: Settings, detail: str = "") -> Verdict:
    """Fold the result of the probe that `decide` asked for into its verdict."""
    mem = replace(v.memory, last_probe_at=now)
    if ok:
        state = State.RESTARTED if v.state is State.RESTARTED else State.IDLE
        mem = replace(mem, failed_probes=0, last_state=state)
        reason = f"{v.reason if state is State.RESTARTED else 'idle'}; probe answered {detail}".strip()
        return replace(v, state=state, reason=reason, memory=mem, probe_wanted=False)
    failed = v.memory.failed_probes + 1
    state = State.HUNG if failed >= s.hung_probe_failures else State.UNRESPONSIVE
    mem = replace(mem, failed_probes=failed, last_state=state)
    reason = f"idle engine did not answer a 1-token probe ({detail or 'failed'}); {failed} failed in a row"
    return replace(v, state=state, reason=reason, memory=mem, probe_wanted=False)
