"""The simulator's request lifecycle (sim.render.SimEngine, the `overloaded` scenario)
moves vLLM's counters as a real vLLM does for core.queue_age: arrivals are conserved in
finished + running + waiting, preemption moves one request from running back to waiting,
and a saturated engine shows a queue that ages."""

from __future__ import annotations

from llm_health.core import engines
from llm_health.core.queue_age import QueueAges
from llm_health.sim import servers as sim
from llm_health.sim.render import SimEngine, render_vllm


def read(e: SimEngine) -> engines.EngineReading:
    (unit,) = engines.read(render_vllm([e], "sim-model", 1000.0)).engines.values()
    return unit


def finished(u: engines.EngineReading) -> float:
    return u.counters[list(engines.VLLM_V1.counters).index("vllm:request_success_total")]


def test_the_sim_and_the_real_capture_read_through_the_same_profile_fields():
    real = engines.read(open("tests/data/vllm-real/busy.prom").read())
    (r,) = real.engines.values()
    # the real capture's books balance the same way: 4 finished + 4 running + 4 waiting
    assert (finished(r), r.running, r.waiting) == (4.0, 4.0, 4.0)
    server = sim.SimServer("s")
    sim.overloaded(server)
    e = server.engines[0]
    e.advance(0.5)
    assert real.profile == engines.read(render_vllm([e], "sim-model", 1000.0)).profile == "vllm_v1"


def test_overloaded_engine_conserves_arrivals_and_its_queue_ages():
    server = sim.SimServer("s")
    sim.overloaded(server)  # 4 places, 2 s a request, 3 arriving a second
    e = server.engines[0]
    q = QueueAges()

    ages = []
    for i in range(1, 201):  # 20 s in 0.1 s steps, a round every second
        e.advance(0.1)

        u = read(e)
        assert u.running <= 4
        if i == 100:
            e.preempt()
            after = read(e)
            assert (after.running, after.waiting, finished(after)) == (u.running - 1, u.waiting + 1, finished(u))
            assert after.counters[list(engines.VLLM_V1.counters).index("vllm:num_preemptions_total")] == 1
        if i % 10 == 0:
            q.update(engines.read(render_vllm([e], "sim-model", 1000.0)), now=i / 10)
            ages.append(q.backend)
    u = read(e)
    # 3 a second for 20 s, less the fraction still carried: every one is counted somewhere
    assert finished(u) + u.running + u.waiting == 60
    assert finished(u) > 0 and u.waiting > 10
    assert all(a is not None for a in ages)
    assert ages[-1] > 5.0  # the queue ages as it grows
    assert ages[-1] < 20.0
