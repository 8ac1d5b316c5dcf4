"""The evidence an alert carries (core.evidence) and the restarter's quick confirmation
(core.confirm): pure functions on real payloads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from llm_health.core import engines
from llm_health.core.confirm import ConfirmRead, against_evidence, digests, idle
from llm_health.core.evidence import BadEvidence, Evidence, parse_evidence, progress_digest
from llm_health.core.webhook import Malformed, parse_webhook
from tests.fixtures.paths import REAL_METRICS
from tests.fixtures.webhooks import webhook_2447

PAYLOADS = sorted(p for p in REAL_METRICS.glob("vllm*") if p.is_file())


def reading(text: str) -> engines.Reading:
    return engines.read(text)


@pytest.mark.parametrize("path", PAYLOADS, ids=lambda p: p.name)
def test_digest_is_48_bits_and_stable(path):
    r = reading(path.read_text())
    for e in r.engines.values():
        d = progress_digest(r.profile, r.start_time, e)
        assert 0 <= d < 2**48 and float(d) == d  # exact as a Prometheus sample
        assert d == progress_digest(r.profile, r.start_time, e)
        assert f"{float(d):.0f}" == str(d)  # what printf "%.0f" writes in the alert


def test_digest_changes_with_every_fingerprint_series_the_start_time_and_sleep():
    r = reading(PAYLOADS[0].read_text())
    e = next(iter(r.engines.values()))
    base = progress_digest(r.profile, r.start_time, e)
    changed = set()
    for i in range(len(e.counters)):
        counters = list(e.counters)
        counters[i] = (counters[i] if counters[i] == counters[i] else 0.0) + 1
        changed.add(progress_digest(r.profile, r.start_time, replace(e, counters=tuple(counters))))
    for i in range(len(e.gauges)):
        gauges = list(e.gauges)
        gauges[i] = (gauges[i] if gauges[i] == gauges[i] else 0.0) + 0.001
        changed.add(progress_digest(r.profile, r.start_time, replace(e, gauges=tuple(gauges))))
    changed.add(progress_digest(r.profile, (r.start_time or 0) + 1, e))
    changed.add(progress_digest(r.profile, r.start_time, replace(e, sleeping=not e.sleeping)))
    changed.add(progress_digest(r.profile, r.start_time, replace(e, engine=e.engine + "1")))
    assert base not in changed and len(changed) == len(e.counters) + len(e.gauges) + 3


@pytest.mark.parametrize(
    ("text", "digests"),
    [("12 34", {12, 34}), ("12,34 ", {12, 34}), (" 281474976710655 ", {2**48 - 1}), ("none", set()), ("7 7", {7})],
)
def test_parse_evidence(text, digests):
    assert parse_evidence(text) == Evidence(frozenset(digests))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("12 banana", "'banana' is not"),
        ("281474976710656", "not a 48-bit"),
        ("-5", "not a 48-bit"),
        ("1e5", "not a 48-bit"),
        (" ".join(["1"] * 257), "more than 256"),
        ("1 " * 5000, "characters"),
        ("none 5", "'none' is not"),
    ],
)
def test_bad_evidence_is_named(text, why):
    with pytest.raises(BadEvidence, match=why):
        parse_evidence(text)


def _hung_payload() -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 4.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.31\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.12\n'
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="m"} 30100.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 900.0\n'
        "process_start_time_seconds 1.7e9\n"
    )


def test_against_evidence():
    r = reading(_hung_payload())
    ds = digests(r)
    hung0 = next(d for d, e in ds.items() if e.engine == "0")
    ev = Evidence(frozenset({hung0}))
    assert against_evidence(ev, ConfirmRead(r)) is None
    # engine 1 moving does not matter: only the engines the alert proved hung
    moved1 = reading(_hung_payload().replace("900.0", "901.0"))
    assert against_evidence(ev, ConfirmRead(moved1)) is None
    moved0 = reading(_hung_payload().replace("30100.0", "30101.0"))
    assert "changed since" in against_evidence(ev, ConfirmRead(moved0))
    restarted = reading(_hung_payload().replace("1.7e9", "1.7000001e9"))
    assert "changed since" in against_evidence(ev, ConfirmRead(restarted))
    assert "asleep" in against_evidence(ev, ConfirmRead(r, sleeping=True))
    assert "paused" in against_evidence(ev, ConfirmRead(r, paused=True))
    assert against_evidence(ev, ConfirmRead(None, "timeout after 30s")) == "no usable /metrics (timeout after 30s)"


def test_evidence_of_an_engine_with_nothing_in_flight_is_not_a_hang():
    idle_payload = _hung_payload().replace("} 4.0", "} 0.0").replace("} 2.0", "} 0.0")
    r = reading(idle_payload)
    ev = Evidence(frozenset(digests(r)))
    assert "nothing in flight" in against_evidence(ev, ConfirmRead(r))
    assert idle(ConfirmRead(r)) and not idle(ConfirmRead(reading(_hung_payload()))) and not idle(ConfirmRead(None, "x"))
    unknown = reading(
        idle_payload.replace('vllm:num_requests_running{engine="0",model_name="m"} 0.0', 'vllm:num_requests_running{engine="0",model_name="m"} NaN')
    )
    assert not idle(ConfirmRead(unknown))  # a count that is no evidence is never idle


def test_webhook_annotations_are_kept_and_bounded():
    body = webhook_2447(backend="gpu0")
    body["alerts"][0]["annotations"] = {"evidence": "12 34", "summary": "x"}
    (alert,) = parse_webhook(json.dumps(body)).alerts
    assert alert.annotations == {"evidence": "12 34", "summary": "x"}
    body["alerts"][0]["annotations"] = {"evidence": 12}
    with pytest.raises(Malformed, match=r"alerts\[0\].annotations"):
        parse_webhook(json.dumps(body))
    body["alerts"][0]["annotations"] = {"evidence": "1" * 70000}
    with pytest.raises(Malformed, match="more than"):
        parse_webhook(json.dumps(body))
    del body["alerts"][0]["annotations"]
    assert parse_webhook(json.dumps(body)).alerts[0].annotations == {}
