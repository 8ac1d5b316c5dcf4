"""The rule pack: generated files up to date, promtool-valid, unit-tested, mixin style,
and reading only series that exist (in real vLLM and llama.cpp payloads, the captured
payloads of the other engines, or the exporter's contract)."""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from llm_health.core import engines
from tests.fixtures.paths import REAL_LLAMACPP, REAL_METRICS, REAL_VLLM, ROOT, RULES, load_script
from tests.fixtures.rule_groups import eval_order
from tests.fixtures.rule_intervals import EVAL_S, HANG_AT, HOUR_S, RESTART_AT, Target, Windows, _vllm, bounds, const, grows, input_series
from tests.fixtures.stack import PROMTOOL, exporter_series, metric_names, payload_series, run_tool

RULE_FILES = sorted(RULES.glob("*.rules.yml"))

generate = load_script(RULES / "generate.py", "rules_generate")
TEST_FILES = sorted((RULES / "tests").glob("*.test.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"
V1_PAYLOAD = REAL_METRICS / "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom"
REAL_VLLM_CAPTURES = REAL_VLLM
DCGM_PAYLOADS = ROOT / "tests" / "data" / "dcgm"  # dcgm-exporter /metrics as published (SOURCES.md)

# vLLM series newer than every real payload in tests/data/real-world/metrics/, each with
# where it is documented, and each in the committed captures of a vLLM that has it
# (tests/data/vllm-real/*.prom).
NEWER_THAN_PAYLOADS = {
    "vllm:engine_sleep_state": "vLLM >= 0.11 sleep mode (vllm/v1/metrics/loggers.py)",
    "vllm:admission_rejections_total": "vLLM 0.32's --max-num-queued-reqs / --max-num-queued-tokens (vllm/v1/metrics/loggers.py)",
}
# The V0 name kept as a fallback for KV usage; every other vllm: name must be in the V1 payload.
V0_ONLY = {"vllm:gpu_cache_usage_perc"}

needs_promtool = pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (apt-get install prometheus)")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def all_rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in load(path)["groups"] for rule in group["rules"]]


def alerts() -> list[dict]:
    return [r for r in all_rules() if "alert" in r]


def test_rule_files_exist():
    raw = {f"{p.rules}.rules.yml" for p in engines.PROFILES if p.rules}  # every engine's raw layer
    assert {p.name for p in RULE_FILES} == raw | {"llm-health.rules.yml", "dcgm.rules.yml"}
    assert TEST_FILES


def test_generated_files_are_up_to_date():
    result = run_tool(sys.executable, str(RULES / "generate.py"), "--check")
    assert result.returncode == 0, result.stderr


def test_generator_overrides_reach_every_file(tmp_path):
    result = run_tool(
        sys.executable,
        str(RULES / "generate.py"),
        "--out",
        str(tmp_path),
        "--set",
        "scrape_intervals.vllm=1s",
        "--set",
        "scrape_intervals.llamacpp=2s",
        "--set",
        "vllm.progress_window=7s",
        "--set",
        "exporter.backend_hung_for=3s",
        "--set",
        "llamacpp.progress_window=9s",
    )
    assert result.returncode == 0, result.stderr
    vllm = (tmp_path / "vllm.rules.yml").read_text()
    assert "moved7s" in vllm and "[7s]" in vllm and "[3m]" not in vllm and "[1m30s]" not in vllm
    llamacpp = (tmp_path / "llamacpp.rules.yml").read_text()
    assert "moved9s" in llamacpp and "[9s]" in llamacpp and "offset 9s" in llamacpp and "[2m]" not in llamacpp
    assert "for: 3s" in (tmp_path / "llm-health.rules.yml").read_text()
    assert "moved7s" in (tmp_path / "prometheusrule.yaml").read_text()


@pytest.mark.parametrize(
    ("interval", "vllm", "llamacpp", "rate", "vllm_samples", "llamacpp_samples"),
    [
        ("5s", "45s", "2m", "5m", 8, 23),
        ("15s", "45s", "2m", "5m", 2, 7),
        ("30s", "1m30s", "2m", "5m", 2, 3),
        ("60s", "3m", "3m", "5m", 2, 2),
        ("2m", "6m", "6m", "8m", 2, 2),
    ],
)
def test_windows_follow_the_scrape_interval(interval, vllm, llamacpp, rate, vllm_samples, llamacpp_samples):
    """A progress window spans at least 3 scrapes, a rate window 4, over the config's
    floors (45s, 2m, 5m); the hung rules need all but one of the scrapes the window holds."""
    config = generate.load_config(overrides=[f"scrape_intervals.{job}={interval}" for job in ("vllm", "llamacpp", "exporter")])
    assert config["vllm"]["progress_window"] == vllm
    assert config["llamacpp"]["progress_window"] == llamacpp
    assert config["vllm"]["rate_window"] == rate and config["exporter"]["round_errors_window"] == rate
    assert (config["vllm"]["evidence_samples"], config["llamacpp"]["evidence_samples"]) == (vllm_samples, llamacpp_samples)
    rendered = generate.render_all(config)["vllm.rules.yml"]
    assert f"moved{vllm}" in rendered and f">= {vllm_samples})," in rendered and f"< {vllm_samples}\n" in rendered


@pytest.mark.parametrize("bad", ["scrape_intervals.vllm=30 seconds", "scrape_intervals.vllm=0s", "vllm.progress_window=soon"])
def test_generator_refuses_durations_that_are_not(tmp_path, bad):
    result = run_tool(sys.executable, str(RULES / "generate.py"), "--out", str(tmp_path), "--set", bad)
    key = bad.partition("=")[0]
    assert result.returncode != 0 and key in result.stderr and ("duration" in result.stderr or "longer than zero" in result.stderr)


def test_committed_files_say_their_scrape_intervals():
    """Each rule file names the intervals of the jobs whose values it reads; the manifest, every one."""
    assert "For these scrape intervals: vllm 30s.\n" in (RULES / "vllm.rules.yml").read_text()
    assert "For these scrape intervals: vllm 15s.\n" in (RULES / "fast" / "vllm.rules.yml").read_text()
    assert "For these scrape intervals: exporter 5s.\n" in (RULES / "fast" / "llm-health.rules.yml").read_text()
    assert "Scrape intervals: vllm 15s, llamacpp 15s, sglang 15s, tgi 15s, triton 15s, exporter 5s.\n" in (RULES / "fast" / "prometheusrule.yaml").read_text()


def test_generator_refuses_unknown_keys(tmp_path):
    result = run_tool(sys.executable, str(RULES / "generate.py"), "--out", str(tmp_path), "--set", "vllm.no_such=1s")
    assert result.returncode != 0 and "no such key" in result.stderr


def test_prometheusrule_manifest_holds_the_same_groups():
    manifest = load(RULES / "prometheusrule.yaml")
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["name"]
    groups = [g for path in RULE_FILES for g in load(path)["groups"]]
    assert manifest["spec"]["groups"] == groups


@needs_promtool
def test_promtool_check_rules():
    result = run_tool(PROMTOOL, "check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_check_rules_of_the_manifest(tmp_path):
    spec = load(RULES / "prometheusrule.yaml")["spec"]
    path = tmp_path / "manifest.rules.yml"
    path.write_text(yaml.safe_dump(spec))
    result = run_tool(PROMTOOL, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests(test_file):
    result = run_tool(PROMTOOL, "test", "rules", str(test_file), cwd=test_file.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case_with_annotations():
    firing, quiet = {}, set()
    for test_file in TEST_FILES:
        for case in load(test_file)["tests"]:
            for check in case.get("alert_rule_test", []):
                name = check["alertname"]
                if check.get("exp_alerts"):
                    firing.setdefault(name, []).extend(check["exp_alerts"])
                else:
                    quiet.add(name)
    names = {a["alert"] for a in alerts()}
    assert names - set(firing) == set(), "alerts without a case that fires"
    assert names - quiet == set(), "alerts without a case that must not fire"
    for name, expected in firing.items():
        for alert in expected:
            assert {"summary", "description", "runbook_url"} <= set(alert.get("exp_annotations", {})), name


SCRAPE_S = 15  # vllm.test.yml's scrape, the interval rules/fast/ is made for


def hung_bound(w: Windows) -> float:
    """The documented hang-to-firing bound of VLLMEngineHung: the window and one evaluation."""
    return bounds(w, {"llm-health": SCRAPE_S})["VLLMEngineHung"]


def first_scrape_after_the_restart() -> int:
    """The first scrape that shows the restarted process."""
    return -(-RESTART_AT // SCRAPE_S) * SCRAPE_S


def restart_in_the_window() -> set[int]:
    """Instants whose window holds the restart, past the evaluation or two the alert reads
    the restart's recording rule late by."""
    return {first_scrape_after_the_restart() + 10, first_scrape_after_the_restart() + 25}


def field_reports(w: Windows) -> list[tuple[str, list[Target], str, Callable[[int], set[str] | None]]]:
    """The cases VLLMEngineHung must tell apart (rules/tests/vllm.test.yml has one of each,
    written by hand): (report, the targets, the instance judged, the engines firing at
    instant t, None where the instant is between what the report fixes)."""
    bound = hung_bound(w)
    after_restart = first_scrape_after_the_restart()
    masked = restart_in_the_window()

    def never(t: int) -> set[str]:
        return set()

    def hung_from_the_hang(t: int) -> set[str] | None:
        return set() if t <= HANG_AT else {"0"} if t >= HANG_AT + bound else None

    def hung_again_after_the_restart(stuck_before: bool) -> Callable[[int], set[str] | None]:
        def expected(t: int) -> set[str] | None:
            if t < RESTART_AT:
                return ({"0"} if t >= 2 * w.vllm_s + 30 else None) if stuck_before else set()
            return set() if t in masked else {"0"} if t >= after_restart + w.vllm_s + 60 else None

        return expected

    frozen = {"steps_fn": grows(2.0, until=HANG_AT), "gen": grows(100.0, until=HANG_AT), "prompt": grows(260.0, until=HANG_AT)}
    busy = {"running": const(12), "waiting": const(5), "steps_fn": grows(2.0), "gen": grows(100.0), "prompt": grows(260.0), "kv": const(0.93)}
    stuck = {"steps_fn": const(0), "gen": const(0), "prompt": const(0), "finished": const(0), "kv": const(0)}
    started = _vllm("restarted", running=const(1), waiting=const(0), start=None, **stuck)
    started.add("process_start_time_seconds", {}, lambda t: 1000.0 if t < RESTART_AT else 5000.0)
    reset = {"steps_fn": lambda t: 10 + 2 * t if t < RESTART_AT else 0.0, "gen": lambda t: 10 + 100 * t if t < RESTART_AT else 0.0}
    dp = _vllm("dp", engine="0", running=const(3), waiting=const(0), kv=const(0.3), **frozen)
    _vllm("dp", engine="1", start=None, target=dp, **busy)
    v0 = Target("vllm", "v0:8000")
    for name, fn in (
        ("vllm:num_requests_running", const(1)),
        ("vllm:num_requests_waiting", const(0)),
        ("vllm:iteration_tokens_total_count", grows(2.0, until=HANG_AT)),
        ("vllm:generation_tokens_total", grows(100.0, until=HANG_AT)),
        ("vllm:gpu_cache_usage_perc", const(0.2)),
    ):
        v0.add(name, {"model_name": "old"}, fn)
    return [
        ("saturated and progressing", [_vllm("saturated", **busy)], "saturated:8000", never),
        (
            "slow but alive, 8 tokens/s for one request",
            [_vllm("slow", running=const(1), waiting=const(0), steps_fn=grows(8.0), gen=grows(8.0), prompt=const(900), kv=const(0.02))],
            "slow:8000",
            never,
        ),
        (
            "long chunked prefill: only KV usage moves, a chunk every 20 s",
            [
                _vllm(
                    "prefill", running=const(1), waiting=const(0), steps_fn=const(500), gen=const(900), prompt=const(7000), kv=lambda t: 0.1 + 0.001 * (t // 20)
                )
            ],
            "prefill:8000",
            never,
        ),
        ("hung with running > 0", [_vllm("hung", running=const(4), waiting=const(0), kv=const(0.31), **frozen)], "hung:8000", hung_from_the_hang),
        (
            "hung with only waiting > 0",
            [_vllm("waiting", running=lambda t: 4 if t < HANG_AT else 0, waiting=lambda t: 0 if t < HANG_AT else 3, kv=const(0.31), **frozen)],
            "waiting:8000",
            hung_from_the_hang,
        ),
        ("a restart seen only through process_start_time_seconds", [started], "restarted:8000", hung_again_after_the_restart(stuck_before=True)),
        (
            "a restart without process_start_time_seconds: the counters reset, then stand still",
            [_vllm("reset", running=const(2), waiting=const(0), prompt=const(0), kv=const(0.4), start=None, **reset)],
            "reset:8000",
            hung_again_after_the_restart(stuck_before=False),
        ),
        ("idle", [_vllm("idle", running=const(0), waiting=const(0), steps_fn=const(900), gen=const(900), prompt=const(900), kv=const(0))], "idle:8000", never),
        (
            "sleeping with requests waiting",
            [_vllm("sleeping", running=const(0), waiting=const(2), steps_fn=const(900), gen=const(900), prompt=const(900), kv=const(0), awake=0.0)],
            "sleeping:8000",
            never,
        ),
        ("data-parallel: engine 0 hung, engine 1 of the same server progressing", [dp], "dp:8000", hung_from_the_hang),
        ("V0 layout: no engine label, gpu_cache_usage_perc", [v0], "v0:8000", lambda t: {""} if hung_from_the_hang(t) else hung_from_the_hang(t)),
    ]


@needs_promtool
def test_hung_alert_tells_apart_the_field_reports(tmp_path):
    """VLLMEngineHung of rules/fast/ (the rules vllm.test.yml tests) over an hour scraped
    every 15 s, read through ALERTS at every minute and at the instants a report turns on:
    the busy, slow, prefilling, idle and sleeping engines never; a hung engine from its
    bound (window and one evaluation) on, with requests running or only waiting, one
    data-parallel engine beside a progressing one, or in the V0 layout; a restart, seen
    through the start time or a counter reset, masks the window that holds it."""
    config = generate.variant_configs()["fast"]
    w = Windows(vllm_s=generate.seconds(config["vllm"]["progress_window"], "vllm"), llamacpp_s=0.0)
    reports = field_reports(w)
    assert len(reports) == 11
    base, series = input_series([t for _, targets, _, _ in reports for t in targets], {"vllm": SCRAPE_S})
    instants = sorted({*range(0, HOUR_S + 1, 60), *restart_in_the_window(), HANG_AT + math.ceil(hung_bound(w))})
    checks = []
    for at in instants:
        judged = {instance: expected(at) for _, _, instance, expected in reports}
        known = sorted(i for i, engines in judged.items() if engines is not None)
        samples = [
            {"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in (("instance", i), ("engine", e)) if v) + "}", "value": 1}
            for i in known
            for e in sorted(judged[i] or ())
        ]
        expr = f'count by (instance, engine) (ALERTS{{alertname="VLLMEngineHung", alertstate="firing", instance=~"{"|".join(re.escape(i) for i in known)}"}})'
        checks.append({"expr": expr, "eval_time": f"{at}s", "exp_samples": samples})
    assert sum(len(c["exp_samples"]) for c in checks) > 100 and any(not c["exp_samples"] for c in checks)
    doc = {
        "rule_files": [str(RULES / "fast" / "vllm.rules.yml")],
        "evaluation_interval": f"{EVAL_S}s",
        "group_eval_order": eval_order([RULES / "fast" / "vllm.rules.yml"]),
        "tests": [{"interval": f"{base}s", "input_series": series, "promql_expr_test": checks}],
    }
    test_file = tmp_path / "field-reports.test.yml"
    test_file.write_text(yaml.safe_dump(doc, sort_keys=False, width=100000))
    result = run_tool(PROMTOOL, "test", "rules", str(test_file), timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[:6000]


def test_mixin_conventions():
    runbook = RUNBOOK.read_text() if RUNBOOK.exists() else ""
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", runbook, flags=re.M)}
    seen = set()
    for rule in alerts():
        name = rule["alert"]
        assert name not in seen, f"{name} defined twice"
        seen.add(name)
        assert re.fullmatch(r"(VLLM|LLM|LlamaCpp|SGLang|TGI|Triton)[A-Z][A-Za-z0-9]+", name), name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        ann = rule["annotations"]
        assert ann["summary"].endswith(".") and "{{" not in ann["summary"], f"{name}: summary must be static"
        assert "{{" in ann["description"], f"{name}: description should name what fired"
        base, _, anchor = ann["runbook_url"].partition("#")
        assert base.endswith("runbook.md") and anchor == name.lower(), name
        assert anchor in anchors, f"{name}: no section '{name}' in docs/runbook.md"
    for rule in all_rules():
        if "record" in rule:
            assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def test_critical_alerts_wait_or_are_counts():
    """Pages need a for: unless they count events over a window (increase)."""
    for rule in alerts():
        if rule["labels"]["severity"] == "critical" and "for" not in rule:
            assert "increase(" in rule["expr"], rule["alert"]


# --- every series a rule reads exists -------------------------------------------------


def vllm_payloads() -> list[Path]:
    files = sorted(REAL_METRICS.glob("vllm*.prom"))
    assert files, f"no real vLLM payloads under {REAL_METRICS}"
    return files


def test_metric_name_extraction_catches_the_known_bug():
    # Two published rule sets query vllm:num_preemptions without _total: it never exists.
    names = metric_names('sum by (model_name) (rate(vllm:num_preemptions{job="x"}[5m])) > 0')
    assert names == {"vllm:num_preemptions"}
    assert not any("vllm:num_preemptions" in payload_series(p) for p in vllm_payloads())
    assert metric_names('label_replace(up{a="b"} == 0, "host", "$1", "instance", "(.+?)(:[0-9]+)?")') == {"up"}
    assert metric_names("sum by (job) (x offset 3m) and on (job) y unless z > 1e9") == {"x", "y", "z"}


def llamacpp_payloads() -> list[Path]:
    files = sorted(REAL_LLAMACPP.glob("*.prom"))
    assert files, f"no llama-server payloads under {REAL_LLAMACPP}"
    return files


def captured_engines() -> dict[str, set[str]]:
    """{series prefix: the series of its captured payloads} for each registered engine
    whose rules are checked against captured payloads alone (tests/data/real-world/metrics/
    <engine>-*.prom): every engine but vLLM and llama.cpp, whose own captures are above."""
    out = {}
    for profile in engines.PROFILES:
        files = sorted(REAL_METRICS.glob(f"{profile.name}-*.prom"))
        if profile.prefix not in ("vllm:", "llamacpp:") and files:
            out[profile.prefix] = set().union(*(payload_series(p) for p in files))
    return out


def test_every_series_read_by_a_rule_exists():
    recorded = {r["record"] for r in all_rules() if "record" in r}
    captured = captured_engines()
    assert len(captured) >= 3, f"captured payloads of SGLang, TGI and Triton missing from {REAL_METRICS}"
    exported = exporter_series()
    llamacpp = set().union(*(payload_series(p) for p in llamacpp_payloads()))
    payloads = {p.name: payload_series(p) for p in vllm_payloads()}
    captures = [payload_series(p) for p in sorted(REAL_VLLM_CAPTURES.glob("*.prom"))]
    assert captures, f"no captures of a real vLLM in {REAL_VLLM_CAPTURES}: the newer series would go unchecked"
    v1 = payloads[V1_PAYLOAD.name]
    dcgm = set().union(*(payload_series(p) for p in sorted(DCGM_PAYLOADS.glob("*.prom"))))
    assert dcgm, f"no dcgm-exporter payloads under {DCGM_PAYLOADS}"
    problems = []
    for rule in all_rules():
        who = rule.get("alert") or rule.get("record")
        for name in metric_names(rule["expr"]):
            if name in recorded or name == "up":
                continue
            if name == "ALERTS":  # written by Prometheus (vmalert: to -remoteWrite.url) for each alert rule
                read = set(re.findall(r'ALERTS\{alertname="([^"]+)"', rule["expr"]))
                if not read or not read <= {a["alert"] for a in alerts()}:
                    problems.append(f"{who}: ALERTS must name a shipped alert by alertname (reads {sorted(read) or 'any'})")
                continue
            if name.startswith("DCGM_"):
                if name not in dcgm:
                    problems.append(f"{who}: {name} is in no real dcgm-exporter payload ({DCGM_PAYLOADS.relative_to(ROOT)})")
            elif name.startswith("llamacpp:"):
                if name not in llamacpp:
                    problems.append(f"{who}: {name} is in no live llama-server payload ({REAL_LLAMACPP.relative_to(ROOT)})")
            elif prefix := next((p for p in captured if name.startswith(p)), None):
                if name not in captured[prefix]:
                    problems.append(f"{who}: {name} is in no captured payload of its engine ({REAL_METRICS.relative_to(ROOT)})")
            elif name.startswith("llm_"):
                if name not in exported:
                    problems.append(f"{who}: {name} is not an exporter series (docs/architecture.md)")
            elif name in NEWER_THAN_PAYLOADS:
                if not any(name in c for c in captures):
                    problems.append(f"{who}: {name} missing from the captures in tests/data/vllm-real/")
            elif name in V0_ONLY:
                if not any(name in names for names in payloads.values()):
                    problems.append(f"{who}: {name} is in no real vLLM payload")
            elif name not in v1:
                where = [f for f, names in payloads.items() if name in names]
                problems.append(f"{who}: {name} is not in the V1 payload (found in: {where or 'none'})")
    assert not problems, "\n".join(problems)


def test_fingerprint_reads_every_progress_signal():
    """No-progress means none of these moved: keep them all in the fingerprint."""
    rules = {r.get("record"): r["expr"] for r in all_rules() if "record" in r}
    progress = next(expr for name, expr in rules.items() if name.startswith("engine:vllm_progress_signals:"))
    assert metric_names(progress) == {
        "vllm:iteration_tokens_total_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    }
    hung = next(r for r in alerts() if r["alert"] == "VLLMEngineHung")["expr"]
    assert "vllm:engine_sleep_state" in hung and "process_restarts" in hung and "counter_resets" in hung
