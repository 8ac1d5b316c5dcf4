"""The exporter's /status document: its encoding, and its reuse for a large fleet."""

from __future__ import annotations

import json
import math

from llm_health.core.states import State
from llm_health.exporter.app import Reuse, _clean, _dumps


def test_dumps_is_compact_json_with_null_for_what_json_cannot_carry():
    doc = {"backends": [{"backend": "a", "state": State.HUNG, "rate": math.nan, "engines": [{"x": math.inf, "y": (1, -math.inf)}], "ok": 1.5}]}
    out = _dumps(doc)
    assert isinstance(out, bytes) and b" " not in out and b"NaN" not in out and b"Infinity" not in out
    assert json.loads(out) == {"backends": [{"backend": "a", "state": "hung", "rate": None, "engines": [{"x": None, "y": [1, None]}], "ok": 1.5}]}
    clean = {"a": [1, 2.5, None, "NaN"], "b": {"c": "x y"}}
    assert json.loads(_dumps(clean)) == clean == _clean(clean)  # a string "NaN" stays a string


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def builder(clock: Clock, cost: float):
    built: list[int] = []

    def build() -> bytes:
        clock.t += cost  # building takes `cost` seconds
        built.append(len(built))
        return f"doc {len(built)}".encode()

    return build, built


def test_a_cheap_document_is_built_every_time():
    clock = Clock()
    reuse = Reuse(factor=10.0, min_cost_s=0.02, clock=clock)
    build, built = builder(clock, 0.001)
    assert [reuse.get(build) for _ in range(3)] == [b"doc 1", b"doc 2", b"doc 3"]
    assert len(built) == 3 == reuse.builds


def test_a_costly_document_is_reused_for_factor_times_its_cost_then_rebuilt():
    clock = Clock()
    reuse = Reuse(factor=10.0, min_cost_s=0.02, clock=clock)
    build, built = builder(clock, 0.2)
    assert reuse.get(build) == b"doc 1"  # built from t=100.0 to 100.2
    clock.t = 101.9  # 1.9 s after it was asked for: still within 10 x 0.2 s
    assert reuse.get(build) == b"doc 1" and len(built) == 1
    clock.t = 102.1  # past 2 s: built again
    assert reuse.get(build) == b"doc 2" and len(built) == 2
    # however often it is asked for, building takes at most cost / (factor x cost) of the time
    asked = 0
    while clock.t < 200.0:
        reuse.get(build)
        asked += 1
        clock.t += 0.05
    assert asked > 1500 and reuse.builds <= 2 + (200.0 - 102.1) / 2.0 + 1
    reuse.clear()
    before = reuse.builds
    reuse.get(build)
    assert reuse.builds == before + 1  # a reload clears it
