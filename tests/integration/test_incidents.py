"""The incident record the restarter writes before a restart, on real processes: a
simulated vLLM server is the backend the restarter reads, and a real process stands for
its engine (found through `capture.pid_file`): a stopped Python process read by the real
py-spy, a native one read by the real gdb and eu-stack. The captures that fail (a tool
missing, a pid that is no process, a process that exits during the dump, ptrace refused
by the kernel, a dump past the budget) are recorded as such, and the restart still
happens. No API key or token in any file of the record.

The real engines' records (a stopped vLLM EngineCore, a frozen llama.cpp) are checked in
the loop tests (tests/integration/realvllm/test_loop.py, realllamacpp/test_loop_llamacpp.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from llm_health.config.capture import Capture, Incidents
from llm_health.restarter.capture import resolve_tool
from llm_health.sim import servers as sim
from tests.fixtures.restarter import AUTH, TOKEN, RestartEffect, make_config, marker_target, metrics, post_json, sample, wait_done
from tests.integration.test_restarter_evidence import evidence_of, hung_alert

API_KEY = "sk-incident-test-4b7e19c2d0"
# A Python "engine": a named thread in a loop, the API key on its command line (as `vllm serve --api-key` has it).
# A Python engine with a named decode thread. It says "ready" once that thread runs its
# loop: its OS thread appears before Python has it in decode_loop, and a process stopped
# in between shows py-spy no decode_loop frame.
ENGINE = (
    "import threading, time, sys\n"
    "running = threading.Event()\n"
    "def decode_loop():\n"
    "    running.set()\n"
    "    while True: time.sleep(0.05)\n"
    "threading.Thread(target=decode_loop, name='decode-thread', daemon=True).start()\n"
    "running.wait()\n"
    "print('ready', flush=True)\n"
    "while True: time.sleep(0.05)\n"
)


@contextlib.contextmanager
def engine_process(argv: list[str]):
    python = argv[0] == sys.executable
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if python else subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if python:  # ENGINE: its decode thread in decode_loop
            assert p.stdout is not None and p.stdout.readline() == b"ready\n", "the engine process did not start its thread"
        deadline = time.monotonic() + 30
        while not python and proc_state(p.pid) != "S":  # native (sleep): in its sleep
            assert time.monotonic() < deadline, "the engine process did not reach its sleep"
            time.sleep(0.05)
        yield p
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait(10)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


async def restart_with_capture(sim_server, ticker, restarter_client, tmp_path, capture: Capture, api_key: str | None = None, served: str | None = None):
    """One hung simulated backend, one alert with its evidence, one restart: (action, index,
    record directory, metrics, client). ``served``: the /metrics payload the backend serves
    until it is restarted (a real engine's, frozen), in place of the simulated one."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    target = dataclasses.replace(marker_target("gpu0", s, marker), capture=capture, api_key=api_key)
    config = make_config(target, confirm_interval=0.2, incidents=Incidents(dir=str(tmp_path / "incidents"), keep=5))
    _, client = await restarter_client(config)
    effect = RestartEffect(marker, s)
    if served is not None:
        simulated = s.payload
        s.payload = lambda: served if effect.applied == 0 else simulated()  # type: ignore[method-assign]
    try:
        (a,) = (await post_json(client, hung_alert("gpu0", evidence_of(s))))["alerts"]
        action = await wait_done(client, a["action"], timeout=60)
    finally:
        await effect.stop()
    assert action["outcome"] == "recovered", action  # the restart happened, whatever the capture got
    assert effect.applied == 1
    resp = await client.get(action["incident_url"], headers=AUTH)
    assert resp.status == 200, await resp.text()
    index = await resp.json()
    return action, index, tmp_path / "incidents" / action["incident"], await metrics(client), client


def all_bytes(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(directory.iterdir()))


async def test_a_stopped_python_engine_is_read_by_py_spy_without_resuming_it(sim_server, ticker, restarter_client, tmp_path):
    if resolve_tool("py-spy") is None:
        pytest.fail("py-spy is missing: pip install 'llm-health[capture]' (scripts/install-test-deps.sh)")
    with engine_process([sys.executable, "-c", ENGINE, "--api-key", API_KEY]) as p:
        os.kill(p.pid, signal.SIGSTOP)
        (tmp_path / "engine.pid").write_text(f"{p.pid}\n")
        action, index, directory, m, client = await restart_with_capture(
            sim_server, ticker, restarter_client, tmp_path, Capture(pid_file=str(tmp_path / "engine.pid")), api_key=API_KEY
        )
        assert proc_state(p.pid) == "T"  # read, never resumed
    (dump,) = index["stacks"]
    assert (dump["pid"], dump["tool"], dump["outcome"]) == (p.pid, "py-spy", "ok"), dump
    assert "--nonblocking" in dump["argv"] and "--locals" not in dump["argv"]
    assert index["processes"][0]["state"] == "T" and index["processes"][0]["python"] is True
    text = (directory / dump["file"]).read_text()
    assert '"decode-thread"' in text and "decode_loop" in text, text
    assert index["capture"]["failures"] == []
    # the reads, their payloads and digests, the timeline
    assert [r["read"] for r in index["reads"]] == [1, 2]
    assert all((directory / r["payload_file"]).read_text().startswith("#") for r in index["reads"])
    assert {int(index["alert"]["evidence"])} == {e["digest"] for e in index["reads"][1]["engines"] if e["in_evidence"]}
    assert "vllm:generation_tokens_total" in index["reads"][1]["engines"][0]["unmoved"], index["reads"]  # the fields that did not move
    assert [t["event"] for t in index["timeline"]][-1] == "capture started"
    np = index["no_progress"]  # since the alert, plus the exporter's proof (verify.hung_after_seconds: 0.4 s here)
    assert np["at_least_seconds"] == round(np["since_alert_seconds"] + 0.4, 1), np
    # private, and no secret anywhere
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in directory.iterdir())
    blob = all_bytes(directory)
    assert API_KEY.encode() not in blob and TOKEN.encode() not in blob
    assert b"--api-key <redacted>" in blob  # the dump's command line, redacted
    # listed, linked, counted
    listed = await (await client.get("/incidents", headers=AUTH)).json()
    assert [i["id"] for i in listed["incidents"]] == [action["incident"]]
    assert (await client.get("/incidents")).status == 401
    assert (await client.get(f"/incidents/{action['incident']}/files/..%2Findex.json", headers=AUTH)).status == 404
    st = await (await client.get("/status", headers=AUTH)).json()
    assert st["backends"][0]["last_incident"] == action["incident_url"]
    assert sample(m, "llm_restarter_incidents_total", backend="gpu0") == 1.0
    assert action["capture_seconds"] is not None
    # the summary
    out = subprocess.run(
        [sys.executable, "-m", "llm_health", "incident", "show", action["incident"], "--dir", str(directory.parent)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "thread decode-thread" in out.stdout and "decode_loop" in out.stdout and "no progress for at least" in out.stdout, out.stdout
    assert "running" in out.stdout and API_KEY not in out.stdout


@pytest.mark.parametrize("tool", ["gdb", "eu-stack"])
async def test_a_native_engine_is_read_by_gdb_or_eu_stack(sim_server, ticker, restarter_client, tmp_path, tool):
    if resolve_tool(tool) is None:
        pytest.fail(f"{tool} is missing: apt-get install gdb elfutils (scripts/install-test-deps.sh)")
    with engine_process(["sleep", "1000"]) as p:
        os.kill(p.pid, signal.SIGSTOP)
        (tmp_path / "engine.pid").write_text(str(p.pid))
        _, index, directory, _, _ = await restart_with_capture(
            sim_server, ticker, restarter_client, tmp_path, Capture(pid_file=str(tmp_path / "engine.pid"), stacks=tool)
        )
        assert proc_state(p.pid) == "T"  # the dump left it stopped
    (dump,) = index["stacks"]
    assert (dump["tool"], dump["outcome"]) == (tool, "ok"), dump
    assert "nanosleep" in (directory / dump["file"]).read_text()
    assert "/sleep" in (directory / f"maps-{p.pid}.txt").read_text()  # its executable mappings, for a stripped binary's addresses


def script(path: Path, body: str) -> str:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return str(path)


# Dies with its target: what a dump sees when the engine exits under it.
KILLS_ITS_TARGET = "import os, signal, sys, time\npid = int(sys.argv[sys.argv.index('--pid') + 1])\nos.kill(pid, signal.SIGKILL)\ntime.sleep(0.5)\nprint('Error: No such process (os error 3)', file=sys.stderr)\nsys.exit(1)\n"
SLOW = "import os, sys, time\nopen(sys.argv[-1] + '.tool-pid', 'w')\ntime.sleep(600)\n"


@pytest.mark.parametrize("case", ["tool_missing", "no_process", "process_exited", "no_permission", "timeout"])
async def test_a_failed_capture_is_recorded_and_the_restart_happens(sim_server, ticker, restarter_client, tmp_path, case):
    pid_file = tmp_path / "engine.pid"
    cfg = Capture(pid_file=str(pid_file))
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(engine_process([sys.executable, "-c", ENGINE]))
        pid_file.write_text(str(p.pid))
        if case == "tool_missing":
            cfg = dataclasses.replace(cfg, py_spy=str(tmp_path / "no-such-py-spy"))
        elif case == "no_process":
            pid_file.write_text("4194303")  # above any pid this kernel hands out by default
        elif case == "process_exited":
            cfg = dataclasses.replace(cfg, py_spy=script(tmp_path / "py-spy", KILLS_ITS_TARGET))
        elif case == "no_permission":
            # The real py-spy, run as nobody: the kernel refuses ptrace on root's process.
            real = resolve_tool("py-spy")
            if real is None or shutil.which("setpriv") is None:
                pytest.fail("py-spy and setpriv are needed (scripts/install-test-deps.sh)")
            shared = Path(tempfile.mkdtemp(prefix="llm-health-capture-"))
            stack.callback(shutil.rmtree, shared, True)
            shared.chmod(0o755)
            binary = shared / "py-spy"
            shutil.copy(_pyenv_real() if "/shims/" in real else real, binary)
            binary.chmod(0o755)
            wrapper = f"import os, sys\nos.execvp('setpriv', ['setpriv', '--reuid=65534', '--regid=65534', '--clear-groups', {str(binary)!r}, *sys.argv[1:]])\n"
            cfg = dataclasses.replace(cfg, py_spy=script(tmp_path / "py-spy-as-nobody", wrapper))
        else:
            cfg = dataclasses.replace(cfg, py_spy=script(tmp_path / "py-spy", SLOW.replace("sys.argv[-1]", repr(str(tmp_path / "slow")))), budget=1.0)
        _, index, _, m, _ = await restart_with_capture(sim_server, ticker, restarter_client, tmp_path, cfg)
    reasons = [f["reason"] for f in index["capture"]["failures"]]
    assert reasons == [case], index["capture"]
    assert sample(m, "llm_restarter_capture_failures_total", reason=case) == 1.0
    assert sample(m, "llm_restarter_incidents_total", backend="gpu0") == 1.0
    assert not any(s["outcome"] == "ok" for s in index["stacks"])
    if case == "timeout":
        assert (tmp_path / "slow.tool-pid").exists()  # it ran, and was killed at the budget's end
        assert index["stacks"][0]["outcome"] == "timeout"


def _pyenv_real() -> str:
    """The binary a pyenv shim runs."""
    return subprocess.run(["pyenv", "which", "py-spy"], capture_output=True, text=True, check=True).stdout.strip()


async def test_without_a_pid_file_the_process_listening_on_the_port_is_found(sim_server, ticker, restarter_client, tmp_path):
    """No pid file, no command: the process listening on the port of a URL on this host;
    the simulated server runs inside the test process, so that is the test process."""
    cfg = Capture(stacks="gdb", gdb=str(tmp_path / "no-gdb"), tree=False)
    _, index, _, _, _ = await restart_with_capture(sim_server, ticker, restarter_client, tmp_path, cfg)
    assert index["capture"]["found_by"] == "the process listening on the backend's port"
    assert [p["pid"] for p in index["processes"]] == [os.getpid()]
    assert [f["reason"] for f in index["capture"]["failures"]] == ["tool_missing"]


@pytest.mark.parametrize("case", ["not_hung", "dry_run"])
async def test_no_capture_without_a_confirmed_restart(sim_server, ticker, restarter_client, tmp_path, case):
    """An alert whose backend moved since its evidence is refused, and a dry run restarts
    nothing: neither captures anything, though a process to capture is there."""
    s = await sim_server(scenario="hung")
    evidence = evidence_of(s)
    if case == "not_hung":
        sim.batch_job(s, running=4, tokens_per_second=20)  # it moves: busy, not hung
        ticker.append(s)
    with engine_process([sys.executable, "-c", ENGINE]) as p:
        (tmp_path / "engine.pid").write_text(str(p.pid))
        target = dataclasses.replace(marker_target("gpu0", s, tmp_path / "marker"), capture=Capture(pid_file=str(tmp_path / "engine.pid")))
        config = make_config(target, confirm_interval=0.2, incidents=Incidents(dir=str(tmp_path / "incidents")))
        _, client = await restarter_client(config, dry_run=case == "dry_run")
        (a,) = (await post_json(client, hung_alert("gpu0", evidence)))["alerts"]
        action = await wait_done(client, a["action"], timeout=60)
    assert (action["refusal"], action["outcome"]) == (("not_hung", None) if case == "not_hung" else (None, "dry_run")), action
    assert action["incident"] is None and action["capture_seconds"] is None
    listed = await (await client.get("/incidents", headers=AUTH)).json()
    assert listed["incidents"] == [] and not (tmp_path / "incidents").exists()
    assert sample(await metrics(client), "llm_restarter_incidents_total", backend="gpu0") == 0.0


async def test_the_record_keeps_a_real_vllm_payload_byte_for_byte(sim_server, ticker, restarter_client, tmp_path):
    """A real vLLM 0.32 payload (tests/data/vllm-real/stopped.prom: an engine stopped with 4
    requests running) served by the backend the restarter confirms hung: every payload file
    of the record is the served bytes, HELP "inter-token latency" included (a secret
    pattern once rewrote it to `<redacted>`). The API key, on no line of the payload, is
    still redacted wherever else it stood."""
    served = (Path(__file__).parents[1] / "data" / "vllm-real" / "stopped.prom").read_text(encoding="utf-8")
    assert "inter-token latency" in served
    _, index, directory, _, _ = await restart_with_capture(
        sim_server, ticker, restarter_client, tmp_path, Capture(enabled=False), api_key=API_KEY, served=served
    )
    files = [directory / r["payload_file"] for r in index["reads"] if r.get("payload_file")]
    assert len(files) == 2, index["reads"]
    for f in files:
        assert f.read_bytes() == served.encode("utf-8"), f
    assert API_KEY.encode() not in all_bytes(directory)
