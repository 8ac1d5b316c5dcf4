"""An engine's name appears only in the places docs/architecture.md lists under "Adding
an engine": nothing else in the repository compares or spells an engine's name, so adding
one touches those places and no others (issue 41).

For each registered engine (core.engines.PROFILES) its spellings are its profile's
`name`, `title`, `aliases` and the stem of its series' `prefix`; each is looked for,
case-insensitively and not inside a longer word, in every file git knows (tracked or new)
outside the listed places. vLLM is not held here: it is the product's first engine and
its name is also that of the raw rule layer's alerts (`VLLMEngineHung`, acted on by the
restarter), of the `VLLM_API_KEY` the examples read, and of the old `kind: vllm`.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest

from llm_health.core import engines
from llm_health.core.engines import Profile
from llm_health.sim import engines as sim_engines
from tests.fixtures.paths import load_script

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"

NOT_HELD = {"vllm_v1", "vllm_v0"}  # see the docstring

# Everywhere an engine may be named, as docs/architecture.md's "Adding an engine" lists
# them ({name}: the profile's name; {module}: its module in core.engines; {sim}: its
# module in sim.engines, where it has one).
PLACES = (
    "exporter/llm_health/core/engines/{module}.py",  # its profile
    "exporter/llm_health/core/engines/registry.py",  # one line: the registry
    "exporter/llm_health/core/engines/__init__.py",  # one line: the re-export
    "exporter/llm_health/sim/engines/{sim}.py",  # its simulation
    "exporter/llm_health/sim/engines/__init__.py",  # one line: the simulations' registry
    "rules/templates/{name}.rules.yml.tmpl",  # its rules section
    "rules/config.yaml",  # its rules section's values: scrape interval, selector, windows
    "rules/{name}.rules.yml",  # generated from the template
    "rules/fast/{name}.rules.yml",  # generated from the template
    "rules/tests/{name}.test.yml",  # its rule tests
    "rules/prometheusrule.yaml",  # generated: every rules section in one PrometheusRule
    "rules/fast/prometheusrule.yaml",
    "deploy/kubernetes/prometheusrule.yaml",
    "mixin/generated/config.libsonnet",  # generated: the mixin's copy of rules/config.yaml
    "mixin/generated/templates.libsonnet",  # generated: the mixin's copy of the templates
    "compose/prometheus.yml",  # the compose example's scrape job for its rules section
    ".ci/install-{name}.sh",  # its installer, for its real-engine tests
    "scripts/install-test-deps.sh",  # one line: runs its installer
    "pyproject.toml",  # one line: the pytest marker of its real-engine tests
    "bench/engines_measure.py",  # its real-engine measurement (docs/engines.md)
    "tests/*",  # its tests, harness subclass, fixture and captured payloads
    "docs/*",
    "*README.md",
    "CHANGELOG.md",
)

# Files that name engines outside those places, each with its reason (none today: a
# file added here needs a reason docs/architecture.md's "Adding an engine" gives).
ALLOWLIST: dict[str, str] = {}


def _module_of(profile: Profile, package: str, skip: set[str]) -> str | None:
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in skip:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        for value in vars(module).values():
            if value is profile or getattr(value, "profile", None) is profile:
                return info.name
    return None


def _held() -> list[Profile]:
    return [p for p in engines.PROFILES if p.name not in NOT_HELD]


def spellings(profile: Profile) -> set[str]:
    stem = profile.prefix.rstrip(":_")
    return {s.lower() for s in (profile.name, profile.title, stem, *profile.aliases) if s}


def places(profile: Profile) -> list[str]:
    module = _module_of(profile, "llm_health.core.engines", {"registry", "profile", "reading"})
    sim = _module_of(profile, "llm_health.sim.engines", {"base"}) or "-"
    assert module, f"{profile.name}: no module of core.engines defines it"
    return [p.format(name=profile.name, module=module, sim=sim) for p in PLACES]


def _files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return sorted({f for f in out.split("\0") if f and (ROOT / f).is_file()})


def offenders(profile: Profile, files: list[str]) -> dict[str, list[str]]:
    """{file: [line, ...]} where one of the profile's spellings appears outside its places."""
    pattern = re.compile("|".join(rf"(?<![a-z0-9]){re.escape(s)}" for s in sorted(spellings(profile))), re.I)
    allowed = places(profile)
    out: dict[str, list[str]] = {}
    for name in files:
        if name in ALLOWLIST or any(fnmatch(name, p) for p in allowed):
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        hits = [f"{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
        if hits:
            out[name] = hits
    return out


@pytest.mark.parametrize("profile", _held(), ids=lambda p: p.name)
def test_an_engine_is_named_only_in_its_places(profile):
    found = offenders(profile, _files())
    assert not found, f"{profile.name} ({', '.join(sorted(spellings(profile)))}) named outside docs/architecture.md's places: {found}"


def test_the_allowlist_is_still_needed():
    """An allowlisted file that no longer names any engine leaves the list."""
    files = [f for f in _files() if f in ALLOWLIST]
    missing = set(ALLOWLIST) - set(files)
    assert not missing, f"allowlisted files that are gone: {sorted(missing)}"
    patterns = [re.compile("|".join(rf"(?<![a-z0-9]){re.escape(s)}" for s in sorted(spellings(p))), re.I) for p in _held()]
    unneeded = [f for f in files if not any(p.search((ROOT / f).read_text(encoding="utf-8")) for p in patterns)]
    assert not unneeded, f"allowlisted files that name no engine: {unneeded}"


def test_the_places_are_those_the_architecture_doc_lists():
    """Each place of PLACES is a line of docs/architecture.md's "Adding an engine"."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("## Adding an engine", 1)[1].split("\n## ", 1)[0]
    for place in PLACES:
        shown = place.replace("{name}", "NAME").replace("{module}", "NAME").replace("{sim}", "NAME")
        assert f"`{shown}`" in section, f"{shown} is not listed under 'Adding an engine'"


def test_a_name_outside_the_places_is_found(tmp_path):
    """The check can fail: a spelling in a file outside the places is reported."""
    profile = engines.LLAMACPP
    probe = ROOT / "exporter" / "llm_health" / "probe" / "client.py"
    assert probe.relative_to(ROOT).as_posix() not in places(profile)
    assert offenders(profile, [probe.relative_to(ROOT).as_posix()]) == {}
    names = spellings(profile)
    assert {"llamacpp", "llama.cpp", "llama-server"} <= names
    pattern = re.compile("|".join(rf"(?<![a-z0-9]){re.escape(s)}" for s in sorted(names)), re.I)
    assert pattern.search('if prev.profile == "llamacpp":') and pattern.search("class LlamaCppEngine")
    assert not pattern.search("xllamacpp")


def test_every_engine_section_of_the_rules_is_a_registered_engine():
    """The rule pack's engine sections (a scrape job with a template of its name) are
    engines of the registry, by name or by their series' prefix (vllm: both vLLM profiles)."""
    generate = load_script(ROOT / "rules" / "generate.py", "rules_generate_names")
    sections = generate.engine_sections(generate.load_config())
    known = {p.name for p in engines.PROFILES} | {p.prefix.rstrip(":_") for p in engines.PROFILES}
    assert sections and set(sections) <= known, sections


def test_every_simulated_engine_simulates_a_registered_profile():
    for kind, flavor in sim_engines.FLAVORS.items():
        assert flavor.profile in engines.PROFILES, kind
