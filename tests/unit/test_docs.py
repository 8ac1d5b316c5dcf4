"""The README and the docs against what they describe: job names the shipped rules
select, links that resolve, nothing that points outside the repository, and a README that
is short and whose every command a test runs."""

from __future__ import annotations

import ast
import os
import re
import shlex
from pathlib import Path

import yaml

from tests.fixtures.paths import ROOT

README = ROOT / "README.md"
EXPORTER_DOC = ROOT / "docs" / "exporter.md"
README_MAX_LINES = 250
# The README's shell blocks marked `<!-- docs-as-written: NAME -->` are run as written by
# this file's tests, each reading its block with `block(README, "NAME")`.
AS_WRITTEN = ROOT / "tests" / "integration" / "test_docs_as_written.py"
# The README's other commands, each with the test that runs it: the test (or a function of
# its module it calls) holds the command, as a string or as an argv list.
RUN_BY = {
    "make demo": "tests/integration/test_demo_setup.py::test_make_demo_in_a_fresh_venv_shows_every_part",
    "make test": "tests/integration/test_ci_plugin.py::test_ci_run_sets_ci_and_fails_on_a_throwaway_xfail_or_skip",
}
SHELL_BLOCK = re.compile(r"(?:<!-- docs-as-written: (?P<name>[\w.-]+) -->\n)?```(?P<lang>sh|bash|console|shell)\n(?P<body>.*?)```", re.S)


def _selector_regex(selector: str) -> re.Pattern[str]:
    """`job="x"` or `job=~"a|b"` as an anchored regular expression on the job name."""
    m = re.fullmatch(r'job(=~?)"([^"]*)"', selector.strip())
    assert m, selector
    return re.compile(m.group(2) if m.group(1) == "=~" else re.escape(m.group(2)))


def _exporter_selector() -> re.Pattern[str]:
    config = yaml.safe_load((ROOT / "rules" / "config.yaml").read_text())
    return _selector_regex(config["selectors"]["exporter"])


def test_the_documented_probe_job_is_selected_by_the_rules():
    text = EXPORTER_DOC.read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "metrics_path: /probe" in b)
    (job,) = [j["job_name"] for j in yaml.safe_load(block)["scrape_configs"]]
    assert job == "llm-health-probe"
    assert _exporter_selector().fullmatch(job), f"docs/exporter.md's /probe job {job!r} is not selected by rules/config.yaml"
    assert f"`{job}`" in text  # and the doc names it


def readme_commands(text: str) -> list[tuple[str | None, str]]:
    """Every command of the README's shell blocks, with the block's docs-as-written name
    (None where it has none): a line (joined with its `\\` continuations) less its comment;
    in a console block only the lines after a `$ ` prompt."""
    out: list[tuple[str | None, str]] = []
    for m in SHELL_BLOCK.finditer(text):
        body = m["body"].replace("\\\n", " ")
        for line in body.splitlines():
            if m["lang"] == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            command = " ".join(shlex.split(line, comments=True))
            if command:
                out.append((m["name"], command))
    return out


def _runs(path: Path, test: str, command: str) -> bool:
    """Whether `test` in `path` exists and holds `command`, itself or in a function of its
    module it calls, as a string or as an argv list ("make", "demo")."""
    source = path.read_text()
    functions = {n.name: n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    if test not in functions:
        return False
    called = {c.func.id for c in ast.walk(functions[test]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    text = "\n".join(ast.get_source_segment(source, functions[name]) or "" for name in [test, *sorted(called & set(functions))])
    argv = ", ".join(f'"{word}"' for word in shlex.split(command))
    return command in text or argv in text


def test_the_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}: move the detail into docs/"


def test_every_command_in_the_readme_is_run_by_a_test():
    commands = readme_commands(README.read_text())
    assert {(None, "make demo"), ("serve", "llm-health config check llm-health.yml")} <= set(commands)  # the extraction itself
    as_written = AS_WRITTEN.read_text()
    tests = {
        n.name: ast.get_source_segment(as_written, n) or ""
        for n in ast.walk(ast.parse(as_written))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")
    }
    unrun = []
    for name, command in commands:
        if name is not None:
            if not any(f'block(README, "{name}")' in body for body in tests.values()):
                unrun.append(f"{command!r}: its block docs-as-written: {name} is read by no test of {AS_WRITTEN.relative_to(ROOT)}")
        elif command in RUN_BY:
            path, test = RUN_BY[command].split("::")
            if not _runs(ROOT / path, test, command):
                unrun.append(f"{command!r}: {RUN_BY[command]} does not exist or does not run it")
        else:
            unrun.append(f"{command!r}: mark its block docs-as-written and run it in {AS_WRITTEN.relative_to(ROOT)}, or name its test in RUN_BY")
    assert unrun == []
    assert set(RUN_BY) <= {c for _, c in commands}, "RUN_BY names a command the README no longer has"


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
