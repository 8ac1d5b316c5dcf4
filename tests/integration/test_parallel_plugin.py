"""tests/fixtures/parallel.py: under `make test`'s two xdist workers, every test that needs a
real engine (by its directory, its marker or an engine fixture) runs on one worker, so the
session's one vLLM and one llama-server start once and never beside each other."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fixtures.paths import ROOT

CASES = """
import os
from pathlib import Path

import pytest

OUT = Path(__file__).parent / "workers"


def seen(name):
    with open(OUT, "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")


@pytest.fixture
def vllm_server():
    return "a stand-in"


@pytest.fixture
def llamacpp_server():
    return "a stand-in"


def test_engine_by_fixture_vllm(vllm_server):
    seen("engine")


def test_engine_by_fixture_llamacpp(llamacpp_server):
    seen("engine")


@pytest.mark.realvllm
def test_engine_by_marker():
    seen("engine")


@pytest.mark.parametrize("i", range(6))
def test_other(i):
    seen("other")
"""


def test_engine_tests_share_one_worker(tmp_path):
    pytest.importorskip("xdist")  # a dev extra: under CI=true a skip fails the run
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.fixtures.parallel", "-n", "2", "--dist", "loadgroup"]
    argv += ["--rootdir", str(tmp_path), str(tmp_path / "test_cases.py")]
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in (tmp_path / "workers").read_text().splitlines()]
    engine_workers = {w for kind, w in rows if kind == "engine"}
    assert len([1 for kind, _ in rows if kind == "engine"]) == 3 and len(engine_workers) == 1, rows
    assert len(rows) == 9, rows  # the rest ran too, on whichever worker was free
