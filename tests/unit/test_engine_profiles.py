"""Every registered engine through its profile's fields: what the product does with an
engine follows the fields (docs/architecture.md, "Adding an engine"), never its name, and
the captured-only engines (SGLang, TGI, Triton) get verdicts on their captured payloads."""

from __future__ import annotations

import dataclasses
import math

import pytest

from llm_health.core import engines, forwarding, kinds, queue_age
from llm_health.core.engines import Profile, Reading
from llm_health.core.health import Observation, Settings, decide
from llm_health.core.states import State
from tests.fixtures.paths import REAL_METRICS, published_only

S = Settings(hung_after_seconds=20, probe_interval=60)
PROFILES = engines.PROFILES
ids = [p.name for p in PROFILES]


@pytest.mark.parametrize("profile", PROFILES, ids=ids)
def test_the_fields_hold_together(profile: Profile):
    assert engines.BY_NAME[profile.name] is profile
    assert profile.title and profile.prefix and all(n.startswith(profile.prefix) for n in (*profile.running, *profile.waiting, *profile.counters))
    unit = engines.EngineReading("m", "0", 1.0, 2.0, None, None, tuple(float(i) for i in range(len(profile.counters))), ())
    if profile.finished is not None:
        assert profile.finished in profile.counters  # the queue age reads it from the counters
        assert queue_age.counts(profile.name, unit) == (float(list(profile.counters).index(profile.finished)), 1.0, 2.0)
    else:
        assert queue_age.counts(profile.name, unit) is None
    for path in (profile.sleep_path, profile.pause_path, profile.health_path):
        assert path is None or path.startswith("/")
    if profile.start_header:
        assert engines.BY_START_HEADER[profile.start_header.lower()] is profile
    # its routes are in every door's default allowlist, its admin paths never forwarded
    assert set(profile.routes) <= set(forwarding.DEFAULT_ALLOW)
    assert set(profile.never) <= set(forwarding.NEVER)
    for path in profile.never:
        assert not forwarding.check("POST", path, forwarding.DEFAULT_RULES).forward, path


def _first_unit_reading(profile: Profile, running: float, waiting: float) -> Reading:
    counters = tuple(1.0 for _ in profile.counters)
    gauges = tuple(0.5 for _ in profile.gauges)
    e = engines.EngineReading("m", "0", running, waiting, 1.0, 1.0, counters, gauges)
    return Reading(profile.name, 1000.0, {e.key: e})


@pytest.mark.parametrize("profile", PROFILES, ids=ids)
def test_a_timed_out_metrics_read_means_what_the_profile_says(profile: Profile):
    """`metrics_on_loop`: a timeout while the health endpoint answers is a failed probe
    (unresponsive, then hung); otherwise a slow read is load (unknown)."""
    first = decide(None, Observation(now=0, reading=_first_unit_reading(profile, 0, 0)), S)
    mem, states = first.memory, []
    for t in (10, 20, 30):
        v = decide(mem, Observation(now=t, metrics_error="timeout after 5s", metrics_timed_out=True, models_ok=True), S)
        mem = v.memory
        states.append(v.state)
    if profile.metrics_on_loop:
        assert states == [State.UNRESPONSIVE, State.HUNG, State.HUNG]
        assert profile.title in v.reason and profile.health_path in v.reason
    else:
        assert states == [State.UNKNOWN] * 3


CAPTURED = {name: path.name for name, path in published_only().items()}  # the engines known by a published payload alone


def _moved(r: Reading) -> Reading:
    """The same payload a step later: every known counter one higher."""
    out = {k: dataclasses.replace(e, counters=tuple(c + 1 if not math.isnan(c) else c for c in e.counters)) for k, e in r.engines.items()}
    return dataclasses.replace(r, engines=out)


def _busy(r: Reading) -> Reading:
    """The same payload with work in flight in every unit (a waiting request)."""
    return dataclasses.replace(r, engines={k: dataclasses.replace(e, waiting=max(e.waiting, 1.0)) for k, e in r.engines.items()})


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_captured_engines_get_verdicts_through_their_profile(name):
    """On its captured payload: still with work in flight is stalled then hung; moving is
    busy; counters lower than before are a restart."""
    r = engines.read((REAL_METRICS / CAPTURED[name]).read_text())
    assert r.profile == name
    busy = _busy(r)
    states, mem = [], None
    for t in (0, 10, 20, 30):
        v = decide(mem, Observation(now=t, reading=busy), S)
        mem = v.memory
        states.append(v.state)
    assert states == [State.UNKNOWN, State.STALLED, State.HUNG, State.HUNG]
    v = decide(mem, Observation(now=40, reading=_moved(busy)), S)
    assert v.state == State.BUSY
    v = decide(v.memory, Observation(now=50, reading=busy), S)  # counters fell: a new process
    assert v.restarted and v.state == State.RESTARTED


@pytest.mark.parametrize("name", ["tgi", "triton"])
def test_a_queue_counted_in_front_of_a_hung_engine_is_not_progress(name):
    """TGI's router and Triton's core count requests as they arrive, whatever the model
    does: a queue that grows while nothing else moves is a hung engine still being sent
    work, not progress (a load balancer keeps sending to it)."""
    text = (REAL_METRICS / CAPTURED[name]).read_text()
    profile = engines.BY_NAME[name]
    states, mem = [], None
    for t, queued in ((0, 1), (10, 3), (20, 6), (30, 9)):
        grown = "\n".join(f"{line.rsplit(' ', 1)[0]} {queued}" if line.startswith(profile.waiting) else line for line in text.splitlines())
        v = decide(mem, Observation(now=t, reading=engines.read(grown + "\n")), S)
        mem = v.memory
        states.append(v.state)
    assert states == [State.UNKNOWN, State.STALLED, State.HUNG, State.HUNG]


@pytest.mark.parametrize("spelling,kind", [("engine", "engine"), ("vllm", "engine"), ("proxy", "proxy")])
def test_kinds(spelling, kind):
    assert kinds.normalize(spelling) == kind


def test_a_kind_that_is_none_is_refused_by_name():
    with pytest.raises(ValueError, match=r"kind must be one of engine, proxy \(vllm: engine\), not 'gpu'"):
        kinds.normalize("gpu")
