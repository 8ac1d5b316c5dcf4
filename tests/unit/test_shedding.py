"""Shedding: an engine that refuses requests itself (vLLM 0.32's `--max-num-queued-reqs` and
`--max-num-queued-tokens`: 503, counted in `vllm:admission_rejections_total{model_name,reason}`,
with no data-parallel `engine` label). Played back as tests/data/vllm-real/busy.prom (a real
vLLM's `/metrics` with 4 running and 4 waiting) with its refusal counters edited per round,
through the parser, the state machine and the exporter's series and status: shedding is
said, counted and marked, and the state stays what the engine's work says.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from llm_health.core.engines import read
from llm_health.core.health import Settings, Verdict
from llm_health.core.states import State
from llm_health.exporter import fast_exposition, page
from tests.fixtures.playback import play, set_samples

BUSY = (Path(__file__).parents[1] / "data" / "vllm-real" / "busy.prom").read_text()
SETTINGS = Settings()


def payload(t: float, reqs: float, tokens: float = 0.0, start: float | None = None) -> str:
    """busy.prom with its steps moving (busy), its refusal counters at these values."""
    edits = {
        r'vllm:admission_rejections_total\{model_name="tiny-llama",reason="max_num_queued_reqs"\}': reqs,
        r'vllm:admission_rejections_total\{model_name="tiny-llama",reason="max_num_queued_tokens"\}': tokens,
        r"vllm:iteration_tokens_total_count\{[^\n]*\}": 1000 + t,
        r"vllm:generation_tokens_total\{[^\n]*\}": 100 + 10 * t,
    }
    if start is not None:
        edits[r"process_start_time_seconds"] = start
    return set_samples(BUSY, edits)


def rounds(*texts: str) -> list[Verdict]:
    return play(list(texts), SETTINGS, 10.0)


def test_the_refusal_counter_is_read_per_reason_over_the_backend() -> None:
    reading = read(payload(0, reqs=7, tokens=2))
    assert reading.refusals == {"max_num_queued_reqs": 7.0, "max_num_queued_tokens": 2.0}
    assert set(reading.engines) == {("tiny-llama", "0")}  # no unit of its own: the counter has no engine label


def test_an_unknown_reason_is_other_and_a_value_that_is_no_count_is_left_out() -> None:
    text = payload(0, reqs=float("nan"), tokens=1)
    text += 'vllm:admission_rejections_total{model_name="tiny-llama",reason="a_new_cap"} 3.0\n'
    assert read(text).refusals == {"max_num_queued_tokens": 1.0, "other": 3.0}


def test_refusals_since_the_last_round_are_shedding_and_the_state_stays_busy() -> None:
    first, quiet, shed, more = rounds(payload(0, 0), payload(10, 0), payload(20, 5), payload(30, 9, tokens=2))
    assert first.state is State.UNKNOWN and not first.shedding and first.refused == {}  # a first reading
    assert quiet.state is State.BUSY and not quiet.shedding
    assert shed.state is State.BUSY and shed.refused == {"max_num_queued_reqs": 5.0}
    assert "shedding: the engine refused 5 max_num_queued_reqs since the last round" in shed.reason
    assert more.state is State.BUSY and more.refused == {"max_num_queued_reqs": 4.0, "max_num_queued_tokens": 2.0}


def test_a_refusal_in_a_round_whose_gauges_read_empty_is_busy_and_never_probed() -> None:
    # Live (vLLM 0.32, a throttled engine core): the front end counts its 503s at once, and
    # the running and waiting gauges come from the scheduler's last step, a round behind.
    def empty(t: float, reqs: float) -> str:
        gauges = (r"vllm:num_requests_running\{[^\n]*\}", r"vllm:num_requests_waiting\{[^\n]*\}", r'vllm:num_requests_waiting_by_reason\{[^\n]*"capacity"\}')
        return set_samples(payload(t, reqs), dict.fromkeys(gauges, 0.0))

    _, idle, shed, after = rounds(empty(0, 0), empty(10, 0), empty(20, 7), empty(30, 7))
    assert idle.state is State.IDLE and idle.probe_wanted
    assert shed.state is State.BUSY and not shed.probe_wanted and shed.memory.last_state is State.BUSY
    assert shed.reason == (
        "busy: nothing running or waiting in its gauges, but its queue was full this round; "
        "shedding: the engine refused 7 max_num_queued_reqs since the last round"
    )
    assert after.state is State.IDLE and not after.shedding  # no refusal this round: its gauges again


def test_a_first_read_and_a_restart_are_a_baseline_not_shedding() -> None:
    first, restarted, after = rounds(payload(0, 50), payload(10, 3, start=1.9e9), payload(20, 4, start=1.9e9))
    assert not first.shedding  # refusals before the exporter's first read are not this round's
    assert restarted.restarted and not restarted.shedding  # counters of two processes are never compared
    assert after.refused == {"max_num_queued_reqs": 1.0}


def test_an_engine_without_the_counter_has_no_refusals() -> None:
    text = re.sub(r"^vllm:admission_rejections_total\{.*\n", "", BUSY, flags=re.M)
    assert read(text).refusals is None
    v = rounds(text, text)[-1]
    assert v.refused == {} and v.memory.refusals is None


def series(refused_total: dict[str, float], verdict: Verdict | None) -> dict[tuple[str, tuple[str, ...]], float]:
    slot = SimpleNamespace(
        backend=SimpleNamespace(name="gpu0", kind="engine"),
        verdict=verdict,
        monitor=SimpleNamespace(
            refused_total=refused_total,
            evidence_reads={},
            stats=SimpleNamespace(probes={}, metrics=None, profile="vllm_v1", seconds=0.0),
            memory=None,
            last_probe=None,
            queue_ages=SimpleNamespace(backend=None, units={}),
        ),
        errors={},
        readiness=SimpleNamespace(not_ready_total=0),
    )
    return {
        (fast_exposition.FAMILIES[f].name, labels): value
        for f, labels, value in fast_exposition.samples(slot)
        if f in (fast_exposition.REFUSALS, fast_exposition.SHEDDING)
    }


def test_the_series_count_every_refusal_and_mark_a_shedding_round() -> None:
    _, shed = rounds(payload(0, 0), payload(10, 5))
    s = series({"max_num_queued_reqs": 5.0, "max_num_queued_tokens": 0.0}, shed)
    assert s == {
        ("llm_backend_engine_refusals", ("gpu0", "max_num_queued_reqs")): 5.0,
        ("llm_backend_engine_refusals", ("gpu0", "max_num_queued_tokens")): 0.0,
        ("llm_backend_shedding", ("gpu0",)): 1.0,
    }
    assert series({}, shed) == {}  # an engine that counts no refusals has neither series


def test_the_status_page_marks_a_shedding_backend_beside_its_state() -> None:
    shedding = {"backend": "gpu0", "state": "busy", "reason": "r", "shedding": True, "refused": {"max_num_queued_reqs": 5.0}}
    quiet = {"backend": "gpu1", "state": "busy", "reason": "r", "shedding": False, "refused": {}}
    html = page.render(page.PageData(backends=[shedding, quiet], counts={"busy": 2}, now=0.0, refresh_s=5.0))
    row0 = html[html.index('data-backend="gpu0"') :].split("</tr>", 1)[0]
    row1 = html[html.index('data-backend="gpu1"') :].split("</tr>", 1)[0]
    assert 'class="st s-busy">busy</span> <span class="shed" title="the engine refused 5 max_num_queued_reqs since the previous round">shedding</span>' in row0
    assert "shedding" not in row1
