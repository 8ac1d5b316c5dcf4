"""The shape of the package, checked: the core does no I/O, no module imports its way back
to itself, no Python file of the repository grows past 500 lines (the cap met by splitting:
no file may excuse itself), and `check` installs light.

The import graph is read from the source with the standard library's `ast`: every
`import` and `from ... import` anywhere in a module (inside functions too, so an import
cycle cannot hide there), resolved to package modules.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

from tests.fixtures.paths import ROOT

PACKAGE = ROOT / "exporter" / "llm_health"
MAX_LINES = 500


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules `name` imports (absolute names)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when there is one.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `llm_health.core.health.decide` -> the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_the_graph_is_read():
    g = graph()
    assert "llm_health.core.health" in g["llm_health.probe.monitor"]
    assert "llm_health.core.states" in g["llm_health.core.health"]


def test_no_import_cycles():
    g = graph()
    # Packages import nothing but their own docstrings; a cycle through one would be real.
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_core_imports_no_io_library():
    """`llm_health.core` is pure: neither aiohttp nor redis, even transitively."""
    code = (
        "import sys, pkgutil, importlib, llm_health.core as c\n"
        "for m in pkgutil.walk_packages(c.__path__, 'llm_health.core.'): importlib.import_module(m.name)\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'aiohttp', 'redis', 'yarl', 'multidict', 'uvloop', 'yaml'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_core_imports_only_core():
    g = graph()
    for name, deps in g.items():
        if name.startswith("llm_health.core"):
            outside = {d for d in deps if not d.startswith("llm_health.core")}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_product_rooms_do_not_import_each_other():
    """exporter, restarter and gate build on core, probe, store and config; only sim (the demo,
    the drills) and cli assemble them."""
    rooms = ("exporter", "restarter", "gate")
    g = graph()
    for name, deps in g.items():
        room = name.split(".")[1] if name.count(".") else ""
        if room in rooms:
            others = {d for d in deps if d.split(".")[1:2] and d.split(".")[1] in rooms and d.split(".")[1] != room}
            assert not others, f"{name} imports {sorted(others)}"


def test_check_needs_no_redis():
    """`llm-health check` installs light: the command's modules import no redis or uvloop."""
    code = (
        "import sys, llm_health.cli, llm_health.probe.check\nprint(sorted({n.split('.')[0] for n in sys.modules} & {'redis', 'hiredis', 'uvloop', 'bcrypt'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_nginx_lua_door_s_plan_needs_no_redis():
    """`llm-health nginx-lua` runs where only nginx will talk to Redis (compose/nginx-lua.Dockerfile
    installs the package without the `redis` extra)."""
    code = "import sys, llm_health.cli, llm_health.gate.nginx_lua\nprint(sorted({n.split('.')[0] for n in sys.modules} & {'redis', 'hiredis'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def python_files() -> list[Path]:
    """Every Python file of the repository: the package, tests, benchmarks, generators."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode == 0 and out.stdout.strip():
        return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]
    return sorted(p for d in ("exporter", "tests", "bench", "grafana", "deploy", "rules", "scripts") for p in (ROOT / d).rglob("*.py"))


def test_no_python_file_over_500_lines():
    long = [f"{path.relative_to(ROOT)} ({n} lines)" for path in python_files() if (n := path.read_text().count("\n")) > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines (split them): {long}"


def test_only_store_asks_which_redis_kind_it_has():
    """One server, Sentinel and Cluster differ in store/ and nowhere else (docs/architecture.md):
    no module outside it reads a deployment's `cluster` or `sentinel`, compares its `kind` (reporting it,
    as the `llm_redis_deployment_info` label does, is not a branch), or names RedisCluster."""
    found = []
    for name, path in modules().items():
        if name.startswith("llm_health.store"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in {"cluster", "sentinel", "RedisCluster"}:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    if (
                        isinstance(side, ast.Attribute)
                        and side.attr == "kind"
                        and isinstance(side.value, ast.Attribute)
                        and side.value.attr in {"deployment", "target"}
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} compares .{side.value.attr}.kind")
            elif isinstance(node, ast.alias) and node.name.split(".")[-1] == "RedisCluster":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports RedisCluster")
    assert not found, found


# The Redis kinds (store.deployment): one class each, in a module each, behind `Deployment`.
DEPLOYMENT_KINDS = ("llm_health.store.deployment_single", "llm_health.store.deployment_sentinel", "llm_health.store.deployment_cluster")
DEPLOYMENT_MODULES = ("llm_health.store.deployment", "llm_health.store.deployment_base", *DEPLOYMENT_KINDS)
KIND_FACTORIES = {"connect", "wrap", "deployment_class"}  # store.deployment: where the kind is chosen, once
KIND_WORDS = {"single", "sentinel", "cluster"}
KIND_CLASSES = {"RedisCluster", "Sentinel", "SentinelConnectionPool", "SingleDeployment", "SentinelDeployment", "ClusterDeployment"}


def kind_checks(tree: ast.AST) -> list[str]:
    """Where a function (a factory of KIND_FACTORIES aside) asks which Redis kind it runs
    on: it reads a `cluster` attribute, compares a `kind` or a `sentinel` (`is None`) or
    a kind's name, or tests an object against a kind's class (isinstance, issubclass)."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in KIND_FACTORIES:
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and node.attr == "cluster":
                found.append(f"{fn.name}:{node.lineno} reads .cluster")
            elif isinstance(node, ast.Compare):
                sides = [n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else None for n in (node.left, *node.comparators)]
                words = [n.value for n in (node.left, *node.comparators) if isinstance(n, ast.Constant)]
                if {"kind", "sentinel"} & set(sides) or KIND_WORDS & set(words):
                    found.append(f"{fn.name}:{node.lineno} compares {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"isinstance", "issubclass"} and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} | {
                    n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)
                }
                if names & KIND_CLASSES:
                    found.append(f"{fn.name}:{node.lineno} tests a kind's class")
    return found


def test_kind_checks_finds_the_three_ways_the_one_class_asked():
    """The rule below would have caught the one Deployment class this replaced: it asked
    `self.cluster`, `self.sentinel is not None` and `self.kind == "single"`."""
    one_class = (
        "class Deployment:\n"
        "    def tag(self, part):\n        return '{' + part + '}' if self.cluster else part\n"
        "    async def primaries(self):\n        if self.sentinel is not None:\n            return []\n"
        "    async def startup_warnings(self):\n        if self.kind == 'single':\n            return []\n"
        "    def bulk(self):\n        return isinstance(self.client, RedisCluster)\n"
        "def connect(url):\n    return Deployment() if parse(url).kind == 'single' else None\n"
    )
    assert [f.split(":")[0] for f in kind_checks(ast.parse(one_class))] == ["tag", "primaries", "startup_warnings", "bulk"]


def test_no_deployment_method_asks_which_redis_kind_it_is():
    """One class per Redis kind (docs/architecture.md, the store room): what differs is a
    method of the kind's class, and the kind is asked only where a Deployment is made
    (store.deployment's factories), never inside a method."""
    mods = modules()
    found = [f"{name}: {where}" for name in DEPLOYMENT_MODULES for where in kind_checks(ast.parse(mods[name].read_text()))]
    assert not found, found


def test_each_redis_kind_is_a_deployment_class_of_its_own_chosen_by_scheme():
    from llm_health.store import deployment, target
    from llm_health.store.deployment_base import Deployment

    assert set(deployment.BY_SCHEME) == set(target.ALL_SCHEMES)
    assert [k.kind for k in deployment.KINDS] == list(target.KINDS)
    assert sorted(k.__module__ for k in deployment.KINDS) == sorted(DEPLOYMENT_KINDS)  # a module each
    for kind in deployment.KINDS:
        assert issubclass(kind, Deployment) and not inspect.isabstract(kind), kind
        assert {deployment.BY_SCHEME[s] for s in kind.schemes} == {kind}


FAST_PATHS_HEADING = "## Fast paths and their library counterparts"


def fast_path_rows() -> list[dict[str, str]]:
    """docs/architecture.md's table of fast paths, a dict per row (cells without backticks)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split(FAST_PATHS_HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip().strip("`") for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_every_fast_path_has_its_seam_its_benchmark_line_and_a_parity_test():
    """Each row of docs/architecture.md's fast-path table: the module is there and named
    `fast_*`; its seam is a typing.Protocol; the reason names a benchmark section; the
    parity test is there and imports the fast path. And every `fast_*` module of the
    package has its row."""
    import importlib

    from bench.sections import SECTIONS

    rows = fast_path_rows()
    assert len(rows) >= 4, rows
    for row in rows:
        path = PACKAGE / row["fast path"]
        assert path.is_file() and path.name.startswith("fast_"), row["fast path"]
        module_name, _, protocol_name = row["seam (Protocol)"].rpartition(".")
        protocol = getattr(importlib.import_module("llm_health." + module_name), protocol_name)
        assert getattr(protocol, "_is_protocol", False), f"{row['seam (Protocol)']} is no typing.Protocol"
        why = row["why it exists (docs/benchmarks.md)"]
        assert any(s.name in why for s in SECTIONS), f"{row['fast path']}: no benchmark section named in {why!r}"
        test = ROOT / row["parity test"]
        assert test.is_file(), row["parity test"]
        fast = "llm_health." + row["fast path"].removesuffix(".py").replace("/", ".")
        imported = set()
        for node in ast.walk(ast.parse(test.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        assert any(name == fast or name.startswith(fast + ".") for name in imported), f"{row['parity test']} does not import {fast}"
    listed = {row["fast path"] for row in rows}
    found = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("fast_*.py")}
    assert found == listed, f"fast_* modules without a row, or rows without a module: {sorted(found ^ listed)}"
