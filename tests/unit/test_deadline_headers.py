"""The deadline headers (gate.headers.read_deadline_ms): ours, Envoy's, and llm-d's router's
per-request TTL `x-llm-d-inference-ttl` (a Go duration: llm-d/llm-d-router,
pkg/epp/metadata/consts.go, parsed with Go's time.ParseDuration in
pkg/epp/requestcontrol/admission.go, a value that is not positive ignored). When several are
present the smallest deadline wins."""

from __future__ import annotations

import pytest

from llm_health.gate.headers import MAX_TIMEOUT_MS, BadRequest, go_duration_ms, read_deadline_ms

NOW = 1_800_000_000_000


@pytest.mark.parametrize(
    "raw,ms",
    [
        ("1500ms", 1500),
        ("2s", 2000),
        ("1m30s", 90_000),
        ("1h", 3_600_000),
        ("1.5s", 1500),
        (".5s", 500),
        ("2500us", 2),
        ("3000000ns", 3),
        ("0", 0),
        ("0s", 0),
        (" 2s ", 2000),
        ("168h", MAX_TIMEOUT_MS),
    ],
)
def test_go_durations(raw, ms):
    assert go_duration_ms("x-llm-d-inference-ttl", raw) == ms


@pytest.mark.parametrize("raw", ["", "2", "soon", "-1s", "+1s", "1d", "1e3ms", "2 s", "169h", "999999999999999999999h"])
def test_a_malformed_or_too_long_ttl_is_a_400_naming_the_header(raw):
    with pytest.raises(BadRequest, match="x-llm-d-inference-ttl"):
        read_deadline_ms({"x-llm-d-inference-ttl": raw}, NOW, 30_000)


def test_the_llm_d_ttl_alone_counts_from_now():
    assert read_deadline_ms({"x-llm-d-inference-ttl": "1500ms"}, NOW, 30_000) == NOW + 1500
    assert read_deadline_ms({"x-llm-d-inference-ttl": "1500ms"}, NOW, None) == NOW + 1500  # a deadline: no route default needed


def test_a_zero_ttl_is_no_ttl_as_llm_d_reads_it():
    assert read_deadline_ms({"x-llm-d-inference-ttl": "0s"}, NOW, 30_000) == NOW + 30_000
    assert read_deadline_ms({"x-llm-d-inference-ttl": "0s", "X-Request-Timeout-Ms": "5000"}, NOW, 30_000) == NOW + 5000


@pytest.mark.parametrize(
    "headers,deadline",
    [
        ({"X-Request-Deadline-Ms": str(NOW + 9000), "X-Request-Timeout-Ms": "5000"}, NOW + 5000),
        ({"X-Request-Deadline-Ms": str(NOW + 4000), "X-Request-Timeout-Ms": "5000"}, NOW + 4000),
        ({"X-Request-Timeout-Ms": "5000", "X-Envoy-Expected-Rq-Timeout-Ms": "3000"}, NOW + 3000),
        ({"X-Request-Timeout-Ms": "5000", "x-llm-d-inference-ttl": "60s"}, NOW + 5000),
        ({"X-Request-Timeout-Ms": "5000", "x-llm-d-inference-ttl": "2s"}, NOW + 2000),
        ({"X-Request-Deadline-Ms": str(NOW + 9000), "X-Envoy-Expected-Rq-Timeout-Ms": "8000", "x-llm-d-inference-ttl": "7s"}, NOW + 7000),
        ({"X-Request-Deadline-Ms": str(NOW - 1000), "x-llm-d-inference-ttl": "7s"}, NOW - 1000),  # already past: past
    ],
)
def test_the_smallest_deadline_wins(headers, deadline):
    assert read_deadline_ms(headers, NOW, 30_000) == deadline


def test_the_route_default_only_without_any_deadline_header():
    assert read_deadline_ms({}, NOW, 30_000) == NOW + 30_000
    with pytest.raises(BadRequest, match="x-llm-d-inference-ttl"):
        read_deadline_ms({}, NOW, None)


def test_every_header_present_is_checked_even_when_another_is_smaller():
    with pytest.raises(BadRequest, match="X-Request-Timeout-Ms"):
        read_deadline_ms({"x-llm-d-inference-ttl": "1s", "X-Request-Timeout-Ms": "soon"}, NOW, 30_000)
