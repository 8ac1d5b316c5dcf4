"""`llm-health check` and the exporter against a REAL llama.cpp `llama-server --metrics`
(build b11434, CPU) on this machine.

One shared server (an 88 MB random-weight llama, 2 slots of 8192 tokens, 512-token
decodes, one compute thread). Hangs are real: the server's main thread (its inference
loop) is ptrace-stopped, inside a decode or outside one; the whole process is SIGSTOPped.
Slow servers are real: the process is duty-cycled with SIGSTOP/SIGCONT. Every claim about
requests is checked against llama.cpp's own word: its series read with a regex
(tests/harness/llamacpp.py) and the tasks its log says it launched, never llm_health's.

Each test prints its figures on a line starting `LLAMACPP-FIGURES` (run with -s to see
them). Only the last test restarts the shared server. About 80 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from llm_health.core.engines import Limits
from llm_health.core.health import Observation, Settings, decide
from llm_health.probe.client import BackendClient
from llm_health.probe.pieces import read_fetched
from tests.harness import llamacpp as harness
from tests.harness.least_conn_proxy import LeastConnProxy, one_round_in

pytestmark = pytest.mark.realllamacpp

CHECK_TIMEOUT = 240
ARTIFACTS = harness.REPO / "artifacts" / "llamacpp-real"


def figures(test: str, **values: object) -> None:
    """One line of measured figures for the benchmark docs (`pytest -s`)."""
    print(f"\nLLAMACPP-FIGURES {json.dumps({'test': test, **values}, default=str)}", flush=True)


def check(url: str, *args: str, timeout: float = CHECK_TIMEOUT) -> tuple[int, dict]:
    """`llm-health check URL --kind vllm ARGS --json` (kind vllm: any engine with /metrics)."""
    rc, result, out = harness.llm_health_check(url, "--kind", "vllm", *args, timeout=timeout)
    assert result is not None, f"no JSON line from llm-health check (rc {rc}):\n{out[-3000:]}"
    return rc, result


def save(srv: harness.LlamaServer, name: str) -> dict[str, float]:
    """llama.cpp's series now; the payload kept as artifacts/llamacpp-real/NAME.prom."""
    text = srv.metrics_text()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"{name}.prom").write_text(text)
    return harness.llamacpp_series(text)


class Exporter:
    """`python -m llm_health serve` watching one llama-server (backend `lcpp`), with short
    settings: a round a second, hung after 3 s, /metrics read with a 2 s timeout."""

    def __init__(self, llm_health, tmp_path: Path, url: str, probe_interval: str = "60s"):
        cfg = tmp_path / "llm-health.yml"
        cfg.write_text(
            "global:\n"
            "  interval: 1s\n"
            "  hung_after_seconds: 3\n"
            f"  probe_interval: {probe_interval}\n"
            "  probe_timeout: 10s\n"
            "  metrics_timeout: 2s\n"
            "  models_timeout: 2s\n"
            "backends:\n"
            f"  - name: lcpp\n    url: {url}\n    kind: vllm\n"
        )
        self.started = time.monotonic()
        self.proc = llm_health("serve", "--config.file", str(cfg)).wait_ready()
        self.seen: list[tuple[int, str]] = []  # (rounds, state) of every /status read

    def status(self) -> dict:
        with urllib.request.urlopen(self.proc.url + "/status", timeout=10) as r:
            return json.loads(r.read())["backends"][0]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.proc.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def wait(self, pred, what: str, timeout: float = 60) -> dict:
        """Poll /status until pred(status); return it. Every state seen is kept in `seen`."""
        deadline = time.monotonic() + timeout
        st: dict = {}
        while time.monotonic() < deadline:
            st = self.status()
            self.seen.append((st["rounds"], st["state"]))
            if pred(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"exporter: {what} not reached in {timeout}s; last status {st}\n{self.proc.output()}")

    def wait_state(self, state: str, timeout: float = 60) -> dict:
        return self.wait(lambda st: st["state"] == state, f"state {state}", timeout)

    def wait_rounds(self, n: int, timeout: float = 120) -> dict:
        start = self.status()["rounds"]
        return self.wait(lambda st: st["rounds"] >= start + n, f"{n} more rounds", timeout)


@pytest.fixture
def srv(idle_llamacpp_server: harness.LlamaServer) -> harness.LlamaServer:
    return idle_llamacpp_server


def test_idle_exactly_one_probe_counted_by_llamacpp(srv, llm_health, tmp_path):
    before, launched = save(srv, "idle"), srv.settled_launches()
    rc, r = check(srv.url, "--interval", "1", "--rounds", "3", "--hung-after", "5", "--probe-timeout", "20")
    after, launched_after = srv.counters(), srv.settled_launches()
    assert (rc, r["state"], r["profile"]) == (0, "idle", "llamacpp"), r
    assert r["probe_sent"] is True and r["probes_sent"] == 1, r
    # llama.cpp served exactly one task: one slot launch, one decode, one generated token
    assert launched_after - launched == 1
    assert after["n_decode_total"] - before["n_decode_total"] == 1
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == 1
    assert after["requests_processing"] == 0

    exp = Exporter(llm_health, tmp_path, srv.url)
    st = exp.wait_state("idle")
    to_idle = time.monotonic() - exp.started  # process start included
    exp.wait_rounds(3)
    text = exp.metrics()
    assert 'llm_backend_state{backend="lcpp",state="idle"} 1.0' in text, text
    assert 'llm_backend_info{backend="lcpp",kind="engine",profile="llamacpp"} 1.0' in text, text
    assert 'llm_backend_probes_total{backend="lcpp",result="ok"} 1.0' in text, text  # one probe per probe_interval (60 s)
    assert srv.settled_launches() - launched_after == 1
    assert all(s == "idle" for rounds, s in exp.seen if rounds), exp.seen
    figures("idle", check_seconds=r["seconds"], check_reason=r["reason"], exporter_seconds_to_idle=round(to_idle, 2), exporter_reason=st["reason"])


def test_busy_check_and_exporter_send_nothing(srv, llm_health, tmp_path):
    """3 long generations on 2 slots: 2 processing, 1 deferred. Busy, and no request of
    ours arrives: a proxy in front records none, and llama.cpp launched no task and
    deferred no other (a probe would be deferred behind the full slots)."""
    load = srv.load(3, max_tokens=8000)
    try:
        srv.wait_for(lambda c: c["requests_processing"] == 2 and c["requests_deferred"] == 1)
        srv.wait_moving()
        before, launched = save(srv, "busy"), srv.settled_launches()
        with LeastConnProxy([srv.url]) as rec:
            rc, r = check(rec.url, "--interval", "1", "--rounds", "6", "--hung-after", "3", "--probe-timeout", "10")
            exp = Exporter(llm_health, tmp_path, rec.url)
            st = exp.wait_state("busy")
            exp.wait_rounds(5)
            st = exp.status()
            posts = rec.count("POST")
            reads = rec.count("GET", "/metrics")
            slots = rec.count("GET", "/slots")
        after = srv.counters()
        assert srv.settled_launches() == launched
        assert after["requests_deferred"] == 1 and after["requests_processing"] == 2
        assert not load.done(), "the load ended during the test: nothing left to be busy with"
    finally:
        load.cancel()
    assert (rc, r["state"]) == (0, "busy"), r
    assert r["probe_sent"] is False and r["running"] == 2 and r["waiting"] == 1, r
    assert r["steps_per_second"] and r["steps_per_second"] > 0, r
    assert posts == 0, rec.requests
    assert slots == 0, rec.requests  # a moving server is never read for hang evidence
    assert st["state"] == "busy" and st["probes_sent"] == 0, st
    assert {s for _, s in exp.seen} <= {"unknown", "busy"}, exp.seen
    assert after["n_decode_total"] > before["n_decode_total"]
    figures(
        "busy",
        check_seconds=r["seconds"],
        check_steps_per_second=round(r["steps_per_second"], 1),
        exporter_rounds=st["rounds"],
        metrics_reads=reads,
        exporter_metrics_seconds=st["metrics_seconds"],
    )


def test_throttled_server_is_busy_never_hung(srv):
    """The whole process runs 20 ms of every 500 ms: about one decode a second."""
    load = srv.load(2, max_tokens=8000)
    try:
        srv.wait_moving()
        with srv.throttle(run_ms=20, period_ms=500):
            results = [check(srv.url, "--interval", "1", "--rounds", "8", "--hung-after", "5", "--probe-timeout", "10") for _ in range(2)]
    finally:
        load.cancel()
    for rc, r in results:
        assert (rc, r["state"]) == (0, "busy"), r
        assert r["probe_sent"] is False, r
        assert 0 < r["steps_per_second"] < 20, r  # slow, but moving
    figures("throttled", steps_per_second=[round(r["steps_per_second"], 2) for _, r in results], check_seconds=[r["seconds"] for _, r in results])


def test_long_prompt_never_hung(srv):
    """A 4096-token prompt in 512-token decodes: prompt_tokens_total and
    tokens_predicted_total stand still until it ends; n_decode_total moves once a decode."""
    before = save(srv, "before-long-prompt")
    load = srv.load(1, max_tokens=4, prompt=harness.prompt_ids(4096, seed=time.time_ns() % 100_000), cache_prompt=False)
    checks: list[tuple[int, dict, bool]] = []
    decodes: list[float] = []
    try:
        srv.wait_for(lambda c: c["requests_processing"] == 1, interval=0.05)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            rc, r = check(srv.url, "--interval", "1", "--rounds", "15", "--hung-after", "10", "--probe-timeout", "10")
            now = srv.counters()
            in_prompt = now["prompt_tokens_total"] == before["prompt_tokens_total"]
            checks.append((rc, r, in_prompt))
            decodes.append(now["n_decode_total"] - before["n_decode_total"])
            if not in_prompt:
                break
        load.wait(300)
    finally:
        load.cancel()
    during = [(rc, r) for rc, r, p in checks if p]
    assert during, f"the prompt ended before a check ran: {checks}"
    # Checks that ran inside the prompt: busy, nothing sent. The last check may find the
    # request finished (idle, and probe it); no check, whenever it ran, may say hung.
    for rc, r in during:
        assert (rc, r["state"]) == (0, "busy"), r
        assert r["probe_sent"] is False, r
    for rc, r, _ in checks:
        assert rc != 1 and r["state"] != "hung", r
    after = srv.counters()
    # The prompt's 4096 ids, counted as given: llama-server adds no BOS token to a prompt
    # of token ids (measured on b11434: a 300-id prompt moves prompt_tokens_total by
    # exactly 300, a text prompt "Hello" by 2). A check that ran past the request probed
    # the idle server, and each probe's short text prompt adds a few tokens more.
    extra = after["prompt_tokens_total"] - before["prompt_tokens_total"] - 4096
    probes = sum(r.get("probes_sent", 0) for _, r, _ in checks)
    assert (extra == 0) if probes == 0 else (0 <= extra <= 4 * probes), (extra, checks)
    assert load.streams[0].status == 200 and load.streams[0].error is None, load.streams
    figures("long_prompt", checks_inside_prompt=len(during), decodes_seen=decodes, steps_per_second=[round(r["steps_per_second"] or 0, 2) for _, r in during])


def test_frozen_inside_decode_is_hung(srv, llm_health, tmp_path):
    """The main thread stopped inside a decode with 2 requests in flight: /metrics answers
    from a frozen snapshot (requests_processing 2, n_decode_total flat), /health 200, no
    token flows. The exporter that watched it busy says hung; check exits 1."""
    load = srv.load(2, max_tokens=8000)
    try:
        srv.wait_moving()
        exp = Exporter(llm_health, tmp_path, srv.url)
        exp.wait_state("busy")
        watched = len(exp.seen)
        with srv.frozen_in_decode() as fz:
            events = load.events
            st = exp.wait_state("hung", timeout=60)
            exporter_to_hung = time.monotonic() - fz.frozen_at
            rc, r = check(srv.url, "--interval", "1", "--rounds", "8", "--hung-after", "3", "--probe-timeout", "5", "--metrics-timeout", "5")
            frozen = save(srv, "frozen-in-decode")
            health = harness.answers(srv.url + "/health", 10)
            events_while_frozen = load.events - events
        # thawed: the same requests go on
        srv.wait_moving()
        st_after = exp.wait_state("busy")
    finally:
        load.cancel()
    assert (rc, r["state"]) == (1, "hung"), r
    assert 3 <= r["rounds"] <= 4, r  # a first reading, then two rounds without progress spanning 3 s
    assert r["probe_sent"] is False and r["running"] == 2, r
    assert st["probes_sent"] == 0, st
    assert frozen["requests_processing"] == 2 and frozen["n_decode_total"] == fz.snapshot["n_decode_total"], (frozen, fz.snapshot)
    assert health == 200 and events_while_frozen == 0
    assert {s for _, s in exp.seen[:watched]} <= {"unknown", "busy"}, exp.seen
    assert "stalled" in {s for _, s in exp.seen[watched:]}, exp.seen  # one round without progress first
    figures(
        "frozen_inside_decode",
        freeze_attempts=fz.attempts,
        exporter_seconds_freeze_to_hung=round(exporter_to_hung, 2),
        check_seconds_to_hung=r["seconds"],
        check_rounds=r["rounds"],
        exporter_state_after_thaw=st_after["state"],
    )


def test_frozen_outside_decode_while_idle(srv, llm_health, tmp_path):
    """The main thread stopped while idle (waiting for a task): /metrics never answers (it
    is a task on that loop's queue), /health does. The exporter that watched it idle says
    unresponsive, then hung after two timed-out reads spanning hung_after; a check started
    on the stuck server has no reading to tell the engine by and says unknown (exit 3),
    never hung; once the thread runs again the exporter probes it and says idle."""
    exp = Exporter(llm_health, tmp_path, srv.url)
    exp.wait_state("idle")
    exp.wait_rounds(2)
    with srv.frozen_main() as ft:
        frozen_at = time.monotonic()
        assert harness.answers(srv.url + "/metrics", 3) is None
        assert harness.answers(srv.url + "/health", 10) == 200
        st_first = exp.wait(lambda st: st["state"] != "idle", "a state other than idle")
        st = exp.wait_state("hung", timeout=60)
        exporter_to_hung = time.monotonic() - frozen_at
        rc, r = check(srv.url, "--interval", "1", "--rounds", "3", "--hung-after", "3", "--probe-timeout", "5", "--metrics-timeout", "2")
        assert ft.frozen
    thawed_at = time.monotonic()
    st_back = exp.wait_state("idle", timeout=60)
    exporter_to_idle = time.monotonic() - thawed_at
    assert st_first["state"] == "unresponsive", st_first
    assert "llama.cpp /metrics timeout" in st["reason"], st
    # /slots is a task on the same stopped loop: its timeout is said as hang evidence.
    assert "/slots timeout after 2s: the inference loop takes no task (hang evidence)" in st["reason"], st
    assert (rc, r["state"]) == (3, "unknown"), r
    assert r["probe_sent"] is False, r
    assert st_back["probes_sent"] == 2, st_back  # the first probe, and one to confirm the loop is back
    srv.wait_idle()
    figures(
        "frozen_outside_decode_idle",
        exporter_seconds_freeze_to_hung=round(exporter_to_hung, 2),
        exporter_seconds_thaw_to_idle=round(exporter_to_idle, 2),
        check_state=r["state"],
        check_seconds=r["seconds"],
        hung_reason=st["reason"],
    )


def test_whole_process_stopped_is_down_never_hung(srv, llm_health, tmp_path):
    """SIGSTOP: the kernel still accepts connections, nothing answers, /health included."""
    exp = Exporter(llm_health, tmp_path, srv.url)
    exp.wait_state("idle")
    srv.stop()
    try:
        stopped_at = time.monotonic()
        assert harness.answers(srv.url + "/health", 2) is None
        rc, r = check(srv.url, "--interval", "1", "--rounds", "3", "--hung-after", "3", "--probe-timeout", "5", "--metrics-timeout", "2")
        st = exp.wait_state("down", timeout=60)
        exporter_to_down = time.monotonic() - stopped_at
        exp.wait_rounds(2)
        st_evidence = exp.wait(lambda s: "(hang evidence)" in s["reason"], "the /slots timeout said as hang evidence")
        evidence = exp.metrics()
    finally:
        srv.cont()
    st_back = exp.wait_state("idle", timeout=60)
    assert (rc, r["state"]) == (2, "down"), r
    assert r["rounds"] == 1 and r["probe_sent"] is False, r
    assert "hung" not in {s for _, s in exp.seen}, exp.seen
    assert st["state"] == "down" and st_back["probes_sent"] == 1, (st, st_back)
    # The exporter had read this server idle: its /slots (a task on the stopped loop) timed
    # out, reported as hang evidence in the reason and counted.
    assert st_evidence["evidence"] == "/slots timeout after 2s" and st_evidence["state"] == "down", st_evidence
    assert re.search(r'^llm_backend_evidence_reads_total\{backend="lcpp",endpoint="/slots",result="timeout"\} [1-9]', evidence, re.M), evidence
    figures("whole_process_stopped", check_seconds=r["seconds"], exporter_seconds_stop_to_down=round(exporter_to_down, 2), reason=st["reason"])


async def _read(client: BackendClient):
    fetched = await client.metrics()
    assert fetched.parts is not None, fetched
    return await read_fetched(fetched.parts, fetched.start_header, Limits())


def test_start_header_tells_a_restart_the_counters_hide(llamacpp_server_factory):
    """llama.cpp has no start-time series. The client reads the Process-Start-Time-Unix
    header as the start: a new process whose counters are already past the old ones'
    (no counter went backwards) is still a restart."""
    srv = llamacpp_server_factory()
    srv.completion(1, "ok")

    async def main() -> tuple:
        async with aiohttp.ClientSession() as session:
            client = BackendClient(session, srv.url)
            first = await _read(client)
            old_header = srv.start_header()
            srv.restart()
            for _ in range(3):
                srv.completion(8, "Hello there")
            second = await _read(client)
            return first, second, old_header, srv.start_header()

    first, second, old_header, new_header = asyncio.run(main())
    e1, e2 = next(iter(first.engines.values())), next(iter(second.engines.values()))
    # nothing went backwards (the speculative-decoding counters stay 0 with no draft model)
    assert all(b >= a for a, b in zip(e1.counters, e2.counters)) and e2.counters[0] > e1.counters[0], (e1.counters, e2.counters)
    assert first.start_time == old_header / 1e6 and second.start_time == new_header / 1e6 and new_header != old_header
    s = Settings(hung_after_seconds=3, probe_interval=0)
    v1 = decide(None, Observation(now=0.0, reading=first), s)
    v2 = decide(v1.memory, Observation(now=1.0, reading=second), s)
    assert (v2.state, v2.restarted) == ("restarted", True), v2
    assert "process start time changed" in v2.reason, v2.reason
    figures("start_header", old=old_header, new=new_header, counters_before=e1.counters, counters_after=e2.counters)


def test_restart_detected_then_idle(srv):
    """Runs last: restarts the shared server on the same port between two rounds of one check."""
    old_header = srv.start_header()
    interval = 5
    outcome: dict = {}
    load = srv.load(2, max_tokens=8000)
    try:
        with LeastConnProxy([srv.url]) as rec:
            srv.wait_moving()

            def run() -> None:
                outcome["result"] = check(rec.url, "--interval", str(interval), "--rounds", "3", "--hung-after", "600", "--probe-timeout", "20")

            t = one_round_in(rec, run)
            t0 = time.monotonic()
            ready = srv.restart(grace=0)  # killed, as a supervisor does to a server that will not stop
            restart_s = time.monotonic() - t0
            assert restart_s < interval - 1, f"restart took {restart_s:.1f}s, the check's interval is {interval}s"
            t.join(CHECK_TIMEOUT)
    finally:
        load.cancel()
    rc, r = outcome["result"]
    assert (rc, r["state"]) == (0, "restarted"), r
    assert r["probe_sent"] is True, r  # the fresh server is idle: asked for one token
    fresh = save(srv, "restarted")
    assert srv.start_header() != old_header
    assert fresh["tokens_predicted_total"] == 1 and fresh["n_decode_total"] == 1  # only that probe, counted from zero

    rc2, r2 = check(srv.url, "--interval", "1", "--rounds", "3", "--hung-after", "5", "--probe-timeout", "20")
    assert (rc2, r2["state"]) == (0, "idle"), r2
    assert srv.counters()["tokens_predicted_total"] == 2
    figures("restart", restart_seconds=round(restart_s, 2), ready_seconds=round(ready, 2), reason=r["reason"])
