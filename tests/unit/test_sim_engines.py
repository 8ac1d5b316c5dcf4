"""The simulated SGLang, TGI and Triton servers (sim.engines): each payload has the format
of the engine's captured real payload (tests/data/real-world/metrics/: the same families,
types, HELP text and label names), reduces through the engine's profile to the same kind
of Reading as the captured one, and gets the verdicts a real engine would: a frozen
simulation hung, a progressing one busy, a restarted one restarted."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_health.core import engines
from llm_health.core.engines import Reading
from llm_health.core.health import Observation, Settings, decide
from llm_health.core.states import State
from llm_health.sim import servers as sim
from llm_health.sim.engines import base, sglang, tgi
from tests.fixtures.paths import REAL_METRICS, published_only

S = Settings(hung_after_seconds=20, probe_interval=60)
CAPTURED = {name: path.name for name, path in published_only().items()}  # the engines known by a published payload alone
KINDS = sorted(CAPTURED)


def captured(kind: str) -> str:
    return (REAL_METRICS / CAPTURED[kind]).read_text()


def server(kind: str, scenario=sim.saturated, units: int = 1) -> sim.SimServer:
    s = sim.SimServer("x", kind=kind, model="sim-model", engines=units)
    scenario(s)
    s.advance(30)
    s.engines[0].finish(2)
    return s


def shape(text: str) -> dict[str, tuple[str, str, list[tuple[str, ...]]]]:
    """family -> (type, help, the sorted label-name sets of its samples, `le` and `quantile` aside)"""
    out = {}
    for fam in text_string_to_metric_families(text):
        labelsets = sorted({tuple(sorted(set(s.labels) - {"le", "quantile"})) for s in fam.samples})
        out[fam.name] = (fam.type, fam.documentation, labelsets)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_simulated_payload_has_the_captured_format(kind):
    assert shape(server(kind).payload()) == shape(captured(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_samples_are_written_as_the_engine_writes_them(kind):
    """Line for line: which sample lines each family has, in which order, with which
    label names in which order, where the blank lines are (the values and the labels'
    values aside). The captured Triton payload has 8 models: so has its simulation."""

    def skeleton(text: str) -> list[str]:
        lines = []
        for line in text.splitlines():
            if line.startswith("#") or not line:
                lines.append(line)
                continue
            name, _, rest = line.partition("{")
            if not rest:
                name = line.split(" ")[0]
            names = [pair.split("=")[0] for pair in rest.rsplit("}", 1)[0].split('",') if pair] if rest else []
            lines.append(f"{name}{names}")
        return lines

    units = len(engines.read(captured(kind)).engines)
    assert skeleton(server(kind, units=units).payload()) == skeleton(captured(kind))


def test_bucket_bounds_are_the_captured_ones():
    for kind, families in (
        ("sglang", ("sglang:func_latency_seconds", "sglang:time_to_first_token_seconds")),
        ("tgi", ("tgi_request_duration", "tgi_request_input_length", "tgi_batch_next_size")),
    ):
        real = {f.name: f for f in text_string_to_metric_families(captured(kind))}
        ours = {f.name: f for f in text_string_to_metric_families(server(kind).payload())}
        for name in families:
            bounds = [[s.labels["le"] for s in fam.samples if s.name.endswith("_bucket")] for fam in (real[name], ours[name])]
            assert bounds[0] == bounds[1], name
    assert sglang.BOUNDS["queue_seconds"][1] == 0.07500000000000001 and tgi.BOUNDS["seconds"][-1] == 145.61096060497135


def _kind_of(r: Reading) -> tuple:
    """What a Reading is made of, the values aside: its profile, which parts of the unit
    key are set, which counters and gauges are known, whether steps and tokens are."""
    units = {tuple(bool(part) for part in key) for key in r.engines}
    e = next(iter(r.engines.values()))
    known = tuple(not math.isnan(v) for v in e.counters + e.gauges)
    return (r.profile, units, known, e.steps is None, e.generation_tokens is None, r.start_time is None)


@pytest.mark.parametrize("kind", KINDS)
def test_the_simulated_payload_reads_as_the_captured_one(kind):
    ours, real = engines.read(server(kind).payload()), engines.read(captured(kind))
    assert ours.profile == kind
    assert _kind_of(ours) == _kind_of(real)
    e = next(iter(ours.engines.values()))
    assert e.in_flight and e.running + e.waiting == 15  # saturated: 12 running, 3 waiting


@pytest.mark.parametrize("kind", KINDS)
def test_a_frozen_simulation_is_hung_and_a_progressing_one_busy(kind):
    moving, frozen = server(kind), server(kind)
    sim.hang(frozen)
    mem_moving = mem_frozen = None
    moving_states, frozen_states = [], []
    for t in (0, 10, 20, 30):
        for s, states, prev in ((moving, moving_states, mem_moving), (frozen, frozen_states, mem_frozen)):
            s.advance(10)
            v = decide(prev, Observation(now=t, reading=engines.read(s.payload())), S)
            states.append(v.state)
            if s is moving:
                mem_moving = v.memory
            else:
                mem_frozen = v.memory
    assert moving_states == [State.UNKNOWN, State.BUSY, State.BUSY, State.BUSY]
    assert frozen_states == [State.UNKNOWN, State.STALLED, State.HUNG, State.HUNG]
    frozen.restart()
    sim.saturated(frozen)
    v = decide(mem_frozen, Observation(now=40, reading=engines.read(frozen.payload())), S)
    assert v.restarted and v.state == State.RESTARTED


@pytest.mark.parametrize("kind", KINDS)
def test_a_long_prefill_moves(kind):
    """One long prompt with nothing else decoding: prefill passes are progress."""
    s = server(kind, sim.long_prefill)
    first = decide(None, Observation(now=0, reading=engines.read(s.payload())), S)
    s.advance(10)
    assert decide(first.memory, Observation(now=10, reading=engines.read(s.payload())), S).state == State.BUSY


def test_numbers_are_written_as_rust_and_prometheus_cpp_write_them():
    assert [base.plain(v) for v in (109, 0.0, 1.5e-05, 32.09, 145.61096060497135, 16106127360)] == [
        "109",
        "0",
        "0.000015",
        "32.09",
        "145.61096060497135",
        "16106127360",
    ]


def test_triton_serves_one_unit_per_model():
    s = sim.SimServer("x", kind="triton", engines=3, model="m")
    assert sorted(engines.read(s.payload()).engines) == [("m", "1"), ("m_1", "1"), ("m_2", "1")]
