"""`llm-health demo` as a newcomer runs it (`make demo`): the CLI in a subprocess, in its
own session, until every line of its summary holds (`--until-proven`, at most 120 s). The
summary's counts are checked, and after it exits no process it started is left: neither
the pids it printed (redis-server, Prometheus, Alertmanager) nor anything in its process
group."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llm_health.sim import launch

pytestmark = pytest.mark.skipif(
    not (shutil.which("redis-server") and launch.PROMETHEUS and launch.ALERTMANAGER),
    reason="the demo's whole run needs redis-server, prometheus and prometheus-alertmanager (make deps)",
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _in_group(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def test_demo_proves_every_part_and_leaves_no_process():
    port = launch.free_port()
    argv = [sys.executable, "-m", "llm_health", "demo", "--duration", "120", "--until-proven", "--web.listen-address", f"127.0.0.1:{port}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"the demo did not end:\n{out[-6000:]}")
    assert proc.returncode == 0, out[-6000:]

    started = dict(re.findall(r"(\S+) pid (\d+)", re.search(r"processes started: (.*)", out).group(1)))
    assert set(started) == {"redis-server", "prometheus", "alertmanager"}, out[:2000]
    assert re.search(r"stopped: .*redis-server pid", out)
    assert [name for name, pid in started.items() if _alive(int(pid))] == []
    assert _in_group(proc.pid) == []

    summary = out[out.index("what this run proved:") :]
    assert "  ok  requests sent to busy servers: 0" in summary
    assert "  ok  false restarts: 0" in summary
    # The fleet has two hung backends (one engine, and one rank of a data-parallel pair): each restarted once, back healthy.
    assert "  ok  hung engines restarted: 2 of 2 hung (dp-one-hung, hung; restarts each: 1, 1; back and healthy: 2)" in summary
    refused = int(re.search(r"ok  late retries refused: (\d+) \(late retries admitted: 0\)", summary).group(1))
    assert refused >= 1
    assert "  ok  double lease holders: 0" in summary
    # The engine route: refused while the overloaded engine's own queue was older than the deadline, admitted after it drained.
    assert re.search(
        r"ok  fresh requests refused on the engine's queue age: [1-9]\d* \(reject_age_beats_slack, engine queue_age_ms \d+-\d+ at refusal\); admitted again after it drained: [1-9]",
        summary,
    ), summary
    assert re.search(r"ok  crashed job's lease \(job-crash on g\d\): taken by job-\d+ \(via \w+\)", summary)
    assert summary.rstrip().splitlines()[-2:] == ["verdict: PASS", summary.rstrip().splitlines()[-1]], summary  # nothing logged after it but `stopped:`
    assert summary.rstrip().splitlines()[-1].startswith("stopped: ")
    # the view showed every part, with the series the exporter read from Redis
    for section in ("== engines", "== GPU pool", "== admission route", "== alerts and restarts"):
        assert section in out
    assert "llm_gpu_pool_size 4" in out
    assert "LLMBackendHung fired" in out and "[done, recovered]" in out
