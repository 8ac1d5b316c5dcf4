"""The files of this repository a module's code runs: its import closure, computed from the
source (ast), so a section of docs/benchmarks.md measures what its benchmark imports and no
hand list can miss a module that moved or a new one it uses (bench/sections.py).

Every `import` and `from ... import` anywhere in a file counts (inside functions too, and
under TYPE_CHECKING: a superset is only ever too careful), each package's `__init__.py` on
the way, and a module a list literal runs as `"-m", "name"` (a subprocess of
`python -m llm_health ...`: its `__main__`). Modules resolve under the repository root
(`bench`, `tests`) and `exporter/` (`llm_health`); anything else (the standard library,
installed packages) is not this repository's and is left out.
"""

from __future__ import annotations

import ast
import functools
import itertools
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (ROOT, ROOT / "exporter")  # where a top-level package of this repository lives


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    for base in SOURCES:
        for candidate in (base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return candidate
    return None


def _files_of(name: str) -> list[Path]:
    """The files `import name` runs here: each package's __init__.py on the way and the module
    (a package's own __init__.py, and its __main__.py if asked for by -m is separate)."""
    parts = name.split(".")
    found = [f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i]))) is not None]
    return found if _module_file(name) is not None else []


def _module_name(path: Path) -> tuple[str, bool]:
    """(the dotted name of a repository file, whether it is a package's __init__)."""
    base = next(b for b in sorted(SOURCES, key=lambda b: -len(b.parts)) if path.is_relative_to(b))
    parts = list(path.relative_to(base).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def _names(path: Path) -> set[str]:
    """Every module name the file imports (resolved or not), `from a import b` as both `a`
    and `a.b` (b may be a module), and `-m` targets with their `__main__`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    own, package = _module_name(path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = own.split(".") if package else own.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.List | ast.Tuple):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            for flag, target in itertools.pairwise(items):
                if flag == "-m" and isinstance(target, str):
                    out.update((target, f"{target}.__main__"))
    return {n for n in out if n}


@functools.cache
def closure(*start: str) -> tuple[str, ...]:
    """The repository-relative paths of every file the modules `start` (file paths relative to
    the root) run by importing, themselves included, sorted."""
    todo = [ROOT / s for s in start]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _names(path):
            todo.extend(_files_of(name))
    return tuple(sorted(str(p.relative_to(ROOT)) for p in seen))


def missing(paths: Iterable[str]) -> list[str]:
    """The paths (relative to the root) that do not exist here."""
    return [p for p in paths if not (ROOT / p).exists()]
