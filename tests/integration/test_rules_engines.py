"""The engines' raw layers: an engine's rules section is its template and its config
(the generator names no engine); the llama.cpp layer's fingerprint reads every counter
and gauge a live llama-server moves, and its rule tests start from values a live
llama-server answered; the SGLang, TGI and Triton layers' read every series of their
captured payloads that moves with progress, and their tests start from those payloads.
The rest of the rule pack: test_rules.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from llm_health.core import engines
from tests.fixtures.paths import REAL_LLAMACPP, REAL_METRICS, RULES
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
    assert generate.engine_sections(config) == ["vllm", "llamacpp", "sglang", "tgi", "triton", "ticker"]
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


# --- the engines checked against captured payloads alone: SGLang, TGI, Triton ----------

# Series of the captured payloads that the engines' hung rules leave out of their progress
# count, each with why: they move when a request arrives, hung or not.
NOT_PROGRESS = {
    "sglang": {"sglang:func_latency_seconds": "the tokenizer times each request as it arrives"},
    "tgi": {
        "tgi_queue_size": "the router's queue task appends arrivals",
        "tgi_request_count": "arrivals",
        "tgi_request_failure": "validation and overload refusals, at arrival",
    },
    "triton": {
        "nv_inference_pending_request_count": "each arrival adds one",
        "nv_inference_request_failure": "requests refused at arrival, timed out in the queue or cancelled",
    },
}
CAPTURED = sorted(NOT_PROGRESS)


def captured_payload(name: str) -> Path:
    files = sorted(REAL_METRICS.glob(f"{name}-*.prom"))
    assert len(files) == 1, f"one captured {name} payload expected in {REAL_METRICS}: {files}"
    return files[0]


def family(name: str, types: dict[str, str]) -> str:
    """The metric family a sample name belongs to (a histogram's _count and _sum its own)."""
    for suffix in ("_count", "_sum", "_bucket"):
        if name.endswith(suffix) and types.get(name.removesuffix(suffix)) in ("histogram", "summary"):
            return name.removesuffix(suffix)
    return name


def reads(expr: str, records: dict[str, str]) -> set[str]:
    """The raw series an expression reads, through the recording rules it reads."""
    out: set[str] = set()
    for name in metric_names(expr):
        out |= reads(records[name], records) if name in records else {name}
    return out


@pytest.mark.parametrize("name", CAPTURED)
def test_captured_engine_fingerprint_reads_every_series_that_moves_with_progress(name):
    """The progress count reads every counter and gauge of the engine's captured payload
    (of its prefix: Triton's server-wide GPU, CPU and cache series are no model's) but
    those that move on arrival (NOT_PROGRESS), and every counter its profile names that
    the payload has; the resets read every counter it reads; the hung alert reads the
    profile's running and waiting series as the work in flight."""
    profile = next(p for p in engines.PROFILES if p.name == name)
    path = captured_payload(name)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", path.read_text(), re.M))
    present = payload_series(path)
    records = {r["record"]: r["expr"] for r in all_rules() if "record" in r}
    progress = next(expr for rec, expr in records.items() if rec.split(":")[1] == f"{name}_progress_signals")
    resets = next(expr for rec, expr in records.items() if rec.split(":")[1] == f"{name}_counter_resets")
    read = metric_names(progress)
    plain = {n for n, kind in types.items() if kind in ("counter", "gauge") and n.startswith(profile.prefix)}
    assert set(NOT_PROGRESS[name]) <= set(types), "a left-out series is not in the payload"
    assert not {family(n, types) for n in read} & set(NOT_PROGRESS[name])
    assert read & plain == plain - set(NOT_PROGRESS[name])
    assert {c for c in profile.counters if c in present} <= read
    assert metric_names(resets) == {n for n in read if types.get(family(n, types)) != "gauge"}
    hung = next(r for r in alerts() if r["alert"].endswith("Hung") and reads(r["expr"], records) & read)
    assert {*profile.running, *profile.waiting} <= reads(hung["expr"], records), hung["alert"]
    assert " offset " in hung["expr"] and "min_over_time(up{" in hung["expr"] and "counter_resets" in hung["expr"]


def _sample_key(text: str) -> tuple[str, frozenset[tuple[str, str]]]:
    name, _, labels = text.partition("{")
    pairs = re.findall(r'(\w+)="([^"]*)"', labels)
    return name.strip(), frozenset((k, v) for k, v in pairs if k not in ("job", "instance"))


@pytest.mark.parametrize("name", CAPTURED)
def test_captured_engine_cases_start_from_the_payload(name):
    """Every counter series of the engine's rule tests that the captured payload has (same
    name and labels) holds the payload's value: the cases run on what a real server sent."""
    path = captured_payload(name)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", path.read_text(), re.M))
    payload = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            payload[_sample_key(sample)] = float(value)
    checked = 0
    for case in load(RULES / "tests" / f"{name}.test.yml")["tests"]:
        for series in case["input_series"]:
            key = _sample_key(series["series"])
            if key not in payload or types.get(family(key[0], types)) == "gauge":
                continue
            numbers = {float(m) for m in re.findall(r"(?:^|\s)(-?[0-9.e+]+?)(?=[x+\s]|$)", series["values"])}
            assert payload[key] in numbers, f"{series['series']}: {series['values']} never holds the payload's {payload[key]}"
            checked += 1
    assert checked >= 10, checked
