"""Every shipped alert of the raw and exporter layers, for an hour of series, at every
scrape interval a stack may use (tests/fixtures/rule_intervals.py says what the fleet does
and what each evaluation instant must show).

Three kinds of case:

* matched: the rules rendered for the interval the jobs are scraped at (5 s, 15 s, 30 s,
  60 s), and the committed files at the intervals they were made for (rules/ at
  rules/config.yaml's, rules/fast/ at its variant's): no false alert ever, every hang
  within its bound;
* scraped faster than the rules were made for (the committed 30 s rules at 5 s and 15 s):
  the same;
* scraped slower (the committed rules and rules/fast/ at 60 s): where a window can hold
  fewer scrapes than the rules need (`<job>.evidence_samples`) the raw hung alert never
  fires, and the job's ScrapeTooSlow warning does.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from llm_health.core import engines
from tests.fixtures.paths import RULES, load_script
from tests.fixtures.rule_intervals import Windows, suite
from tests.fixtures.stack import PROMTOOL, run_tool

pytestmark = pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (apt-get install prometheus)")

JOBS = {"vllm": "vllm", "llamacpp": "llamacpp", "sglang": "sglang", "tgi": "tgi", "triton": "triton", "llm-health": "exporter"}  # job -> config key


generate = load_script(RULES / "generate.py", "rules_generate")


def config_for(rules: str | int) -> dict:
    """The derived config behind a rule set: "shipped", "fast" or rendered for N seconds."""
    if rules == "shipped":
        return generate.load_config()
    if rules == "fast":
        return generate.variant_configs()["fast"]
    return generate.load_config(overrides=[f"scrape_intervals.{key}={rules}s" for key in JOBS.values()])


def rule_files(rules: str | int, tmp_path: Path) -> list[Path]:
    if rules == "shipped":
        return sorted(RULES.glob("*.rules.yml"))
    if rules == "fast":
        return sorted((RULES / "fast").glob("*.rules.yml"))
    out = tmp_path / f"rules-{rules}s"
    sets = [arg for key in JOBS.values() for arg in ("--set", f"scrape_intervals.{key}={rules}s")]
    result = run_tool(sys.executable, str(RULES / "generate.py"), "--out", str(out), *sets)
    assert result.returncode == 0, result.stderr
    return sorted(out.glob("*.rules.yml"))


def scrape_of(config: dict) -> dict[str, int]:
    return {job: int(generate.seconds(config["scrape_intervals"][key], key)) for job, key in JOBS.items()}


def windows(config: dict, scrape: dict[str, int]) -> Windows:
    """The rules' progress windows, and the jobs some window of which holds fewer than
    `<job>.evidence_samples` scrapes at `scrape`: the fewest a window of W holds is
    floor(W/s), under Prometheus 2's closed ranges and 3's left-open ones alike."""
    w = {job: generate.seconds(config[key]["evidence_window"], key) for job, key in JOBS.items()}
    slow = frozenset(job for job, key in JOBS.items() if math.floor(w[job] / scrape[job] + 1e-9) < config[key]["evidence_samples"])
    return Windows(
        vllm_s=generate.seconds(config["vllm"]["progress_window"], "vllm"),
        llamacpp_s=generate.seconds(config["llamacpp"]["progress_window"], "llamacpp"),
        vllm_no_output_s=generate.seconds(config["vllm"]["no_output_window"], "vllm"),
        too_slow=slow,
        captured_s={job: generate.seconds(config[job]["progress_window"], job) for job in ("sglang", "tgi", "triton")},
    )


def shipped_scrape(name: str) -> dict[str, int]:
    return scrape_of(config_for(name))


CASES = [
    *((f"rules-for-{s}s-scraped-{s}s", s, dict.fromkeys(JOBS, s)) for s in (5, 15, 30, 60)),
    ("shipped-at-its-own", "shipped", shipped_scrape("shipped")),
    ("fast-at-its-own", "fast", shipped_scrape("fast")),
    ("shipped-scraped-5s", "shipped", dict.fromkeys(JOBS, 5)),
    ("shipped-scraped-15s", "shipped", dict.fromkeys(JOBS, 15)),
    ("shipped-scraped-60s", "shipped", dict.fromkeys(JOBS, 60)),
    ("fast-scraped-60s", "fast", dict.fromkeys(JOBS, 60)),
]


@pytest.mark.parametrize(("rules", "scrape"), [(r, s) for _, r, s in CASES], ids=[c[0] for c in CASES])
def test_alerts_at_every_evaluation_of_an_hour(tmp_path, rules, scrape):
    config = config_for(rules)
    w = windows(config, scrape)
    files = rule_files(rules, tmp_path)
    raw = {f"{p.rules}.rules.yml" for p in engines.PROFILES if p.rules}  # every engine's raw layer
    assert {p.name for p in files} == raw | {"llm-health.rules.yml", "dcgm.rules.yml"}
    test_file = suite(tmp_path / "intervals.test.yml", files, w, scrape)
    result = run_tool(PROMTOOL, "test", "rules", str(test_file), timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"windows {w}, scrape {scrape}:\n{out[:6000]}"


def test_the_cases_cover_what_the_issue_names():
    """At least 5, 15, 30 and 60 s matched, the config's own and the variants', and a
    scrape too slow for a window (which must raise the warning instead of the page)."""
    intervals = {r for _, r, _s in CASES if isinstance(r, int)}
    assert {5, 15, 30, 60} <= intervals
    assert {"shipped", "fast"} <= {r for _, r, _s in CASES}
    assert any(windows(config_for(r), s).too_slow for _, r, s in CASES)


def held(t: float, window: float, every: float, left_open: bool, early: float = 0.0) -> int:
    """Scrapes every `every` s from 0 inside the window of `window` s ending at t: closed
    at its start (Prometheus 2) or left-open (3); `early`: its first scrape came that early."""

    def inside(x: float) -> bool:
        return (t - window < x if left_open else t - window <= x) and x <= t

    times = [k * every for k in range(int(t // every) + 1) if inside(k * every)]
    if early and times:
        times[0] -= early
    return sum(1 for x in times if inside(x))


@pytest.mark.parametrize("interval", [5, 15, 30, 60])
def test_windows_hold_their_evidence_under_closed_and_left_open_ranges(interval):
    """The scrape count the hung rules need holds at every phase of the evaluation
    against the scrapes, whether the window's start is in it (Prometheus 2) or not
    (Prometheus 3), also with the window's first scrape a third of an interval early (out
    of the window); a scrape slow enough that the window holds one scrape fewer fails it."""
    config = config_for(interval)
    for key in JOBS.values():
        window = generate.seconds(config[key]["evidence_window"], key)
        need = config[key]["evidence_samples"]
        slower = window / (need - 1) + 0.1  # every window then holds need - 1 at most
        for left_open in (False, True):
            for tenth in range(int(interval * 10)):
                t = window + 10 * interval + tenth / 10
                assert held(t, window, interval, left_open) >= need, (key, left_open, t)
                assert held(t, window, interval, left_open, early=interval / 3) >= need, (key, left_open, t, "early")
                assert held(t, window, slower, left_open) < need, (key, left_open, t, "slower")
