"""core.queue_age: the engine's queue age from its counters (docs/engines.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from llm_health.core import engines
from llm_health.core.engines import EngineReading, Reading
from llm_health.core.queue_age import MAX_POINTS, QueueAges, acted_on, door_age, door_ahead, door_covers, door_running, door_wait, keep_until, to_ms

NAN = math.nan


def unit(finished: float, running: float, waiting: float, engine: str = "0") -> EngineReading:
    # VLLM_V1 counters: iteration count, prompt, generation, success, preemptions, prefix queries
    return EngineReading("m", engine, running, waiting, 0.0, 0.0, (0.0, 0.0, 0.0, finished, 0.0, 0.0), ())


def reading(*units: EngineReading, start: float = 1000.0, profile: str = "vllm_v1") -> Reading:
    return Reading(profile, start, {u.key: u for u in units})


def test_fifo_burst_ages_by_the_round_of_arrival():
    q = QueueAges()
    q.update(reading(unit(0, 0, 0)), now=0.0)
    assert q.backend == 0.0  # nothing waits: 0, known
    q.update(reading(unit(0, 1, 4)), now=1.0)  # five arrived in (0, 1]
    assert q.backend == 0.0  # arrival 2 (the head) arrived by 1.0
    q.update(reading(unit(0, 1, 4)), now=2.0)
    assert q.backend == 1.0
    q.update(reading(unit(1, 1, 5)), now=3.0)  # one finished, arrival 3 is the head; two more came
    assert q.backend == 2.0
    q.update(reading(unit(5, 1, 1)), now=4.0)  # head is arrival 7: it came in (2, 3]
    assert q.backend == 1.0
    q.update(reading(unit(7, 0, 0)), now=5.0)
    assert q.backend == 0.0
    assert not q.curves[("m", "0")].points  # nothing kept once the queue is empty


def test_first_read_of_a_queue_is_unknown_until_its_head_arrived_after_it():
    q = QueueAges()
    q.update(reading(unit(10, 1, 3)), now=0.0)  # requests 12..14 waited before anything was read
    assert q.backend is None
    q.update(reading(unit(10, 1, 4)), now=1.0)  # arrival 15 came in (0, 1]; head still 12
    assert q.backend is None
    q.update(reading(unit(13, 1, 1)), now=2.0)  # head is 15
    assert q.backend == 1.0


def test_preemption_puts_the_last_scheduled_back_at_the_head():
    q = QueueAges()
    q.update(reading(unit(0, 0, 0)), now=0.0)
    q.update(reading(unit(0, 2, 0)), now=1.0)  # arrivals 1, 2 by 1.0, both running
    q.update(reading(unit(0, 2, 1)), now=2.0)  # arrival 3 by 2.0
    assert q.backend == 0.0
    q.update(reading(unit(0, 1, 2)), now=3.0)  # arrival 2 preempted: the head again
    assert q.backend == 2.0  # it arrived in (0, 1]: within one round of its true age
    q.update(reading(unit(1, 2, 0)), now=4.0)
    assert q.backend == 0.0


def test_abort_counted_as_finished_and_vanished_requests_keep_a_lower_bound():
    q = QueueAges()
    q.update(reading(unit(0, 0, 0)), now=0.0)
    q.update(reading(unit(0, 1, 1)), now=1.0)  # arrivals 1, 2 by 1.0
    q.update(reading(unit(0, 1, 3)), now=2.0)  # arrivals 3, 4 by 2.0
    q.update(reading(unit(1, 1, 2)), now=3.0)  # the head (2) aborted: success{abort} +1
    assert q.backend == 1.0  # head is 3 now
    q.update(reading(unit(1, 1, 1)), now=4.0)  # one vanished from every count: points lowered
    assert q.backend is not None and q.backend <= 2.0


def test_restart_is_unknown_then_right_again_never_stale():
    q = QueueAges()
    q.update(reading(unit(0, 0, 0)), now=0.0)
    q.update(reading(unit(0, 1, 3)), now=1.0)
    q.update(reading(unit(0, 1, 3)), now=30.0)
    assert q.backend == 29.0
    # A new process: counters from 0, a new start time, two requests already waiting.
    q.update(reading(unit(0, 1, 2), start=2000.0), now=31.0)
    assert q.backend is None
    q.update(reading(unit(0, 1, 3), start=2000.0), now=32.0)  # arrival 4 by 32
    assert q.backend is None
    q.update(reading(unit(3, 1, 0), start=2000.0), now=33.0)
    assert q.backend == 0.0
    # The same with an unchanged start time but a counter that went backwards.
    q.update(reading(unit(0, 1, 1), start=2000.0), now=34.0)
    assert q.backend is None
    # And the health decision's word alone.
    q.update(reading(unit(5, 1, 0), start=2000.0), now=35.0)
    q.update(reading(unit(6, 1, 1), start=2000.0), now=36.0, restarted=True)
    assert q.backend is None


def test_no_reading_or_no_evidence_is_unknown():
    q = QueueAges()
    q.update(reading(unit(0, 0, 0)), now=0.0)
    q.update(reading(unit(0, 1, 1)), now=1.0)
    q.update(None, now=2.0)
    assert q.backend is None
    assert q.units == {("m", "0"): None}
    q.update(reading(unit(0, 1, 1)), now=3.0)  # the same process: the curve carried on
    assert q.backend == 2.0
    q.update(reading(unit(0, NAN, 1)), now=4.0)
    assert q.backend is None
    assert QueueAges().backend is None  # no round yet


def test_data_parallel_backend_is_the_oldest_unit_and_unknown_if_any_is():
    q = QueueAges()
    q.update(reading(unit(0, 0, 0, "0"), unit(0, 0, 0, "1")), now=0.0)
    q.update(reading(unit(0, 1, 1, "0"), unit(0, 1, 0, "1")), now=1.0)
    q.update(reading(unit(0, 1, 1, "0"), unit(0, 1, 1, "1")), now=5.0)
    assert q.units == {("m", "0"): 4.0, ("m", "1"): 0.0}
    assert q.backend == 4.0
    q.update(reading(unit(0, 1, 1, "0"), unit(0, NAN, 1, "1")), now=6.0)
    assert q.units[("m", "0")] == 5.0 and q.backend is None


def test_engines_without_a_finished_counter_know_only_an_empty_queue():
    for profile, running, waiting in (("llamacpp", 1, 0), ("triton", 0, 0), ("sglang", 2, 0), ("tgi", 1, 0)):
        n = len(engines.BY_NAME[profile].counters)
        e = EngineReading("", "", running, waiting, 0.0, 0.0, (0.0,) * n, ())
        q = QueueAges()
        q.update(Reading(profile, None, {e.key: e}), now=0.0)
        assert q.backend == 0.0, profile
        e = EngineReading("", "", running, 3, 0.0, 0.0, (0.0,) * n, ())
        q.update(Reading(profile, None, {e.key: e}), now=1.0)
        assert q.backend is None, profile


def test_a_real_vllm_payload_reads_through_the_profile():
    text = open("tests/data/vllm-real/busy.prom").read()
    r = engines.read(text)
    q = QueueAges()
    q.update(r, now=0.0)
    (e,) = r.engines.values()
    assert q.backend == (0.0 if e.waiting == 0 else None)


def test_memory_is_bounded():
    q = QueueAges(max_points=8)
    q.update(reading(unit(0, 0, 0)), now=0.0)
    for i in range(1, 100):
        q.update(reading(unit(0, 1, i)), now=float(i))  # a queue that only grows
    assert len(q.curves[("m", "0")].points) == 8
    assert q.backend is not None and q.backend <= 98.0  # younger than the truth, never older
    assert MAX_POINTS >= 1024


def test_to_ms():
    assert to_ms(None) is None
    assert to_ms(1.2349) == 1234
    assert to_ms(0.0) == 0


@dataclass
class Fifo:
    """A first-come-first-served engine with `slots` running places; preemption sends the
    most recently scheduled running request back to the head, as vLLM's scheduler does."""

    slots: int
    waiting: list[float] = field(default_factory=list)  # arrival times, head first
    running: list[tuple[float, float]] = field(default_factory=list)  # (arrival, work left)
    finished: int = 0

    def step(self, now: float, dt: float, arrivals: int, work: float, preempt: bool) -> None:
        self.waiting.extend([now] * arrivals)
        if preempt and self.running:
            arrival, _left = self.running.pop()
            self.waiting.insert(0, arrival)
        self.running = [(a, left - dt) for a, left in self.running]
        done = [r for r in self.running if r[1] <= 0]
        self.finished += len(done)
        self.running = [r for r in self.running if r[1] > 0]
        while self.waiting and len(self.running) < self.slots and not preempt:
            self.running.append((self.waiting.pop(0), work))

    def truth(self, now: float) -> float:
        return now - self.waiting[0] if self.waiting else 0.0


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 4),
    steps=st.lists(st.tuples(st.integers(0, 3), st.floats(0.05, 2.0), st.booleans()), min_size=5, max_size=120),
    round_every=st.integers(1, 10),
)
def test_fifo_figure_is_within_one_round_below_the_truth(slots, steps, round_every):
    dt = 0.1
    engine, q = Fifo(slots), QueueAges()
    q.update(reading(unit(0, 0, 0)), now=0.0)
    last_round = 0.0
    for i, (arrivals, work, preempt) in enumerate(steps, start=1):
        now = i * dt
        engine.step(now - dt / 2, dt, arrivals, work, preempt and i % 7 == 0)
        if i % round_every:
            continue
        q.update(reading(unit(engine.finished, len(engine.running), len(engine.waiting))), now=now)
        figure, truth = q.backend, engine.truth(now)
        assert figure is not None
        assert figure <= truth + 1e-9
        assert truth - figure < (now - last_round) + 1e-9
        last_round = now


def test_a_give_up_in_the_round_of_an_arrival_inflates_the_counters_not_the_door():
    """The issue's case: a request waits 60 s and its client gives up as a new one arrives.
    vLLM counts the give-up nowhere, so arrivals stay at 1 and the counters' figure keeps
    the first request's time: 61 s at t=61 and 70 s at t=70, while the request waiting
    was sent at t=60.5. The door saw the give-up (the client's disconnect) and the arrival."""
    q = QueueAges()
    q.update(reading(unit(0, 0, 0)), now=-1.0)
    q.update(reading(unit(0, 0, 1)), now=0.0)  # request a, sent at t=0 (rounds of 1 s)
    q.update(reading(unit(0, 0, 1)), now=60.0)
    assert q.backend == 60.0
    in_flight = [60_500.0]  # a gave up at 60.5 (gone from the door's set) as b was sent
    q.update(reading(unit(0, 0, 1)), now=61.0)
    assert q.backend == 61.0  # above the truth (0.5 s): the same-round give-up is invisible
    door = door_age(in_flight, running=0, round_ms=61_000, now_ms=61_000)
    assert door == 500.0
    assert door_covers(in_flight, held=1, round_ms=61_000)
    assert acted_on(q.backend * 1000, door, covers=True) == 500.0
    q.update(reading(unit(0, 0, 1)), now=70.0)
    assert q.backend == 70.0
    assert acted_on(q.backend * 1000, door_age(in_flight, 0, 70_000, 70_000), covers=True) == 9_500.0
    # Requests the door never saw (they bypass it): the door cannot cover the engine, and the
    # larger figure is acted on (only the counters see the bypass; the door's is a lower bound).
    assert not door_covers(in_flight, held=3, round_ms=70_000)
    assert door_covers(in_flight, held=3, round_ms=70_000, ended=2)  # two ended or gave up: the engine may hold them yet
    assert acted_on(12_000.0, 9_500.0, covers=False) == 12_000.0 and acted_on(2_000.0, 9_500.0, covers=False) == 9_500.0
    assert acted_on(None, 9_500.0) == 9_500.0 and acted_on(2_000.0, None) == 2_000.0


def test_door_age_rules():
    assert door_age([], running=0, round_ms=0, now_ms=5) == 0.0  # nothing in flight: 0, known
    assert door_age([1.0, 2.0], running=2, round_ms=10, now_ms=20) == 0.0  # all of them run
    # The oldest after the running ones, of those sent by the round's read.
    assert door_age([1.0, 2.0, 3.0], running=1, round_ms=10, now_ms=20) == 18.0
    assert door_age([1.0, 15.0, 2.0], running=1, round_ms=10, now_ms=20) == 18.0
    assert door_age([1.0, 15.0], running=1, round_ms=10, now_ms=20) == 0.0
    assert door_covers([1.0, 2.0, 15.0], held=2, round_ms=10) and not door_covers([1.0, 2.0, 15.0], held=3, round_ms=10)


def test_door_ahead_and_wait_rules():
    # A free sequence: nothing must end first.
    assert door_ahead([1.0], slots=2, held=1, covers=True) == 0
    assert door_ahead([], slots=0, held=0, covers=True) == 0
    # Every sequence taken: the waiting ones, plus a running one, end first; those sent
    # since the read (15.0) count, a round before the engine's counters would show them.
    assert door_ahead([1.0, 2.0], slots=2, held=2, covers=True) == 1
    assert door_ahead([1.0, 2.0, 3.0, 15.0], slots=2, held=3, covers=True) == 3
    # 0 sequences (an older exporter's engine seen running none): one assumed.
    assert door_ahead([1.0, 2.0, 3.0], slots=0, held=3, covers=True) == 3
    # Not yet known (the engine not yet seen full): nothing projected.
    assert door_ahead([1.0, 2.0, 3.0], slots=None, held=3, covers=True) is None
    # Something bypasses the door: at least what the engine held.
    assert door_ahead([1.0, 2.0], slots=2, held=9, covers=False) == 8
    # One ends every service / slots: 4 ahead on 2 sequences at 300 ms a request.
    assert door_wait(4, 2, 300.0) == 600.0
    assert door_wait(4, 0, 300.0) == 1200.0
    # Nothing projected without a service time or the counts.
    assert door_wait(4, 2, 0.0) is None and door_wait(None, 2, 300.0) is None and door_wait(4, None, 300.0) is None
    # Where it is wrong (docs/admission.md): it knows the most sequences seen running, not
    # the engine's; every request ahead is one service long.
    assert door_wait(door_ahead([1.0], slots=1, held=1, covers=True), 1, 300.0) == 300.0
    assert door_wait(door_ahead([1.0, 2.0, 3.0], slots=None, held=3, covers=True), None, 300.0) is None


def test_the_sequences_are_the_most_seen_running_once_the_engine_was_full():
    """At low load the running count at one read is often below what the engine runs when
    full; the door's projection divides by the most it has run at once (QueueAges.slots),
    known only once a read has found requests waiting (before, the most seen is only a
    lower bound), and a restart forgets both."""
    ages = QueueAges()
    steps = (  # running, waiting, restarted: the sequences published
        (1, 0, False, None),  # light load: one running, none waiting, not yet known
        (2, 0, False, None),
        (2, 3, False, 2),  # full: two running, three waiting
        (0, 0, False, 2),  # idle again: still known
        (3, 0, False, 3),  # the most seen rises (a KV cache that freed up)
        (1, 0, True, None),  # a new process: forgotten until full again
        (1, 2, False, 1),
    )
    for running, waiting, restarted, slots in steps:
        ages.update(reading(unit(10, running, waiting)), now=1.0, restarted=restarted, wall=1.0)
        assert (ages.running, ages.waiting, ages.slots) == (running, waiting, slots)
    ages.update(None, now=2.0)  # a round without a reading keeps what the process showed
    assert ages.slots == 1


def test_the_projected_wait_sees_a_burst_the_head_age_does_not():
    """A burst sent since the engine's last read: the head's age (door_age) counts only what
    was sent by the read, so it is 0; the wait projected for the next request counts the
    whole burst."""
    read, now = 10_000.0, 10_500.0
    sent = [9_000.0, 9_100.0] + [10_000.0 + 20 * i for i in range(1, 21)]  # 2 running at the read, 20 since
    assert door_age(sent, running=2, round_ms=read, now_ms=now) == 0.0
    ahead = door_ahead(sent, slots=2, held=2, covers=door_covers(sent, 2, read))
    assert ahead == 21
    assert door_wait(ahead, 2, 400.0) == 4200.0


@settings(max_examples=80, deadline=None)
@given(
    slots=st.integers(1, 4),
    steps=st.lists(st.tuples(st.integers(0, 3), st.floats(0.05, 2.0), st.booleans(), st.integers(0, 2)), min_size=5, max_size=120),
    round_every=st.integers(1, 10),
)
def test_with_clients_giving_up_the_door_figure_is_the_truth(slots, steps, round_every):
    """A first-come-first-served engine (vLLM's preemption included) whose waiting clients
    give up, the oldest first, often in the round of an arrival; the door sees every send
    and every end. At every round the age acted on is the oldest waiting request's."""
    dt = 0.1
    engine, q = Fifo(slots), QueueAges()
    q.update(reading(unit(0, 0, 0)), now=0.0)
    for i, (arrivals, work, preempt, give_ups) in enumerate(steps, start=1):
        now = i * dt
        engine.step(now - dt / 2, dt, arrivals, work, preempt and i % 7 == 0)
        del engine.waiting[:give_ups]  # vLLM counts these nowhere
        if i % round_every:
            continue
        q.update(reading(unit(engine.finished, len(engine.running), len(engine.waiting))), now=now)
        sent = [a * 1000 for a in engine.waiting] + [a * 1000 for a, _ in engine.running]
        door = door_age(sent, len(engine.running), now * 1000, now * 1000)
        covers = door_covers(sent, len(engine.waiting) + len(engine.running), now * 1000)
        figure = acted_on(None if q.backend is None else q.backend * 1000, door, covers)
        assert covers and figure is not None
        assert abs(figure - engine.truth(now) * 1000) < 1e-6


def test_a_read_between_steps_counts_the_engines_sequences_as_running():
    """vLLM publishes its counts after a step: the requests it finished are gone from the
    running ones and the next not yet scheduled. A read of 0 running and 10 waiting on a
    2-sequence engine (a duty-cycled engine paused between steps, from a bench_goodput
    diagnostic) takes the two oldest as running, which the next step runs: the head is the
    third oldest, not the oldest, which would be a whole service time too old."""
    sent = [1_000.0, 1_500.0, 2_000.0] + [2_500.0 + 100 * i for i in range(9)]
    assert door_running(0, 10, 2) == 2
    assert door_age(sent, door_running(0, 10, 2), round_ms=4_000, now_ms=4_000) == 2_000.0
    assert door_age(sent, 0, round_ms=4_000, now_ms=4_000) == 3_000.0  # as read: the oldest, about to run
    assert door_running(1, 0, 2) == 1  # nothing waits: what it runs is all there is
    assert door_running(3, 4, 2) == 3  # more than the most seen: as read
    assert door_running(0, 4, None) == 0 and door_running(0, 4, 0) == 0  # what it runs when full unknown: as read


def test_a_request_whose_end_is_not_heard_stays_past_its_deadline_by_its_budget():
    """A retry admitted shortly before its request's deadline, with the SDK's per-attempt
    timeout equal to the request's budget, is waited on until the deadline plus the budget
    at most: the door keeps it in flight that long (the engine holds it), a minute at most."""
    assert keep_until(enqueued_ms=0, deadline_ms=5_000, cap_ms=60_000) == 10_000
    assert keep_until(enqueued_ms=0, deadline_ms=300_000, cap_ms=60_000) == 360_000
    assert keep_until(enqueued_ms=9_000, deadline_ms=5_000, cap_ms=60_000) == 5_000  # a deadline before its send: the deadline
