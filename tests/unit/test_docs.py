"""The README and the docs against what they describe: job names the shipped rules
select, links that resolve, nothing that points outside the repository."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from tests.fixtures.paths import ROOT

README = ROOT / "README.md"


def _selector_regex(selector: str) -> re.Pattern[str]:
    """`job="x"` or `job=~"a|b"` as an anchored regular expression on the job name."""
    m = re.fullmatch(r'job(=~?)"([^"]*)"', selector.strip())
    assert m, selector
    return re.compile(m.group(2) if m.group(1) == "=~" else re.escape(m.group(2)))


def _exporter_selector() -> re.Pattern[str]:
    config = yaml.safe_load((ROOT / "rules" / "config.yaml").read_text())
    return _selector_regex(config["selectors"]["exporter"])


def test_readme_probe_job_is_selected_by_the_rules():
    text = README.read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "metrics_path: /probe" in b)
    (job,) = [j["job_name"] for j in yaml.safe_load(block)["scrape_configs"]]
    assert job == "llm-health-probe"
    assert _exporter_selector().fullmatch(job), f"the README's /probe job {job!r} is not selected by rules/config.yaml"
    assert f"`{job}`" in text  # and the README names it


def test_compose_jobs_are_selected_by_the_rules():
    config = yaml.safe_load((ROOT / "rules" / "config.yaml").read_text())
    jobs = {j["job_name"] for j in yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())["scrape_configs"]}
    for name in ("exporter", "vllm", "restarter", "gate"):
        assert any(_selector_regex(config["selectors"][name]).fullmatch(j) for j in jobs), (name, jobs)


def test_relative_links_in_readme_and_docs_resolve():
    missing = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert missing == []


OUTSIDE = ("../" + "shared", "/work/" + "staging")  # spelt apart so this file is not its own finding
SKIP_DIRS = {".git", "__pycache__", "artifacts", "node_modules", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def test_nothing_refers_outside_the_repository():
    """A clone made anywhere, with nothing beside it, is complete."""
    offenders = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info") and not (d.startswith(".") and d != ".ci")]
        for name in files:
            path = Path(folder) / name
            if path.stat().st_size > 2_000_000:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            if any(o in text for o in OUTSIDE):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
