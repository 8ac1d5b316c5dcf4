"""A scheduler that admits nothing (SGLang issue #24140: `num_queue_reqs` high while
`num_running_reqs` is 0): its queue keeps growing as clients send, and arrivals are no
progress. Played back on the captured SGLang payload
(tests/data/real-world/metrics/sglang-0.3-llama31-8b-heavy-load-docs.prom) with its counts
edited per round: stalled, then hung, however the queue grows; a queue that drains into
running work, or counters that move, stay busy.
"""

from __future__ import annotations

import re
from pathlib import Path

from llm_health.core.health import Settings, Verdict
from llm_health.core.states import State
from tests.fixtures.playback import play, set_samples

SGLANG = (Path(__file__).parents[1] / "data" / "real-world" / "metrics" / "sglang-0.3-llama31-8b-heavy-load-docs.prom").read_text()
SETTINGS = Settings(hung_after_seconds=60, hung_rounds=2)
INTERVAL = 30.0


def payload(running: float, queued: float, generated: float = 7.557572e06, used: float = 123859.0) -> str:
    values = {
        "sglang:num_running_reqs": running,
        "sglang:num_queue_reqs": queued,
        "sglang:generation_tokens_total": generated,
        "sglang:num_used_tokens": used,
    }
    return set_samples(SGLANG, {rf"{re.escape(name)}\{{[^\n]*\}}": value for name, value in values.items()})


def rounds(*texts: str) -> list[Verdict]:
    return play(list(texts), SETTINGS, INTERVAL)


def test_a_growing_queue_with_nothing_running_is_stalled_then_hung() -> None:
    # The queue grows by 100 a round (clients keep sending) and the KV gauge moves with it; nothing runs, no token comes.
    states = [v.state for v in rounds(*(payload(0, 2826 + 100 * i, used=1000 + 7 * i) for i in range(4)))]
    assert states == [State.UNKNOWN, State.STALLED, State.HUNG, State.HUNG], states
    last = rounds(*(payload(0, 2826 + 100 * i) for i in range(3)))[-1]
    assert "(waiting with nothing running)" in last.reason, last.reason


def test_a_queue_that_drains_into_running_work_or_moving_counters_is_busy() -> None:
    # The scheduler admits: running rises from 0 as the queue falls.
    admitted = rounds(payload(0, 50), payload(8, 42), payload(16, 34))
    assert [v.state for v in admitted[1:]] == [State.BUSY, State.BUSY], admitted
    # Nothing running at the reads, but tokens came between them (short requests finish in a round).
    quick = rounds(payload(0, 5, generated=1000), payload(0, 6, generated=1500), payload(0, 4, generated=2100))
    assert [v.state for v in quick[1:]] == [State.BUSY, State.BUSY], quick
