"""An engine is one definition: its profile (core.engines). Every series the profile reads
is in one of its captured payloads (`Profile.payloads`), and each of those payloads is
read as that engine; every series its raw rules read is one the profile knows, so the
exporter and the rules cannot watch different series. The rules' progress, work and reset
expressions are written from the profile (rules/generate.py, `${signals.<section>.<kind>}`).
A test engine added in its test alone: tests/integration/test_engine_with_rules.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from llm_health.core import engines
from llm_health.core.engines import START_TIME, Profile
from llm_health.sim import engines as sim_engines
from llm_health.sim import servers as sim
from tests.fixtures.paths import REAL_METRICS, ROOT, captured_payloads, load_script
from tests.fixtures.stack import metric_names, payload_series

generate = load_script(ROOT / "rules" / "generate.py", "rules_generate_signals")
PROFILES = list(engines.PROFILES)
SECTIONS = sorted({p.rules for p in PROFILES if p.rules})


def profile_series(profile: Profile) -> set[str]:
    """Every series the profile reads or tells the engine by; the start time is optional
    (an engine without one shows restarts by its counters or a header)."""
    return (profile.wanted | {profile.marker, *profile.fallback_markers}) - {START_TIME}


def unproven(profile: Profile, root: Path = ROOT) -> list[str]:
    """The profile's series that appear in none of its captured payloads."""
    seen = set().union(*(payload_series(p) for p in captured_payloads(profile, root)))
    return sorted(profile_series(profile) - seen)


def rules_read(text: str) -> set[str]:
    """The raw series a rendered rule file reads: every name its expressions select
    (`__name__=~` alternatives included), less its own records and `up`."""
    rules = [r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    names: set[str] = set()
    for rule in rules:
        names |= metric_names(rule["expr"])
        for alternatives in re.findall(r'__name__\s*=~\s*"([^"]+)"', rule["expr"]):
            names |= set(alternatives.split("|"))
    return names - recorded - {"up"}


def unknown(section: str, text: str) -> list[str]:
    """The series a section's rules read that no profile of the section knows."""
    known = set().union(*(p.wanted for p in engines.PROFILES if p.rules == section))
    return sorted(rules_read(text) - known)


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_every_series_of_a_profile_is_in_one_of_its_captured_payloads(profile):
    assert captured_payloads(profile), f"{profile.name}: no captured payload matches {profile.payloads}"
    assert not unproven(profile), f"{profile.name}: in none of its captured payloads: {unproven(profile)}"


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_each_captured_payload_is_read_as_its_engine(profile):
    for path in captured_payloads(profile):
        assert engines.read(path.read_text()).profile == profile.name, path.name


def test_every_published_payload_is_some_engine_s():
    claimed = {path for p in PROFILES for path in captured_payloads(p)}
    assert set(REAL_METRICS.glob("*.prom")) <= claimed


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_a_profile_s_signals_hold_together(profile):
    """Steps and output are counters; every signal label is a plain name, one a series
    in its rules section (the section's profiles agree on each series' label)."""
    assert profile.steps is None or profile.steps in profile.counters
    assert set(profile.output) <= set(profile.counters)
    labels = {**profile.counters, **profile.gauges}
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in labels.values()), labels
    if profile.rules:
        section = generate.signals(profile.rules, "progress")
        assert {s: section[s] for s in labels} == labels
        assert len(set(section.values())) == len(section), f"{profile.rules}: two series share a signal label"


@pytest.mark.parametrize("kind", sorted(sim_engines.FLAVORS))
def test_each_simulation_serves_every_signal_of_its_profile(kind):
    """The simulated engines derive from the profiles: a flavour's kind is its profile's
    (its rules section, else its name), and a busy simulation's payload holds every
    series its profile reads as a number, so the exporter's tests on the simulator read
    what the rules read."""
    flavour = sim_engines.FLAVORS[kind]
    assert kind == (flavour.profile.rules or flavour.profile.name)
    server = sim.SimServer("x", kind=kind, model="m")
    sim.saturated(server)
    server.advance(30)
    reading = engines.read(server.payload())
    assert reading.profile == flavour.profile.name
    for unit in reading.engines.values():
        assert not [v for v in (*unit.counters, *unit.gauges, unit.running, unit.waiting) if v != v], unit


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return generate.render_all(generate.load_config())


@pytest.mark.parametrize("section", SECTIONS)
def test_every_series_the_rules_read_is_known_to_the_profile(section, rendered):
    assert not unknown(section, rendered[f"{section}.rules.yml"])


@pytest.mark.parametrize("section", SECTIONS)
def test_the_rules_read_the_profile_s_progress_and_resets(section, rendered):
    """The progress record reads the counters and gauges of the section's profiles, the
    resets record their counters: written by the generator, not by hand."""
    records = {r["record"]: r["expr"] for g in yaml.safe_load(rendered[f"{section}.rules.yml"])["groups"] for r in g["rules"] if "record" in r}
    progress = next(e for name, e in records.items() if name.split(":")[1] == f"{section}_progress_signals")
    resets = next(e for name, e in records.items() if name.split(":")[1] == f"{section}_counter_resets")
    assert metric_names(progress) == set(generate.signals(section, "progress"))
    assert metric_names(resets) == set(generate.signals(section, "resets"))
    for series, name in generate.signals(section, "progress").items():
        assert f'{series}{{job="{section}"}}' in progress and f'"signal", "{name}"' in progress


def test_the_checks_can_fail(tmp_path):
    """A profile series in none of its payloads, and a rule reading a series the profile
    does not know, are both reported."""
    engine = engines.SGLANG
    assert unproven(engine) == []
    (tmp_path / "one.prom").write_text("sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\n")
    assert "sglang:prompt_tokens_total" in unproven(dataclasses.replace(engine, payloads=("one.prom",)), tmp_path)
    rule = {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": 'sglang:num_running_reqs > 0 and sglang:cuda_graph_passes_total{job="sglang"} > 0'}]}]}
    assert unknown("sglang", yaml.safe_dump(rule)) == ["sglang:cuda_graph_passes_total"]
    rule["groups"][0]["rules"][0]["expr"] = 'sum({__name__=~"sglang:num_running_reqs|sglang:num_requests_total"})'
    assert unknown("sglang", yaml.safe_dump(rule)) == ["sglang:num_requests_total"]
