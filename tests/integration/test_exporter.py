"""`llm-health serve` against a simulated fleet: /metrics, /status, /probe, bad backends."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config import exporter as config_mod
from llm_health.config.exporter import Backend, Config, Timing
from llm_health.core import engines
from llm_health.core.evidence import progress_digest
from llm_health.exporter.app import Exporter
from llm_health.sim import servers as sim

T = Timing(interval=0.2, hung_after_seconds=0.4, probe_interval=60, probe_timeout=0.5, metrics_timeout=1.0, models_timeout=1.0)


@pytest.fixture
async def serve(aiohttp_client):
    async def start(backends, timing=T):
        """`backends`: (name, url, kind), or (name, url, kind, the backend's own timing)."""
        exporter = Exporter(Config(timing=timing, backends=tuple(Backend(n, u, k, t[0] if t else timing) for n, u, k, *t in backends)))
        client = await aiohttp_client(exporter.app())
        return exporter, client

    return start


def samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def state_of(text: str, backend: str) -> str:
    hot = [dict(k[1])["state"] for k, v in samples(text).items() if k[0] == "llm_backend_state" and dict(k[1])["backend"] == backend and v == 1]
    assert len(hot) == 1, hot
    return hot[0]


async def wait_for(client, backend, state, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = await (await client.get("/metrics")).text()
        if state_of(text, backend) == state:
            return text
        await asyncio.sleep(0.1)
    raise AssertionError(f"{backend} never became {state}; last {state_of(text, backend)}")


async def test_fleet_states_and_series(sim_server, ticker, serve):
    idle = await sim_server("idle", scenario="idle")
    busy = await sim_server("busy", engines=2, scenario="saturated")
    hung = await sim_server("hung", scenario="hung")
    ticker.extend([busy, hung])
    exporter, client = await serve([("idle", idle.url, "vllm"), ("busy", busy.url, "vllm"), ("hung", hung.url, "vllm"), ("dead", sim.dead_url(), "vllm")])
    text = await wait_for(client, "hung", "hung")
    assert state_of(text, "idle") == "idle"
    assert state_of(text, "busy") == "busy"
    assert state_of(text, "dead") == "down"
    s = samples(text)
    assert s[("llm_backend_up", (("backend", "dead"),))] == 0
    assert s[("llm_backend_up", (("backend", "busy"),))] == 1
    assert s[("llm_backend_requests_running", (("backend", "busy"), ("engine", "1"), ("model_name", "sim-model")))] == 12
    assert s[("llm_backend_engine_steps_per_second", (("backend", "busy"), ("engine", "0"), ("model_name", "sim-model")))] > 0
    assert s[("llm_backend_probes_total", (("backend", "idle"), ("result", "ok")))] == 1
    # the one probe was rounds ago; its duration stays exported until the next probe (a series
    # that came and went with the round would be marked stale by Prometheus between probes)
    assert exporter.slots["idle"].monitor.rounds > 1 and exporter.slots["idle"].monitor.stats.probe is None
    assert 0 < s[("llm_backend_probe_duration_seconds", (("backend", "idle"),))] < T.probe_timeout
    assert ("llm_backend_probe_duration_seconds", (("backend", "busy"),)) not in s
    assert s[("llm_backend_info", (("backend", "busy"), ("kind", "engine"), ("profile", "vllm_v1")))] == 1
    # a refused connection is the backend down (or restarting), not a failed round
    assert not any(k[0] == "llm_exporter_round_errors_total" and ("backend", "dead") in k[1] for k in s)
    assert ("llm_exporter_build_info", (("version", "0.1.0"),)) in s
    # the rule: not one completion to a server with work in flight
    assert busy.received == [] and hung.received == []
    status = await (await client.get("/status")).json()
    by_name = {b["backend"]: b for b in status["backends"]}
    assert by_name["hung"]["state"] == "hung" and by_name["hung"]["running"] == 4
    assert by_name["busy"]["engines"][1]["engine"] == "1"
    page = await (await client.get("/")).text()
    assert "llm-health exporter" in page and "hung" in page
    await exporter.stop()


async def test_status_filters_by_backend_and_state(sim_server, ticker, serve):
    idle = await sim_server("idle", scenario="idle")
    hung = await sim_server("hung", scenario="hung")
    ticker.append(hung)
    exporter, client = await serve([("idle", idle.url, "vllm"), ("hung", hung.url, "vllm"), ("dead", sim.dead_url(), "vllm")])
    await wait_for(client, "hung", "hung")
    await wait_for(client, "dead", "down")

    async def names(query: str) -> list[str]:
        resp = await client.get("/status" + query)
        assert resp.status == 200 and resp.content_type == "application/json", await resp.text()
        body = await resp.json()
        assert body["shard"]["configured"] == 3 and "probe" in body  # the rest of the document is kept
        return [b["backend"] for b in body["backends"]]

    assert await names("") == ["idle", "hung", "dead"]
    assert await names("?backend=hung") == ["hung"]
    assert await names("?backend=dead&backend=idle&backend=dead") == ["dead", "idle"]  # in the order asked, once each
    assert await names("?state=hung") == ["hung"]
    assert await names("?state=down") == ["dead"]
    assert await names("?state=busy") == []
    assert await names("?backend=idle&state=hung") == []
    # the whole document and each state's go through the bounded reuse (three backends
    # build in well under STATUS_REUSE_MIN_S, so each was built afresh); ?backend= never
    assert set(exporter._status_reuse) == {None, "hung", "down", "busy"}
    assert exporter._status_reuse["hung"].builds == 1
    resp = await client.get("/status?backend=nope")
    assert resp.status == 404 and "no backend 'nope'" in await resp.text()
    resp = await client.get("/status?state=wedged")
    assert resp.status == 400
    text = await resp.text()
    assert "got 'wedged'" in text and "hung" in text and "idle" in text
    # what one ?backend= answer can cost is bounded by the request line (docs/limits.md)
    resp = await client.get("/status?" + "&".join(["backend=idle"] * 700))  # 8,400 bytes
    assert resp.status == 400
    assert await names("?" + "&".join(["backend=idle"] * 600)) == ["idle"]  # 7,200 bytes


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
async def test_promtool_check_metrics(sim_server, ticker, serve):
    busy = await sim_server("busy", scenario="saturated")
    ticker.append(busy)
    _, client = await serve([("busy", busy.url, "vllm"), ("dead", sim.dead_url(), "vllm")])
    text = await wait_for(client, "busy", "busy")
    proc = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


async def test_slow_backend_does_not_delay_others(sim_server, ticker, serve):
    slow = await sim_server("slow", scenario="saturated")
    slow.metrics_mode, slow.slow_seconds = "slow", 30.0
    fast = await sim_server("fast", scenario="saturated")
    ticker.append(fast)
    timing = Timing(interval=0.2, hung_after_seconds=0.4, metrics_timeout=20.0, models_timeout=20.0)
    exporter, client = await serve([("slow", slow.url, "vllm"), ("fast", fast.url, "vllm")], timing)
    await wait_for(client, "fast", "busy", timeout=5.0)
    assert exporter.slots["fast"].monitor.rounds >= 2
    assert exporter.slots["slow"].monitor.rounds == 0  # still waiting on its first read
    # the scrape itself never waits on a backend: it answers while the slow read is still pending
    text = await (await client.get("/metrics")).text()
    assert exporter.slots["slow"].verdict is None and exporter.slots["slow"].monitor.rounds == 0
    assert state_of(text, "slow") == "unknown" and state_of(text, "fast") == "busy"


async def test_bad_payloads_named_and_isolated(sim_server, serve):
    servers = {}
    for mode in ("html", "garbage", "404", "huge"):
        s = await sim_server(mode, scenario="idle")
        s.metrics_mode = mode
        servers[mode] = s
    good = await sim_server("good", scenario="idle")
    _exporter, client = await serve([(m, s.url, "vllm") for m, s in servers.items()] + [("good", good.url, "vllm")])
    await wait_for(client, "good", "idle")
    for mode in servers:
        await wait_for(client, mode, "no_metrics")
    status = {b["backend"]: b for b in (await (await client.get("/status")).json())["backends"]}
    assert "HTML page" in status["html"]["reason"]
    assert "HTTP 404" in status["404"]["reason"]
    assert "larger than" in status["huge"]["reason"]
    assert "unusable" in status["garbage"]["reason"]


async def test_probe_endpoint_multi_target(sim_server, ticker, serve):
    hung = await sim_server("hung", scenario="hung")
    ticker.append(hung)
    exporter, client = await serve([])
    states = []
    for _ in range(4):
        text = await (await client.get("/probe", params={"target": hung.url, "kind": "vllm"})).text()
        states.append(state_of(text, hung.url))
        await asyncio.sleep(0.25)
    assert states[:3] == ["unknown", "stalled", "hung"]
    bad = await client.get("/probe", params={"target": "file:///etc/passwd"})
    assert bad.status == 400
    # state is bounded
    exporter.targets.max_targets = 2  # global.max_probe_targets
    for port in (1, 2, 3):
        await client.get("/probe", params={"target": f"http://127.0.0.1:{port}"})
    assert len(exporter.targets) == 2


async def test_proxy_backend_never_reads_metrics(sim_server, serve):
    a = await sim_server("a", scenario="idle")
    proxy = sim.SimProxy("p", [a])
    await proxy.start()
    try:
        _, client = await serve([("proxy", proxy.url, "proxy")])
        await wait_for(client, "proxy", "up")
        assert proxy.metrics_reads == 0
    finally:
        await proxy.stop()


async def test_reload_keeps_the_memory_of_backends_that_stay(sim_server, ticker, aiohttp_client, tmp_path):
    busy = await sim_server("busy", scenario="saturated")
    idle = await sim_server("idle", scenario="idle")
    ticker.append(busy)
    path = tmp_path / "llm-health.yml"
    path.write_text(f"global: {{interval: 0.2s, hung_after_seconds: 0.4}}\nbackends:\n  - {{name: busy, url: '{busy.url}'}}\n")
    exporter = Exporter(config_mod.load(path), config_file=path)
    client = await aiohttp_client(exporter.app())
    await wait_for(client, "busy", "busy")
    kept = exporter.slots["busy"]
    rounds_before = kept.monitor.rounds

    path.write_text(path.read_text() + f"  - {{name: idle, url: '{idle.url}'}}\n")
    answer = await client.post("/-/reload")
    assert answer.status == 200 and (await answer.json())["reloaded"] is True
    assert exporter.slots["busy"] is kept and kept.monitor.rounds >= rounds_before  # same monitor, same memory
    await wait_for(client, "idle", "idle")

    path.write_text("global: {interval: soon}\n")  # a bad file is refused, the running config kept
    answer = await client.post("/-/reload")
    body = await answer.json()
    assert answer.status == 400 and body["reloaded"] is False and "global.interval" in body["detail"]
    assert set(exporter.slots) == {"busy", "idle"}


def digests(text: str, backend: str) -> dict[str, float]:
    return {dict(k[1])["engine"]: v for k, v in samples(text).items() if k[0] == "llm_backend_engine_progress_digest" and dict(k[1])["backend"] == backend}


async def test_progress_digest_moves_with_progress_and_stands_still_with_a_hang(sim_server, ticker, serve):
    busy = await sim_server("busy", scenario="batch")
    hung = await sim_server("hung", engines=2, scenario="hung")
    ticker.extend([busy, hung])
    _, client = await serve([("busy", busy.url, "vllm"), ("hung", hung.url, "vllm")])
    first = await wait_for(client, "hung", "hung")
    await asyncio.sleep(0.5)  # more rounds
    second = await (await client.get("/metrics")).text()
    assert digests(first, "hung") == digests(second, "hung") and set(digests(first, "hung")) == {"0", "1"}
    assert all(0 < d < 2**48 and d == int(d) for d in digests(second, "hung").values())
    assert digests(first, "busy") != digests(second, "busy")
    # the exporter's digest is the one the restarter computes from the same payload
    reading = engines.read(hung.payload())
    mine = {e.engine: progress_digest(reading.profile, reading.start_time, e) for e in reading.engines.values()}
    assert mine == {k: int(v) for k, v in digests(second, "hung").items()}


async def test_live_endpoint_for_a_kubelet(sim_server, ticker, serve):
    """503 only for a proven hang; every other state 200 (busy, idle, down, stalled,
    sleeping, restarted, no_metrics, unknown, unresponsive); no request reaches the backend
    because of the call."""
    idle = await sim_server("idle", scenario="idle")
    busy = await sim_server("busy", scenario="saturated")
    hung = await sim_server("hung", scenario="hung")
    stalled = await sim_server("stalled", scenario="hung")  # never `hung`: hung_after_seconds is an hour
    sleeping = await sim_server("sleeping", scenario="sleeping")
    restarted = await sim_server("restarted", scenario="idle")
    html = await sim_server("no_metrics", scenario="idle")
    html.metrics_mode = "html"
    slow = await sim_server("unknown", scenario="saturated")  # /metrics past its timeout, /v1/models answers
    slow.metrics_mode, slow.slow_seconds = "slow", 30.0
    unresponsive = await sim_server("unresponsive", scenario="idle")
    unresponsive.probe_hangs = True
    ticker.extend([busy, hung, stalled])
    others = [(s.name, s.url, "vllm") for s in (sleeping, restarted, html, slow, unresponsive)]
    backends = [("idle", idle.url, "vllm"), ("busy", busy.url, "vllm"), ("hung", hung.url, "vllm"), ("dead", sim.dead_url(), "vllm"), *others]
    exporter, client = await serve([*backends, ("stalled", stalled.url, "vllm", replace(T, hung_after_seconds=3600))])

    async def restarts() -> None:  # a new process before every round: `restarted` each time
        while True:
            restarted.restart()
            await asyncio.sleep(0.05)

    restarting = asyncio.create_task(restarts())
    try:
        for name in ("hung", "busy", "stalled", "sleeping", "restarted", "no_metrics", "unresponsive"):
            await wait_for(client, name, name)
        deadline = time.monotonic() + 10
        while exporter.slots["unknown"].monitor.rounds < 1:  # unknown after a round, not for want of one
            assert time.monotonic() < deadline, "no round of the slow backend"
            await asyncio.sleep(0.1)
        reads = {s.name: s.metrics_reads for s in (idle, busy, hung)}
        sent = {s.name: len(s.received) for s in (idle, busy, hung)}
        codes = {"hung": 503, "busy": 200, "idle": 200, "dead": 200, "stalled": 200, "sleeping": 200, "restarted": 200}
        codes |= {"no_metrics": 200, "unknown": 200, "unresponsive": 200}
        for name, code in codes.items():
            resp = await client.get("/-/live", params={"backend": name})
            assert resp.status == code, (name, await resp.text())
            assert (await resp.text()).startswith(f"{name}: ")
            if name not in ("idle", "busy", "dead"):
                assert (await resp.text()).startswith(f"{name}: {name}"), await resp.text()  # in the state named
        # Readiness (/-/ready): 503 for hung and down, 200 for the rest, busy above all.
        for name, code in (codes | {"dead": 503}).items():
            resp = await client.get("/-/ready", params={"backend": name})
            assert resp.status == code, (name, await resp.text())
            assert (await resp.text()).startswith(f"{name}: {'ready' if code == 200 else 'not ready'}: "), await resp.text()
        text = await (await client.get("/metrics")).text()
        turned = {dict(k[1])["backend"]: v for k, v in samples(text).items() if k[0] == "llm_exporter_readiness_not_ready_total"}
        assert turned == {"hung": 1.0, "dead": 1.0}, turned  # once each: the hang and the dead backend stay not ready
        assert {b["backend"]: b["ready"] for b in (await (await client.get("/status")).json())["backends"]}["busy"] is True
    finally:
        restarting.cancel()
    unknown = await client.get("/-/live", params={"backend": "<script>" * 40})
    assert unknown.status == 404 and len(await unknown.text()) < 200
    assert (await client.get("/-/live")).status == 200
    for path in ("/-/ready?backend=" + "<script>" * 40, "/-/ready"):
        resp = await client.get(path)
        assert resp.status == (404 if "=" in path else 400) and len(await resp.text()) < 200
    # Answered from memory: the calls themselves sent nothing (rounds run on their own clock,
    # so compare with a round's worth of slack rather than exact counts).
    assert all(len(s.received) == sent[s.name] for s in (busy, hung))
    assert all(s.metrics_reads - reads[s.name] <= 3 for s in (idle, busy, hung))


async def test_llamacpp_fleet_states(sim_server, ticker, serve):
    """Simulated llama-servers (`SimServer(kind="llamacpp")`): idle after exactly one probe,
    counted by llama.cpp's own counters; busy with nothing sent; hung when the loop stops
    inside a decode (a frozen snapshot) and when it stops outside one (`/metrics` times out
    while `/health` answers); a restart seen, then idle again."""
    idle = await sim_server("idle", scenario="idle", kind="llamacpp")
    busy = await sim_server("busy", scenario="saturated", kind="llamacpp")
    frozen = await sim_server("frozen", scenario="hung", kind="llamacpp")
    stuck = await sim_server("stuck", scenario="idle", kind="llamacpp")
    restarting = await sim_server("restarting", scenario="idle", kind="llamacpp")
    ticker.extend([busy, frozen, stuck, restarting])
    exporter, client = await serve([(s.name, s.url, "vllm") for s in (idle, busy, frozen, stuck, restarting)])
    text = await wait_for(client, "frozen", "hung")
    assert state_of(text, "busy") == "busy"
    for s in (idle, stuck, restarting):
        text = await wait_for(client, s.name, "idle")
    s = samples(text)
    assert s[("llm_backend_info", (("backend", "busy"), ("kind", "engine"), ("profile", "llamacpp")))] == 1
    assert s[("llm_backend_requests_running", (("backend", "busy"), ("engine", ""), ("model_name", "")))] == 12
    assert s[("llm_backend_probes_total", (("backend", "idle"), ("result", "ok")))] == 1
    assert len(idle.received) == 1 and idle.engines[0].n_decode == 1 and idle.engines[0].tokens_predicted == 1
    assert busy.received == [] and frozen.received == []

    sim.stuck(stuck)
    await wait_for(client, "stuck", "hung")
    status = {b["backend"]: b for b in (await (await client.get("/status")).json())["backends"]}
    assert "/health answers" in status["stuck"]["reason"]

    def restarts(text: str) -> float:
        return samples(text).get(("llm_backend_restarts_total", (("backend", "restarting"),)), 0)

    before = restarts(await (await client.get("/metrics")).text())
    # A new process that served two requests before the next read: its counters are already
    # past the old ones, only the new Process-Start-Time-Unix header shows the restart.
    restarting.restart()
    restarting.engines[0].probe()
    restarting.engines[0].probe()
    deadline = time.monotonic() + 10
    while (after := restarts(await (await client.get("/metrics")).text())) == before and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert after == before + 1
    await wait_for(client, "restarting", "idle")
    await exporter.stop()


async def test_readiness_stays_503_from_the_hang_until_the_restarted_server_is_back(sim_server, ticker, serve):
    """/-/ready through a whole restart of a simulated llama-server: 503 from the round that
    proves the hang, through the restart and the seconds it loads its model (`no_metrics`,
    then `restarted`), 200 again once a round sees it idle; /-/live is 503 only while hung.
    Readiness turned not ready once; the other backend, busy all along, never."""
    server = await sim_server("gpu0", scenario="hung", kind="llamacpp")
    busy = await sim_server("busy", scenario="saturated", kind="llamacpp")
    ticker.extend([server, busy])
    exporter, client = await serve([("gpu0", server.url, "vllm"), ("busy", busy.url, "vllm")])

    async def codes() -> tuple[str, int, int]:
        # the two answers and the state they were given in: taken again when a round ended
        # between them (as it can on a loaded machine), so they always belong together
        while True:
            rounds = exporter.slots["gpu0"].monitor.rounds
            verdict = exporter.slots["gpu0"].verdict
            state = verdict.state if verdict else "unknown"
            ready = await client.get("/-/ready", params={"backend": "gpu0"})
            live = await client.get("/-/live", params={"backend": "gpu0"})
            if exporter.slots["gpu0"].monitor.rounds == rounds:
                return state, ready.status, live.status

    async def until(state: str) -> tuple[str, int, int]:
        deadline = time.monotonic() + 10
        while (got := await codes())[0] != state:
            assert time.monotonic() < deadline, f"never {state}: {got}"
            await asyncio.sleep(0.02)
        return got

    assert await until("hung") == ("hung", 503, 503)
    server.restart()
    server.loading = True
    assert await until("no_metrics") == ("no_metrics", 503, 200)
    server.loading = False
    sim.idle(server)
    rounds = exporter.slots["gpu0"].monitor.rounds
    seen = set()
    deadline = time.monotonic() + 10
    while (got := await codes())[0] != "idle":
        assert time.monotonic() < deadline, f"never idle: {got}"
        seen.add(got)
        await asyncio.sleep(0.02)
    assert got == ("idle", 200, 200) and exporter.slots["gpu0"].monitor.rounds > rounds
    assert all(code == 503 for state, code, _ in seen if state != "idle"), seen  # restarted, not yet idle: still 503
    text = await (await client.get("/metrics")).text()
    turned = {dict(k[1])["backend"]: v for k, v in samples(text).items() if k[0] == "llm_exporter_readiness_not_ready_total"}
    assert turned == {"gpu0": 1.0}, turned
    assert (await client.get("/-/ready", params={"backend": "busy"})).status == 200


async def test_a_server_loading_its_model_is_not_a_failed_round(sim_server, ticker, serve):
    """After a restart llama-server answers /metrics (and /health) with 503 "Loading model"
    until its model is loaded: the server's own word that it cannot serve yet, like a refused
    connection, not a round the exporter failed. A 404 on /metrics still is one."""
    loading = await sim_server("loading", scenario="idle", kind="llamacpp")
    missing = await sim_server("missing", scenario="idle")
    missing.metrics_mode = "404"
    ticker.append(loading)
    exporter, client = await serve([("loading", loading.url, "vllm"), ("missing", missing.url, "vllm")])
    await wait_for(client, "loading", "idle")
    loading.restart()
    loading.loading = True
    rounds = exporter.slots["loading"].monitor.rounds
    deadline = time.monotonic() + 10
    while exporter.slots["loading"].monitor.rounds < rounds + 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert exporter.slots["loading"].monitor.rounds >= rounds + 3
    text = await (await client.get("/metrics")).text()
    assert state_of(text, "loading") == "no_metrics"
    status = {b["backend"]: b for b in (await (await client.get("/status")).json())["backends"]}
    assert "HTTP 503" in status["loading"]["reason"]
    loading.loading = False
    await wait_for(client, "loading", "idle")
    s = samples(await (await client.get("/metrics")).text())
    errors = {dict(k[1])["backend"]: v for k, v in s.items() if k[0] == "llm_exporter_round_errors_total" and v}
    assert "loading" not in errors and errors["missing"] > 0, errors
    assert s[("llm_backend_restarts_total", (("backend", "loading"),))] == 1
    await exporter.stop()


SCRAPERS = {
    "text 0.0.4": "",
    "Prometheus 2's default (OpenMetrics first)": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Prometheus 3's default": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "text 1.0.0, dots (prometheus_client renders it)": "text/plain;version=1.0.0;escaping=dots",
}


async def test_metrics_from_the_rounds_text_is_prometheus_clients_over_the_snapshots(sim_server, ticker, serve):
    """/metrics serves the text each round rendered (exporter.fast_exposition): in every format a
    scraper negotiates, the bytes prometheus_client writes from the same snapshots; gzip
    where the scraper accepts it."""
    from prometheus_client.exposition import choose_encoder

    busy = await sim_server("busy", engines=2, scenario="saturated")
    hung = await sim_server("hung", scenario="hung")
    ticker.extend([busy, hung])
    exporter, client = await serve([("busy", busy.url, "vllm"), ("hung", hung.url, "vllm"), ("dead", sim.dead_url(), "vllm")])
    await wait_for(client, "hung", "hung")
    for slot in exporter.slots.values():  # no round may end between the two renderings
        assert slot.task is not None
        slot.task.cancel()
        await asyncio.gather(slot.task, return_exceptions=True)
    for name, accept in SCRAPERS.items():
        resp = await client.get("/metrics", headers={"Accept": accept, "Accept-Encoding": "identity"})
        encoder, content_type = choose_encoder(accept)
        assert resp.headers["Content-Type"] == content_type, name
        assert "Content-Encoding" not in resp.headers
        assert await resp.read() == encoder(exporter.registry), name
    zipped = await client.get("/metrics", headers={"Accept-Encoding": "gzip"}, auto_decompress=False)
    assert zipped.headers["Content-Encoding"] == "gzip"
    import gzip

    assert gzip.decompress(await zipped.read()) == choose_encoder("")[0](exporter.registry)
    await exporter.stop()


async def test_event_loop_lag_shows_an_exporter_that_cannot_keep_up(sim_server, ticker, serve):
    idle = await sim_server("idle")
    _, client = await serve([("idle", idle.url, "vllm")])
    await wait_for(client, "idle", "idle")
    time.sleep(1.0)  # the event loop held for a second, as by more rounds than it can run
    await asyncio.sleep(0.6)  # the lag task wakes (late) and notes it
    lag = samples(await (await client.get("/metrics")).text())[("llm_exporter_event_loop_lag_seconds", ())]
    assert lag >= 0.7, lag  # asked to wake every 0.25 s: at least 0.75 s late
