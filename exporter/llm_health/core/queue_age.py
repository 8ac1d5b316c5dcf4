"""The age of the oldest request waiting inside an engine, from the counters every round
already reads, without sending a request. Pure: no I/O, time passed in.

vLLM (V1 and V0) counts, per engine unit, the requests it finished
(`vllm:request_success_total`, summed over `finished_reason`), and gauges the requests
running and waiting. Over the rounds they give two curves:

    arrivals    A = finished + running + waiting
    departures  D = finished + running      (requests that left the waiting queue)

Each round where A rose appends the point (A, t): "at least A requests had arrived by
t" (t is when the round's read ended). Among the first D + 1 arrivals at most D have
left the queue, so one of them still waits: the oldest waiting request arrived no later
than the first point with A >= D + 1, and its age is at least `now - t` of that point.
That is the figure: a lower bound of the true age whatever the scheduling order.

With first-come-first-served scheduling the waiting queue is exactly arrivals D+1..A
(requests are scheduled in arrival order, whatever order they finish in), so the head
is arrival D + 1, which arrived after the round before that point: the figure is then
below the truth by less than one round (plus the read's own duration). vLLM's
preemption puts the most recently scheduled running request back at the front of the
queue: D falls by one and the head is that request, arrival D + 1 again, so the bound
holds across preemptions too. What bends it (the figure stays a lower bound, only a
looser one): priority scheduling (a low-priority request can wait behind younger ones),
a waiting request from the middle of the queue counted as finished
(`finished_reason="abort"`: D rises as if the head had left), a request that vanishes
from every count while the count shows it (A falls: every point is lowered by as many,
which keeps each point true).

Where it is wrong: vLLM 0.32 counts a request whose client gave up while it waited
nowhere (`OutputProcessor.abort_requests` drops it with no stats), so a give-up and an
arrival in one round leave A unchanged and cannot be told from nothing at all. The
points then keep the arrival time of the request that left, and the figure is ABOVE
the truth: by as much as the request that gave up had waited more than the one now at
the head, until the queue drains past that point (a request that waited 60 s gives up as
one arrives: the figure reads 60 s while the oldest request waiting is 1 s old). Under
overload with deadlines clients give up every round, so a door in front of the engine
does not act on this figure alone: it knows when each request it sent was sent and
when it ended, the client's give-up included, and `door_age` reads the age from that
with the engine's waiting count (`acted_on`: the smaller of the two).

Unknown (None), never 0 and never a stale age, where it cannot be known: a round that
read no usable numbers; a process seen for the first time (the exporter's start, a
restart: a new `process_start_time_seconds` or a counter that went backwards) until its
queue's head is a request that arrived after that first read (the requests already
waiting then arrived at an unknown time); an engine profile with no finished-requests
counter while its waiting count is above 0. A queue with nothing waiting is 0, known,
for every profile.

Memory is bounded: points at or below `finished` can never be the answer again and are
dropped; beyond `max_points` (one point per round at most) the oldest are dropped, which
only makes the figure younger (still a lower bound).

A backend's figure is the largest of its engine units' (data-parallel ranks): the age
of the oldest request waiting anywhere in it, and unknown if any unit's is unknown (the
oldest request could be in the unit that cannot be read).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .engines import BY_NAME, EngineReading, Reading

MAX_POINTS = 4096


def counts(profile: str, e: EngineReading) -> tuple[float, float, float] | None:
    """(finished, running, waiting) of a unit whose profile counts finished requests;
    None for a profile that does not (its `finished` field: docs/engines.md says why those
    give 0 when nothing waits and unknown otherwise). Values may be NaN (no evidence)."""
    p = BY_NAME.get(profile)
    if p is None or p.finished is None:
        return None
    finished = e.counters[list(p.counters).index(p.finished)]
    return finished, e.running, e.waiting


@dataclass
class Curve:
    """One engine unit's arrival curve, for one process."""

    start_time: float | None
    baseline: float  # arrivals already counted when this process was first read: their times are unknown
    arrivals: float
    finished: float
    points: deque[tuple[float, float]] = field(default_factory=deque)  # (A, t), A strictly rising


def _unit_age(curve: Curve, finished: float, running: float, waiting: float, now: float, max_points: int) -> float | None:
    """Advance the curve with this round's numbers and answer the unit's age."""
    arrivals = finished + running + waiting
    points = curve.points
    if arrivals < curve.arrivals:
        # Requests that left without being counted anywhere: every point lowered by as
        # many stays true ("at least A arrivals by t" of the requests still counted).
        gone = curve.arrivals - arrivals
        kept = [(a - gone, t) for a, t in points if a - gone > 0]
        points.clear()
        points.extend(kept)
    elif arrivals > curve.arrivals:
        points.append((arrivals, now))
    curve.arrivals, curve.finished = arrivals, finished
    while points and points[0][0] <= finished:
        points.popleft()
    while len(points) > max_points:
        points.popleft()
    if waiting == 0:
        return 0.0
    head = finished + running + 1
    if head <= curve.baseline:
        return None
    for a, t in points:
        if a >= head:
            return max(0.0, now - t)
    return None


class QueueAges:
    """Per engine unit of one backend, the curves and the last round's figures."""

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_points = max_points
        self.curves: dict[tuple[str, str], Curve] = {}
        self.units: dict[tuple[str, str], float | None] = {}  # the last round's figure per unit
        self.waiting: int | None = None  # the last round's waiting count, every unit (None: unknown)
        self.running: int | None = None  # and its running count
        # The most sequences it ran at once since its process started (at low load the
        # running count at one read is often below it), and whether a read has found it
        # full (requests waiting: it ran all it could); both reset on a restart.
        self.most_running: int | None = None
        self.seen_full = False
        self.read_at: float | None = None  # when that round's read ended, Unix seconds (the doors compare it with their clocks)

    @property
    def slots(self) -> int | None:
        """What it runs when full, for a door's projected wait (`door_ahead`): the most
        sequences it ran at once since its process started, known only once a read has
        found requests waiting. Before that the most seen is only a lower bound (a
        2-sequence engine at low load may never have run two), and a wait projected on it
        too long: a door would refuse requests that would have made their deadlines (an
        engine just started, filling, is read with a few running and none waiting). None:
        not yet known."""
        return self.most_running if self.seen_full else None

    @property
    def backend(self) -> float | None:
        """The backend's figure: the largest unit's, unknown if any is unknown or none was read."""
        if not self.units or any(age is None for age in self.units.values()):
            return None
        return max(age for age in self.units.values() if age is not None)

    def forget(self) -> None:
        """A round without a usable reading: every figure unknown (the curves are kept: the
        same process read again continues them, a new one is told by its start time)."""
        self.units = dict.fromkeys(self.units)

    def update(self, reading: Reading | None, now: float, restarted: bool = False, wall: float | None = None) -> None:
        """One round's reading (None: nothing usable), read by `now`; `restarted` where the
        health decision saw a new process (core.health); `wall`: the same instant in Unix
        seconds (`read_at`, what the doors compare with)."""
        if reading is None:
            self.forget()
            self.waiting = self.running = None
            return
        waits = [e.waiting for e in reading.engines.values()]
        runs = [e.running for e in reading.engines.values()]
        known = waits and not any(math.isnan(x) for x in (*waits, *runs))
        self.waiting, self.running = (int(sum(waits)), int(sum(runs))) if known else (None, None)
        if restarted:
            self.most_running, self.seen_full = None, False
        if self.running is not None:
            self.most_running = max(self.most_running or 0, self.running)
            self.seen_full = self.seen_full or bool(self.waiting)
        self.read_at = wall
        units: dict[tuple[str, str], float | None] = {}
        curves: dict[tuple[str, str], Curve] = {}
        for key, e in reading.engines.items():
            got = counts(reading.profile, e)
            if got is None:
                units[key] = 0.0 if e.waiting == 0 else None
                continue
            finished, running, waiting = got
            curve = self.curves.get(key)
            if any(math.isnan(x) for x in got):
                units[key] = None
                if curve is not None and not restarted:
                    curves[key] = curve
                continue
            new_process = (
                curve is None
                or restarted
                or finished < curve.finished
                or (reading.start_time is not None and curve.start_time is not None and reading.start_time != curve.start_time)
            )
            if new_process:
                arrivals = finished + running + waiting
                curve = Curve(reading.start_time, baseline=arrivals, arrivals=arrivals, finished=finished)
            assert curve is not None
            curves[key] = curve
            units[key] = _unit_age(curve, finished, running, waiting, now, self.max_points)
        self.curves, self.units = curves, units


def door_running(running: int, waiting: int, slots: int | None) -> int:
    """How many of the requests in flight at an engine's read a door's figure takes as
    running (`door_age`'s ``running``; `store.scripts.DECIDE_LUA` counts the same per
    backend): its running count, but where requests wait, at least ``slots``, what it runs
    when full (the published `S`, `QueueAges.slots`; None or 0 while not yet known).

    vLLM publishes its counts after a step, with the requests that step finished already
    gone from the running ones and the waiting ones not yet scheduled: a read between two
    steps shows fewer running than it runs while requests wait (on a duty-cycled engine,
    for as long as it is paused: reads of 0 running and 10 waiting on a 2-sequence engine).
    Taken as they are, the figure would count a request the next step runs as the head of
    the queue, up to a whole service time too old. Where it is wrong: an engine that runs
    fewer than its most because its KV cache is full (a preemption, long prompts) while
    requests wait; the figure then skips requests that truly wait, and is too young by
    as many places in the queue."""
    if waiting > 0 and slots:
        return max(running, slots)
    return running


def door_age(admitted_ms: Sequence[float], running: int, round_ms: float, now_ms: float) -> float:
    """The age of the oldest request waiting, as a door in front of the engine sees it
    (`store.scripts.DECIDE_LUA` runs the same rule inside Redis; a test holds them equal).

    ``admitted_ms``: when each request the door sent on and has not yet seen end was sent
    (an end: its answer, an error, or its client giving up, which aborts it in the engine;
    one whose end is never heard leaves at its deadline plus its own budget, `keep_until`);
    ``running``: the engine's running count read at ``round_ms`` (the exporter's last
    round), as `door_running` takes it. Of the requests in flight at ``round_ms``,
    with first-come-first-served scheduling the ``running`` oldest are the ones running
    (vLLM's preemption sends back the most recently scheduled, the youngest running), so
    the next oldest is the head of the queue, counted from its send: the engine's waiting
    queue and the requests its API server holds before the engine takes them in (on a busy
    engine, seconds). A client that gives up is gone from the set at once, so unlike the
    counters' figure (`QueueAges`) it never keeps the age of a request that left. 0 when no
    more were in flight than run. Runs high where the door never hears of an end (a lost
    report: until that request leaves, `keep_until`); low where other traffic bypasses the
    door (`door_covers`)."""
    before = sorted(t for t in admitted_ms if t <= round_ms)
    if len(before) <= running:
        return 0.0
    return max(0.0, now_ms - before[running])


def keep_until(enqueued_ms: float, deadline_ms: float, cap_ms: float) -> float:
    """Until when a door keeps a request it sent in its in-flight set when it never hears
    the request's end (`store.scripts.DECIDE_LUA` scores it so): its deadline plus its own
    budget (deadline less first send), ``cap_ms`` at most (`GAVE_UP_MS`, a minute).

    A request's end is normally heard (its answer, an error, its client giving up); this
    bounds a lost one. It is not the deadline itself: a retry admitted shortly before the
    deadline is still waited on by its client past it (the OpenAI SDK's per-attempt
    timeout counts from that attempt's own start, and a client whose per-attempt timeout
    is its budget waits until deadline + budget at most), and the engine holds it in its
    queue all that time. A set that dropped it at the deadline would count the queue's head
    younger than it is (a diagnostic of bench_goodput found age errors of -1 s from just
    this: bench/notes/bench_goodput.md)."""
    return deadline_ms + max(0.0, min(cap_ms, deadline_ms - enqueued_ms))


def door_covers(admitted_ms: Sequence[float], held: int, round_ms: float, ended: int = 0) -> bool:
    """Whether the door sent at least as many requests in flight at ``round_ms`` as the
    engine then held (``held``: running + waiting). ``ended``: those that have ended since,
    and those whose clients gave up within a minute before (the engine holds one until it
    notices: a waiting request, possibly until it would have run). Then nothing it holds
    bypassed the door, and the door's figure stands alone."""
    return sum(1 for t in admitted_ms if t <= round_ms) + ended >= held


def door_ahead(admitted_ms: Sequence[float], slots: int | None, held: int, covers: bool) -> int | None:
    """The requests that must end before one a door sends now can start
    (`store.scripts.DECIDE_LUA` counts the same): every request it has in flight, those
    sent since the engine's last read included (where the door does not cover what the
    engine holds, at least the ``held`` it then held), less the engine's ``slots`` (the
    most sequences it has run at once, `QueueAges.slots`), plus one when every sequence is
    taken (a running one must end first); 0 while a sequence is free. With 0 sequences
    (an older exporter's engine seen running none), one is assumed; None (the engine not
    yet seen full, so what it runs when full unknown): None, no wait projected."""
    if slots is None:
        return None
    slots = max(slots, 1)
    held_now = len(admitted_ms) if covers else max(len(admitted_ms), held)
    return held_now - slots + 1 if held_now >= slots else 0


def door_wait(ahead: int | None, slots: int | None, service_ms: float) -> float | None:
    """How long a request sent now waits before the engine takes it in, projected from the
    requests that must end first (``ahead``, `door_ahead`): each takes ``service_ms`` (the
    route's `expected_service_ms`, a request's service while the engine is full) on one of
    the engine's ``slots`` sequences (at least one), so one ends every ``service_ms /
    slots``. The age of the queue's head (`door_age`) says how long the head waited; when
    a burst was sent since the last read, the requests behind it wait longer, and only
    this sees it. None (nothing projected) with no service time configured or the counts
    unknown."""
    if not service_ms or ahead is None or slots is None:
        return None
    return ahead * service_ms / max(1, slots)


def acted_on(counters_ms: float | None, door_ms: float | None, covers: bool = False) -> float | None:
    """The engine queue age a door acts on. Where the door sent everything the engines hold
    (``covers``), its own figure: the head of the queue under first-come-first-served
    scheduling, true when clients give up. Otherwise something bypasses the door, which
    only the counters see: the larger of the two (the door's is then a lower bound, and
    the counters' runs high only where a client gives up in an arrival's round); either
    alone where only one is known."""
    if door_ms is not None and covers:
        return door_ms
    if counters_ms is None:
        return door_ms
    if door_ms is None:
        return counters_ms
    return max(counters_ms, door_ms)


def to_ms(seconds: float | None) -> int | None:
    """The figure as the user's `queue_age_ms`: whole milliseconds (rounded down, so a
    lower bound stays one), None while unknown."""
    return None if seconds is None else int(seconds * 1000)
