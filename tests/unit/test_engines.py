"""Engine profiles against the real payloads in tests/data/real-world/metrics/."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_health.core import engines
from llm_health.core.exposition import parse
from tests.fixtures.paths import REAL_METRICS, real_payloads

EXPECTED_PROFILE = {
    "llamacpp-server-after-traffic-zh-doc.prom": "llamacpp",
    "sglang-0.3-llama31-8b-heavy-load-docs.prom": "sglang",
    "tgi-109req-idle-after-load-datadog-fixture.prom": "tgi",
    "triton-densenet-3req-datadog-fixture.prom": "triton",
    "vllm-late-v0engine-0.10-qwen3-06b-lora-38req-multiproc-commented-script.prom": "vllm_v0",
    "vllm-v0-0.5.x-opt125m-datadog-fixture.prom": "vllm_v0",
    "vllm-v0-0.7-qwen25coder15b-aibrix-docs-PARTIAL.prom": "vllm_v0",
    "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom": "vllm_v1",
}


def test_every_real_payload_has_an_expected_profile():
    assert {p.name for p in real_payloads()} == set(EXPECTED_PROFILE)


def _reference(text: str, profile: engines.Profile, name: str) -> dict:
    """Sum a sample by engine unit with prometheus_client, the slow reference parser.

    prometheus_client appends `_total` to counter samples written without it (TGI's
    `tgi_batch_inference_count`); Prometheus stores them as written, as we read them.
    """
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name or (fam.type == "counter" and s.name == name + "_total" and not name.endswith("_total")):
                key = (*tuple(s.labels.get(lab, "") for lab in profile.unit_labels), "", "")
                out[key[:2]] = out.get(key[:2], 0.0) + s.value
    return out


@pytest.mark.parametrize("path", real_payloads(), ids=lambda p: p.name)
def test_detect_and_read(path):
    text = path.read_text()
    profile = engines.detect(parse(text, engines.payload_names()))
    assert profile.name == EXPECTED_PROFILE[path.name]
    r = engines.read(text)
    assert r.engines, "at least one engine unit"
    # running and waiting agree with the reference parser, per unit
    for attr, names in (("running", profile.running), ("waiting", profile.waiting)):
        expected: dict = {}
        for name in names:
            for k, v in _reference(text, profile, name).items():
                expected[k] = expected.get(k, 0.0) + v
        for key, e in r.engines.items():
            assert getattr(e, attr) == expected.get(key, 0.0), (attr, key)
    # every counter of the fingerprint agrees, NaN where the engine does not expose it
    for key, e in r.engines.items():
        for name, value in zip(profile.counters, e.counters):
            ref = _reference(text, profile, name).get(key)
            assert (math.isnan(value) and ref is None) or value == ref, name


def test_real_values_spot_checks():
    sg = engines.read((REAL_METRICS / "sglang-0.3-llama31-8b-heavy-load-docs.prom").read_text())
    (e,) = sg.engines.values()
    assert (e.running, e.waiting) == (162.0, 2826.0)
    assert e.in_flight
    tgi = engines.read((REAL_METRICS / "tgi-109req-idle-after-load-datadog-fixture.prom").read_text())
    (e,) = tgi.engines.values()
    assert e.steps == 1509 + 16  # decode and prefill batches are both engine steps
    assert not e.in_flight
    v1 = engines.read((REAL_METRICS / "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom").read_text())
    assert list(v1.engines) == [("Qwen/Qwen1.5-0.5B-Chat", "0")]
    assert v1.start_time == pytest.approx(1.76243836732e09)
    late = engines.read((REAL_METRICS / "vllm-late-v0engine-0.10-qwen3-06b-lora-38req-multiproc-commented-script.prom").read_text())
    assert late.start_time is None  # multiprocess mode
    assert late.engines[("Qwen/Qwen3-0.6B", "")].steps == 1325.0
    triton = engines.read((REAL_METRICS / "triton-densenet-3req-datadog-fixture.prom").read_text())
    assert triton.engines[("densenet_onnx", "1")].counters[1] == 3.0


def test_data_parallel_engines_and_models_kept_apart():
    text = (REAL_METRICS / "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom").read_text()
    # a second data-parallel rank and a second model, built from the real payload's lines
    extra = []
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:iteration_tokens_total_count{")):
            extra.append(line.replace('engine="0"', 'engine="1"').replace(" 0.0", " 7.0"))
            extra.append(line.replace('model_name="Qwen/Qwen1.5-0.5B-Chat"', 'model_name="other"').replace(" 0.0", " 3.0"))
    r = engines.read(text + "\n".join(extra) + "\n")
    assert set(r.engines) == {("Qwen/Qwen1.5-0.5B-Chat", "0"), ("Qwen/Qwen1.5-0.5B-Chat", "1"), ("other", "0")}
    assert r.engines[("Qwen/Qwen1.5-0.5B-Chat", "1")].running == 7.0
    assert r.engines[("other", "0")].steps == 3.0
    assert r.engines[("Qwen/Qwen1.5-0.5B-Chat", "0")].running == 0.0


def test_unknown_payload():
    with pytest.raises(engines.UnknownEngine, match="no known engine series"):
        engines.read("# HELP up x\n# TYPE up gauge\nup 1\n")


def test_sleep_state_gauge():
    text = (
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
        'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0\n'
        'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 1.0\n'
    )
    (e,) = engines.read(text).engines.values()
    assert e.sleeping


@pytest.mark.parametrize("path", real_payloads(), ids=lambda p: p.name)
def test_one_parse_reads_every_profile_as_its_own_names_would(path):
    """The payload is parsed once for every profile's names; the reading is the one the
    profile's own names give."""
    text = path.read_text()
    profile = engines.BY_NAME[EXPECTED_PROFILE[path.name]]
    own = parse(text, profile.wanted | {profile.marker, "vllm:num_requests_running", "vllm:iteration_tokens_total_count"})
    assert engines.read(text) == engines.reduce(own)
