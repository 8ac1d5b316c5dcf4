"""Every third-party module that tests/ and bench/ import is a distribution that
pyproject.toml's `test` extra declares itself, or through the extras it names: `make test`
then passes on a Python that has only what `pip install -e '.[test]'` put there
(tests/integration/test_declared_dependencies.py installs that alone in an empty venv).

A module pulled in as somebody else's dependency (multidict through aiohttp) counts only if
it is declared: a dependency's dependencies change with its releases.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "bench")
FIRST_PARTY = {"tests", "bench", "llm_health", "rules", "grafana"}
# Scripts that another interpreter runs, with what that interpreter has.
OTHER_INTERPRETER = {
    "tests/harness/build_tiny_model.py": "the vLLM venv's python (.ci/install-vllm.sh): torch, transformers, tokenizers",
    "tests/harness/build_tiny_gguf.py": ".ci/install-llamacpp.sh's python, with numpy and llama.cpp's gguf-py",
}


def normalize(name: str) -> str:  # PEP 503
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_name(requirement: str) -> str:  # "redis>=5,<9" -> "redis"; "llm-health[redis,gate]" -> "llm-health"
    return normalize(re.split(r"[\s\[<>=!~;@(]", requirement, maxsplit=1)[0])


def declared(extra: str = "test") -> set[str]:
    """The distributions `llm-health[extra]` names: the base dependencies, the extra's, and
    those of every `llm-health[...]` it names, recursively."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, out, todo, seen = project["optional-dependencies"], set(), [extra], set()
    for req in project["dependencies"]:
        out.add(dist_name(req))
    while todo:
        if (name := todo.pop()) in seen:
            continue
        seen.add(name)
        for req in extras[name]:
            if (dist := dist_name(req)) == "llm-health":
                todo.extend(x.strip() for x in req[req.index("[") + 1 : req.index("]")].split(","))
            else:
                out.add(dist)
    return out


def third_party_imports() -> dict[str, list[str]]:
    """Top-level module -> the files that import it (anywhere in the file, a function's body too)."""
    found: dict[str, list[str]] = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in OTHER_INTERPRETER:
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for mod in {n.split(".")[0] for n in names} - FIRST_PARTY - set(sys.stdlib_module_names):
                    found.setdefault(mod, []).append(rel)
    return found


def test_the_test_extra_names_itself_and_the_product_extras():
    assert {"pytest", "hypothesis", "redis", "aiohttp"} <= declared()


def test_every_third_party_import_of_tests_and_bench_is_declared_in_the_test_extra():
    dists_of = importlib.metadata.packages_distributions()
    want, undeclared = declared(), {}
    for mod, files in sorted(third_party_imports().items()):
        dists = {normalize(d) for d in dists_of.get(mod, [])}
        if not dists & want:
            undeclared[mod] = (sorted(dists) or ["not installed here"], sorted(set(files))[:3])
    assert not undeclared, f"imported, not declared in pyproject.toml's test extra (module: distributions, files): {undeclared}"


def test_the_other_interpreters_scripts_exist():
    assert all((ROOT / p).is_file() for p in OTHER_INTERPRETER)
