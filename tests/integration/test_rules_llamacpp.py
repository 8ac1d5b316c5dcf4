"""The llama.cpp raw layer (rules/llamacpp.rules.yml): its fingerprint reads every
counter and gauge a live llama-server moves, and its rule tests start from values a live
llama-server answered. The rest of the rule pack: test_rules.py."""

from __future__ import annotations

import re

from tests.fixtures.paths import REAL_LLAMACPP, RULES
from tests.fixtures.stack import metric_names, payload_series
from tests.integration.test_rules import alerts, all_rules, llamacpp_payloads, load

# llama-server series the llama.cpp rules leave out on purpose: every /metrics read resets
# the two throughput gauges, and n_busy_slots_per_decode is a lifetime average.
LLAMACPP_NOT_PROGRESS = {"llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds", "llamacpp:n_busy_slots_per_decode"}


def test_llamacpp_fingerprint_reads_every_counter_and_gauge():
    """llama-server moves nothing but its counters and two gauges while it works: the
    progress count reads every one of them, the resets every counter, and nothing else."""
    live = payload_series(REAL_LLAMACPP / "busy.prom")
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", (REAL_LLAMACPP / "busy.prom").read_text(), re.M))
    rules = {r.get("record"): r["expr"] for r in all_rules() if "record" in r}
    progress = next(expr for name, expr in rules.items() if name.startswith("instance:llamacpp_progress_signals:"))
    resets = next(expr for name, expr in rules.items() if name.startswith("instance:llamacpp_counter_resets:"))
    assert metric_names(progress) == live - LLAMACPP_NOT_PROGRESS
    assert metric_names(resets) == {n for n in live - LLAMACPP_NOT_PROGRESS if types[n] == "counter"}
    hung = next(r for r in alerts() if r["alert"] == "LlamaCppServerHung")["expr"]
    assert "progress_signals" in hung and "counter_resets" in hung and "min_over_time(up{" in hung and " offset " in hung


def test_llamacpp_cases_come_from_the_live_payloads():
    """Each llama.cpp series in the unit tests starts from a value a live llama-server
    answered (tests/data/llamacpp/). What the alerts do on those cases:
    test_promtool_unit_tests[llamacpp.test.yml], and busy, slow, long prompt, idle,
    restarted and hung at every scrape interval: tests/integration/test_rule_intervals.py."""
    values: dict[str, set[float]] = {}
    for path in llamacpp_payloads():
        for name, value in re.findall(r"^(llamacpp:\S+) (\S+)$", path.read_text(), re.M):
            values.setdefault(name, set()).add(float(value))
    test_file = RULES / "tests" / "llamacpp.test.yml"
    checked = 0
    for case in load(test_file)["tests"]:
        for series in case["input_series"]:
            name = series["series"].split("{")[0]
            if name.startswith("llamacpp:"):
                first = float(re.match(r"[-0-9.e]+", series["values"]).group())
                assert first in values[name], f"{name} starts at {first}: in no live payload"
                checked += 1
    assert checked >= 50
