"""The whole loop on real parts, on a real llama.cpp llama-server: the same exporter,
restarter, Prometheus and Alertmanager with the same committed files as the vLLM loop
(tests/fixtures/loop.py says what the test changes in them), and a raw-layer job
`llamacpp` for the server.

Phases: (1) two long generations in flight on a throttled server for 70 s: no hung alert
(neither LLMBackendHung nor the raw LlamaCppServerHung), no webhook. (2) The main thread
(the inference loop) stopped inside a decode with both requests in flight: /metrics
answers a frozen snapshot; the exporter says hung, LLMBackendHung fires, exactly one
restart through the same background-restart script, a new Process-Start-Time-Unix,
`recovered`, the alert resolves. (The raw layer's llama.cpp alert waits 2m, longer than a
long decode, so the restart comes first.) (3) Duplicates and wrong tokens.
"""

from __future__ import annotations

import time

import pytest

from tests.fixtures.loop import Loop

pytestmark = pytest.mark.realllamacpp

BUSY_SECONDS = 70.0


def test_the_whole_loop_on_llamacpp(llamacpp_server_factory, tmp_path):
    srv = llamacpp_server_factory()
    old_header = srv.start_header()
    # The raw layer's LlamaCppServerHung waits 2m (longer than a long decode): the restart on
    # the exporter's proof comes first, so it is watched (it must not fire while busy) but not
    # expected to fire before the restart.
    loop = Loop(tmp_path, srv.url, srv.host, srv.port, srv.launch_spec(), raw_job="llamacpp", hung_alerts=("LLMBackendHung", "LlamaCppServerHung"))
    load = None
    try:
        loop.start(srv.pid)

        # --- (1) slow, throttled, busy: nothing hung ---------------------------------------------
        load = srv.load(2, max_tokens=8000)
        srv.wait_for(lambda c: c.get("requests_processing", 0) == 2, timeout=60)
        with srv.throttle(20, 500):
            loop.watch_busy(BUSY_SECONDS)

        # --- (2) the inference loop stopped inside a decode: both layers, one restart, back ------------
        with srv.frozen_in_decode() as freeze:
            t0 = time.time() - (time.monotonic() - freeze.frozen_at)
            action = loop.follow(t0, on_restarted=srv.adopt)
        loop.print_timeline("recovery timeline on llama.cpp, seconds after the inference loop stopped (shipped defaults):")
        assert action["outcome"] == "recovered" and action["restart_seen"] is True, action
        v = action["verification"]
        assert (v["method"], v["state"], v["reads"]) == ("evidence", "hung", 2), v
        assert {"exporter says hung", "LLMBackendHung firing", "hung alerts resolved"} <= set(loop.timeline), loop.timeline
        assert srv.start_header() != old_header
        load.cancel()

        # --- (3) duplicates, concurrent deliveries, wrong tokens ------------------------------------
        loop.after(action)
    finally:
        loop.stop()
        if load is not None:
            load.cancel()
