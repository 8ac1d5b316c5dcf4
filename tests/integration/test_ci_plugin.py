"""tests/fixtures/ci.py: under CI=true a skip and an xfail (failed as expected or passed
unexpectedly) fail the run; without CI they are reported as usual."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.fixtures.paths import ROOT

CASES = """
import pytest

@pytest.mark.xfail(reason="known bug")
def test_xfailed():
    assert 0

@pytest.mark.xfail(reason="fixed already")
def test_xpassed():
    assert 1

def test_skipped():
    pytest.skip("no such tool")

def test_passes():
    assert 1
"""


def _run(tmp_path, ci: str) -> str:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(ROOT)}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.fixtures.ci",
        "--rootdir",
        str(tmp_path),
        str(tmp_path / "test_cases.py"),
    ]
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    return out.stdout.strip().splitlines()[-1]


def test_in_ci_skips_and_xfails_fail(tmp_path):
    assert _run(tmp_path, "true").startswith("3 failed, 1 passed")


def test_outside_ci_they_are_reported_as_usual(tmp_path):
    last = _run(tmp_path, "")
    assert "1 passed" in last and "1 skipped" in last and "1 xfailed" in last and "1 xpassed" in last
