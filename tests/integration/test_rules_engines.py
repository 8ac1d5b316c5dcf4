"""The engines' raw layers: an engine's rules section is its template and its config
(the generator names no engine); the llama.cpp layer's fingerprint reads every counter
and gauge a live llama-server moves, and its rule tests start from values a live
llama-server answered. The rest of the rule pack: test_rules.py."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.fixtures.paths import REAL_LLAMACPP, RULES
from tests.fixtures.stack import metric_names, payload_series
from tests.integration.test_rules import alerts, all_rules, generate, llamacpp_payloads, load

# llama-server series the llama.cpp rules leave out on purpose: every /metrics read resets
# the two throughput gauges, and n_busy_slots_per_decode is a lifetime average.
LLAMACPP_NOT_PROGRESS = {"llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds", "llamacpp:n_busy_slots_per_decode"}


TICKER_TEMPLATE = """groups:
  - name: ticker.raw
    rules:
      - record: instance:ticker_passes:changes
        expr: changes(ticker_passes_total{${selectors.ticker}}[${ticker.progress_window}])
      - record: instance:ticker_passes:rate
        expr: rate(ticker_passes_total{${selectors.ticker}}[${ticker.rate_window}])
"""


def test_an_engine_section_is_its_template_and_its_config(tmp_path, monkeypatch):
    """An engine's rules section is its template and its values in the config: the
    generator, which names no engine, derives its windows from its scrape interval."""
    for template in generate.TEMPLATES.glob("*.rules.yml.tmpl"):
        (tmp_path / template.name).write_text(template.read_text())
    (tmp_path / "ticker.rules.yml.tmpl").write_text(TICKER_TEMPLATE)
    monkeypatch.setattr(generate, "TEMPLATES", tmp_path)
    raw = yaml.safe_load((RULES / "config.yaml").read_text())
    raw["scrape_intervals"]["ticker"], raw["selectors"]["ticker"] = "60s", 'job="ticker"'
    raw["ticker"] = {"progress_window": "45s", "rate_window": "1m"}
    config = generate.derive(yaml.safe_load(yaml.safe_dump(raw, sort_keys=False)))
    assert generate.engine_sections(config) == ["vllm", "llamacpp", "ticker"]
    assert (config["ticker"]["progress_window"], config["ticker"]["rate_window"], config["ticker"]["evidence_samples"]) == ("3m", "4m", 2)
    rendered = generate.render_all(config)["ticker.rules.yml"]
    assert "For these scrape intervals: ticker 60s.\n" in rendered and "[3m]" in rendered and "[4m]" in rendered
    del raw["ticker"]["rate_window"]
    with pytest.raises(SystemExit, match=r"`ticker:`.*needs rate_window"):
        generate.derive(raw)


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
