"""`pip install '.[test]'` alone is enough to collect every test file: an empty venv made
from the Python that runs the tests (`make test`'s python3), none of this machine's
site-packages in it, the package and its `test` extra installed with the machine's pip
configuration (its indexes, its cache), then `pytest --collect-only` on every test file.

A test module that imports a package no extra declares fails here (a Debian python3
without hypothesis could not collect tests/unit/test_queue_age.py), not on a user's
machine. tests/unit/test_declared_imports.py checks the same of tests/ and bench/ by their
imports, in milliseconds; this one proves it by installing.

The source is copied (the files git knows, tracked or not ignored) to a temp dir first: pip
builds the package in place, and its build/ and egg-info must not appear in the checkout
the other tests run from.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a checkout holds beside its sources, when it is no git work tree.
NOT_SOURCES = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".venv", "artifacts", "node_modules")


def copy_sources(dest: Path) -> None:
    """The files git lists (tracked, and untracked not ignored), or the tree less NOT_SOURCES."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        shutil.copytree(ROOT, dest, ignore=NOT_SOURCES)
        return
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():  # a deleted file git still tracks is not copied
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def clean_env(venv: Path) -> dict[str, str]:
    """This environment without what points Python at other packages (PYTHONPATH, a venv)."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE"}}
    return {**env, "PYTHONNOUSERSITE": "1", "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"}


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{argv[:4]} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def test_the_test_extra_alone_collects_every_test_file(tmp_path: Path):
    src, venv = tmp_path / "src", tmp_path / "venv"
    copy_sources(src)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    env, py = clean_env(venv), str(venv / "bin" / "python")

    # Nothing of this machine's site-packages: the venv sees its own and the standard library.
    mine = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    seen = run([py, "-c", "import sys; print('\\n'.join(sys.path))"], src, env, 60).stdout.splitlines()
    assert not mine & set(seen), f"the venv sees this Python's site-packages: {sorted(mine & set(seen))}"
    before = {line.split("==")[0].lower() for line in run([py, "-m", "pip", "list", "--format=freeze"], src, env, 60).stdout.split()}
    assert before <= {"pip", "setuptools"}, f"the new venv is not empty: {sorted(before)}"

    # The machine's pip configuration (indexes, constraints, its cache). --no-compile: no .pyc
    # for every module installed (openai, pydantic, cryptography...); collection compiles
    # what it imports.
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile", ".[test]"], src, env, 540)

    files = sorted(p.relative_to(src).as_posix() for p in (src / "tests").rglob("test_*.py"))
    out = run([py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files], src, env, 300).stdout
    collected = {line.split("::")[0] for line in out.splitlines() if "::" in line}
    assert collected == set(files), f"files that collected no test: {sorted(set(files) - collected)}"
