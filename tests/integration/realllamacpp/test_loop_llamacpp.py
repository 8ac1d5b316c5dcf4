"""The whole loop on real parts, on a real llama.cpp llama-server: the same exporter,
restarter, Prometheus and Alertmanager with the same committed files as the vLLM loop
(tests/fixtures/loop.py says what the test changes in them), and a raw-layer job
`llamacpp` for the server.

Phases: (1) two long generations in flight on a throttled server for 70 s: no hung alert
(neither LLMBackendHung nor the raw LlamaCppServerHung), no webhook. (2) The main thread
(the inference loop) stopped inside a decode with both requests in flight: /metrics
answers a frozen snapshot; the exporter says hung, LLMBackendHung fires, exactly one
restart through the same background-restart script, a new Process-Start-Time-Unix,
`recovered`, the alert resolves; the incident record holds gdb's native stack of the
inference thread (the main thread) inside the decode (handed from the test's ptrace freeze to a SIGSTOP when
the capture starts). (The raw layer's llama.cpp alert waits 2m, longer than a
long decode, so the restart comes first.) (3) Duplicates and wrong tokens.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tests.fixtures.loop import TOKEN, Loop, http_get
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.realllamacpp

BUSY_SECONDS = 70.0


def llamacpp_loop(tmp_path, srv, **kw) -> Loop:
    """The whole loop around a real llama-server: its raw rules' job and both hung alerts."""
    return Loop(tmp_path, srv.url, srv.host, srv.port, srv.launch_spec(), raw_job="llamacpp", hung_alerts=("LLMBackendHung", "LlamaCppServerHung"), **kw)


def slow_and_busy(srv, loop: Loop):
    """The loop started on ``srv``, then phase (1): two long completions on a throttled
    llama-server, watched for BUSY_SECONDS: slow, throttled, busy, and nothing hung. The
    load, still running."""
    loop.start(srv.pid)
    load = srv.load(2, max_tokens=8000)
    srv.wait_for(lambda c: c.get("requests_processing", 0) == 2, timeout=60)
    with srv.throttle(20, 500):
        loop.watch_busy(BUSY_SECONDS)
    return load


def test_the_whole_loop_on_llamacpp(llamacpp_server_factory, tmp_path):
    srv = llamacpp_server_factory()
    old_header = srv.start_header()
    # The raw layer's LlamaCppServerHung waits 2m (longer than a long decode): the restart on
    # the exporter's proof comes first, so it is watched (it must not fire while busy) but not
    # expected to fire before the restart.
    # The capture finds the server through a pids_command that first lets the test hand the
    # ptrace-frozen inference thread over to a SIGSTOP of the process: gdb cannot attach to a
    # thread the test's freezer holds (a real hang has no second tracer).
    ready, done = tmp_path / "capture-ready", tmp_path / "capture-done"
    handover = [sys.executable, str(ROOT / "tests" / "harness" / "handover_pids.py"), str(ready), str(done), str(tmp_path / "server.pid")]
    loop = llamacpp_loop(tmp_path, srv, restarter_backend={"capture": {"pids_command": handover}})
    load = None
    try:
        load = slow_and_busy(srv, loop)

        # --- (2) the inference loop stopped inside a decode: both layers, one restart, back ------------
        with srv.frozen_in_decode() as freeze:
            t0 = time.time() - (time.monotonic() - freeze.frozen_at)

            def hand_over() -> None:
                while not ready.exists():
                    time.sleep(0.02)
                assert freeze.thread is not None
                freeze.thread.hand_over_to_sigstop()
                done.write_text("done\n")

            helper = threading.Thread(target=hand_over, daemon=True)
            helper.start()
            action = loop.follow(t0, on_restarted=srv.adopt)
            helper.join(5)
        loop.print_timeline("recovery timeline on llama.cpp, seconds after the inference loop stopped (shipped defaults):")
        assert action["outcome"] == "recovered" and action["restart_seen"] is True, action
        v = action["verification"]
        assert (v["method"], v["state"], v["reads"]) == ("evidence", "hung", 2), v
        assert {"exporter says hung", "LLMBackendHung firing", "hung alerts resolved"} <= set(loop.timeline), loop.timeline
        assert srv.start_header() != old_header
        load.cancel()
        # The incident record: gdb's native stack of the inference thread, stopped inside a decode.
        index, shown = loop.incident(action)
        (dump,) = [s for s in index["stacks"] if s["pid"] == index["processes"][0]["pid"]]
        assert (dump["tool"], dump["outcome"]) == ("gdb", "ok"), index["stacks"]
        text = http_get(loop.restarter_url + f"{action['incident_url']}/files/{dump['file']}", TOKEN)[1]
        # gdb's thread 1 is the main thread (LWP = pid): the inference loop, stopped inside the
        # decode. The shipped build is stripped, so its own frames are addresses (maps-PID.txt
        # in the record turns them into offsets of the binary, for an unstripped build's symbols).
        main = text[text.find("Thread 1 ") :]
        assert f"(LWP {dump['pid']})" in main.splitlines()[0], main[:300]
        frames = [line for line in main.splitlines() if line.startswith("#")]
        assert len(frames) >= 5 and "__libc_start" in main, main
        assert f"maps-{dump['pid']}.txt" in index["files"]
        assert "thread " in shown

        # --- (3) duplicates, concurrent deliveries, wrong tokens ------------------------------------
        loop.after(action)
    finally:
        loop.stop()
        if load is not None:
            load.cancel()
