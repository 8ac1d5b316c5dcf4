"""The test harness itself: a pytest stopped with SIGTERM stops the servers its fixtures
started (tests/fixtures/procs.py), as it does on Ctrl-C; a harness that signals an
engine's pids never signals a later process given one of them (pid numbers wrap)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.fixtures.paths import ROOT, inner_pytest
from tests.fixtures.stack import wait_until
from tests.harness.processes import proc_state, signal_same, start_time

INNER = """
import subprocess, time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def server():
    proc = subprocess.Popen(["sleep", "300"])
    (HERE / "server.pid").write_text(str(proc.pid))
    yield proc
    proc.terminate()
    proc.wait()
    (HERE / "torn-down").write_text("yes")


def test_runs_long(server):
    (HERE / "running").write_text("yes")
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def test_sigterm_tears_the_fixtures_down(tmp_path: Path):
    (tmp_path / "test_inner.py").write_text(INNER)
    argv = inner_pytest("tests.fixtures.procs", tmp_path, str(tmp_path / "test_inner.py"))
    pytest_proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid = None
    try:
        wait_until(lambda: (tmp_path / "running").exists() or pytest_proc.poll() is not None, timeout=60, what="the inner test running")
        assert pytest_proc.poll() is None, pytest_proc.communicate()[0]
        pid = int((tmp_path / "server.pid").read_text())
        pytest_proc.send_signal(signal.SIGTERM)
        out = pytest_proc.communicate(timeout=60)[0]
        assert (tmp_path / "torn-down").exists(), out
        assert not _alive(pid), f"the fixture's server (pid {pid}) outlived the SIGTERMed pytest:\n{out}"
        assert pytest_proc.returncode != 0, out  # an interrupted run never reads as passed
    finally:
        if pytest_proc.poll() is None:
            pytest_proc.kill()
            pytest_proc.wait()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_pid_given_to_another_process_is_not_signalled():
    """The throttle's stop, or its last SIGSTOP when frozen, reaches a pid only while it is
    the process the harness found: a pid whose start time differs is a later process (a
    CI run saw a shared Redis node stopped for good, a stranger's signal the likely cause)."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        wait_until(lambda: proc_state(proc.pid) == "S", timeout=10, what="sleep in its sleep")
        born = start_time(proc.pid)
        assert born is not None
        assert not signal_same(proc.pid, born + 1, signal.SIGSTOP)  # as if the pid had been reused
        assert proc_state(proc.pid) == "S"
        assert signal_same(proc.pid, born, signal.SIGSTOP)
        wait_until(lambda: proc_state(proc.pid) == "T", timeout=10, what="the stop")
        assert signal_same(proc.pid, born, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait()
    assert start_time(proc.pid) is None and not signal_same(proc.pid, born, signal.SIGCONT)
