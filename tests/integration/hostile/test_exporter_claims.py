"""docs/limits.md's claims about what one backend's answers can do to `llm-health serve`,
each on a real exporter process reading hostile servers on loopback:

* the fixed 1 MiB cap on the bodies of `/v1/models`, of the probe's answer and of
  `/is_sleeping` ("Per backend payload"), at the bound and one byte past it;
* `max_samples`: wanted samples, and lines starting with `{`, at 10,000 and at 10,001;
* `llm_exporter_round_errors_total{reason}` for each reason the doc and the runbook list
  (`metrics`, `timeout`, `models`, `limits`, `exception`), and none for a refused
  connection or for a server gone with the read in flight (killed while stopped, as a
  restart of a hung one does);
* no redirect followed, for `/metrics`, `/v1/models` and `/is_sleeping` (the probe's POST
  is tested in test_backends.py);
* the garbage collector's view frozen once the server has started;
* and docs/redis-schema.md's "Redis down: `llm_redis_up 0`, the engine part keeps working".

The numbers are written out as the doc states them, so that a default the code moves
fails here too (test_limits_doc.py holds the doc's table to the code).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config.exporter import Backend, Config, Timing
from llm_health.core import engines
from llm_health.core.exposition import Budget, TooManySamples, parse
from llm_health.exporter.app import Exporter
from llm_health.exporter.slots import make_slot, run_round
from llm_health.sim import servers as sim
from tests.fixtures.exporter_status import get, settled
from tests.fixtures.hostile import models_ok, vllm_payload
from tests.harness.processes import free_port, proc_state

MIB = 1024 * 1024  # the doc's "1 MiB (fixed)"
MAX_SAMPLES = 10_000  # the doc's default max_samples
DEADLINE = 90.0  # a failure bound for polls, never a measured time
GLOBAL = (
    "global: {interval: 0.5s, hung_after_seconds: 3600, probe_interval: 600s, probe_timeout: 10s, "
    "metrics_timeout: 30s, models_timeout: 10s, connect_timeout: 5s}"
)


def config(tmp_path, backends: dict[str, tuple[str, str]], sections: str = "") -> str:
    """A config file: name -> (url, further keys of the backend, e.g. `, kind: proxy`),
    then `sections` (YAML) as they are."""
    lines = [GLOBAL, "backends:"] + [f"  - {{name: {name}, url: '{url}'{extra}}}" for name, (url, extra) in backends.items()]
    path = tmp_path / "llm-health.yml"
    path.write_text("\n".join(lines) + "\n" + sections)
    return str(path)


def counters(text: str, name: str) -> dict[tuple[str, str], float]:
    """(backend, second label) -> value of a labelled counter of the exporter's /metrics."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                other = next(v for k, v in s.labels.items() if k != "backend")
                out[(s.labels["backend"], other)] = s.value
    return out


def json_of_size(size: int, **fields: object) -> str:
    """A JSON object holding `fields`, padded to exactly `size` bytes (ASCII)."""
    empty = json.dumps({**fields, "pad": ""})
    text = json.dumps({**fields, "pad": "x" * (size - len(empty))})
    assert len(text.encode()) == size
    return text


async def engine_server(hostile, metrics: str) -> Any:
    """A hostile server answering as a vLLM with this /metrics body, /v1/models listing `m`."""
    server = await hostile()
    server.text("GET", "/metrics", metrics)
    models_ok(server)
    return server


async def test_small_bodies_are_read_up_to_1_mib_and_refused_past_it(tmp_path, hostile, llm_health):
    """`/v1/models` (what a proxy-kind backend reads every round), the probe's answer (sent to
    an idle engine) and `/is_sleeping` (asked when an engine with work in flight stood
    still) are read at exactly 1 MiB and fail one byte past it with "body larger than"."""
    backends: dict[str, tuple[str, str]] = {}
    servers = {}
    for where, size in (("at", MIB), ("past", MIB + 1)):
        proxy = await hostile()
        proxy.text("GET", "/v1/models", json_of_size(size, object="list", data=[{"id": "m"}]), content_type="application/json")
        backends[f"models-{where}"] = (proxy.url, ", kind: proxy")
        idle = await engine_server(hostile, vllm_payload(running=0))
        idle.text("POST", "/v1/completions", json_of_size(size, choices=[{"text": "x"}]), content_type="application/json")
        backends[f"probe-{where}"] = (idle.url, ", interval: 3600s")  # one round: its verdict stays
        still = await engine_server(hostile, vllm_payload(running=4, steps=10))
        still.text("GET", "/is_sleeping", json_of_size(size, is_sleeping=True), content_type="application/json")
        backends[f"sleep-{where}"] = (still.url, "")
        servers[where] = still
    exporter = llm_health("serve", "--config.file", config(tmp_path, backends)).wait_ready()
    await settled(exporter, {"probe-at": "idle", "probe-past": "unresponsive"}, rounds=1)
    status = await settled(exporter, {"models-at": "up", "models-past": "down", "sleep-at": "sleeping", "sleep-past": "stalled"})
    too_large = f"body larger than {MIB} bytes"
    assert status["models-past"]["reason"] == f"proxy: /v1/models failed: {too_large}", status["models-past"]["reason"]
    assert "probe answered" in status["probe-at"]["reason"] and status["probe-at"]["probes_sent"] == 1, status["probe-at"]
    assert f"did not answer a 1-token probe ({too_large})" in status["probe-past"]["reason"], status["probe-past"]["reason"]
    # A flag is True only on a clear yes: the body past the cap is no answer, and the
    # engine that stood still is stalled, not asleep. (The flag's error is not shown.)
    assert ("GET", "/is_sleeping") in servers["past"].requests and too_large not in status["sleep-past"]["reason"]
    text = await get(exporter.url + "/metrics")
    errors = counters(text, "llm_exporter_round_errors_total")
    assert errors[("models-past", "models")] >= 1 and ("models-at", "models") not in errors
    probes = counters(text, "llm_backend_probes_total")
    assert (probes[("probe-at", "ok")], probes[("probe-past", "error")]) == (1, 1)


def padded(lines: int, line: str) -> str:
    """An idle one-engine vLLM payload whose counted lines (wanted samples and lines
    starting with `{`) are `lines` in all: its own five, then copies of `line` ({i} numbered)."""
    base = vllm_payload(running=0)
    own = sum(len(v) for v in parse(base, engines.payload_names()).values())
    return base + "".join(line.format(i=i) + "\n" for i in range(lines - own))


WANTED = 'vllm:request_success_total{{engine="0",finished_reason="r{i}",model_name="m"}} 0'  # one engine unit
BRACED = '{{"some_other_series",i="{i}"}} 1'  # a line starting with `{`, of a series nobody wants


def test_the_sample_payloads_hold_what_they_say():
    for line in (WANTED, BRACED):
        for n in (MAX_SAMPLES, MAX_SAMPLES + 1):
            parse(padded(n, line), engines.payload_names(), budget=Budget(n))
            try:
                parse(padded(n, line), engines.payload_names(), budget=Budget(n - 1))
            except TooManySamples:
                continue
            raise AssertionError(f"{n} lines of {line!r} fit a budget of {n - 1}")
    assert len(engines.read(padded(MAX_SAMPLES, WANTED)).engines) == 1


async def test_max_samples_at_and_one_past_the_bound(tmp_path, hostile, llm_health):
    """Wanted samples and lines starting with `{` count alike: 10,000 of them are read, one
    more refuses the payload whole (no_metrics, reason `limits`)."""
    backends = {}
    for kind, line in (("wanted", WANTED), ("braced", BRACED)):
        for where, n in (("at", MAX_SAMPLES), ("past", MAX_SAMPLES + 1)):
            server = await engine_server(hostile, padded(n, line))
            server.text("POST", "/v1/completions", '{"choices": [{"text": "x"}]}', content_type="application/json")
            backends[f"{kind}-{where}"] = (server.url, "")
    exporter = llm_health("serve", "--config.file", config(tmp_path, backends)).wait_ready()
    want = {name: ("idle" if name.endswith("-at") else "no_metrics") for name in backends}
    status = await settled(exporter, want)
    errors = counters(await get(exporter.url + "/metrics"), "llm_exporter_round_errors_total")
    for kind in ("wanted", "braced"):
        at, past = status[f"{kind}-at"], status[f"{kind}-past"]
        assert [(e["model_name"], e["engine"]) for e in at["engines"]] == [("m", "0")], at
        assert (f"{kind}-at", "limits") not in errors
        why = f"/metrics over limits: more than {MAX_SAMPLES} wanted samples, more than max_samples"
        assert why in past["reason"] and past["engines"] == [], past["reason"]
        assert errors[(f"{kind}-past", "limits")] >= 1


async def closing_server(models: bool) -> asyncio.Server:
    """A raw TCP server that reads each request's head and closes the connection without a
    byte of answer; with `models`, it answers `GET /v1/models` as a vLLM would."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if models and head.startswith(b"GET /v1/models "):
                body = b'{"object": "list", "data": [{"id": "m"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def url_of(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_round_errors_are_counted_by_reason(tmp_path, hostile, llm_health):
    """One backend per reason: an HTML page (`metrics`), a `/metrics` that never answers
    within its 0.5 s `metrics_timeout` (`timeout`), a proxy whose `/v1/models` answers 503
    (`models`), a payload past its `max_engines` (`limits`), a server that closes `/metrics`
    without a byte of answer while its `/v1/models` answers (`metrics`); and no round error,
    the backend `down`, for a refused connection and for a server that closes every
    connection unanswered (one killed with the read in flight, as a restart does)."""
    html = await engine_server(hostile, "")
    html.text("GET", "/metrics", "<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="text/html")
    slow = await engine_server(hostile, "")

    async def never(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(3600)  # far past the timeout: the exporter gives up first
        raise AssertionError("unreachable")

    slow.on("GET", "/metrics", never)
    proxy = await hostile()
    proxy.text("GET", "/v1/models", '{"error": "upstream down"}', status=503, content_type="application/json")
    wide = await engine_server(hostile, vllm_payload(engines=2, running=1))
    closes_metrics, closes_all = await closing_server(models=True), await closing_server(models=False)
    backends = {
        "html": (html.url, ""),
        "slow": (slow.url, ", metrics_timeout: 0.5s"),
        "proxy": (proxy.url, ", kind: proxy"),
        "wide": (wide.url, ", max_engines: 1"),
        "refused": (sim.dead_url(), ""),
        "closes-metrics": (url_of(closes_metrics), ""),
        "closes-all": (url_of(closes_all), ""),
    }
    try:
        exporter = llm_health("serve", "--config.file", config(tmp_path, backends)).wait_ready()
        want = {
            "html": "no_metrics",
            "slow": "unknown",
            "proxy": "down",
            "wide": "no_metrics",
            "refused": "down",
            "closes-metrics": "no_metrics",
            "closes-all": "down",
        }
        status = await settled(exporter, want, rounds=3)
        errors = counters(await get(exporter.url + "/metrics"), "llm_exporter_round_errors_total")
    finally:
        closes_metrics.close()
        closes_all.close()
    assert "HTML page" in status["html"]["reason"] and "timeout after 0.5s" in status["slow"]["reason"]
    assert "HTTP 503" in status["proxy"]["reason"] and "over limits" in status["wide"]["reason"]
    assert "server closed the connection" in status["closes-metrics"]["reason"] and "server closed the connection" in status["closes-all"]["reason"]
    for name, reason in {"html": "metrics", "slow": "timeout", "proxy": "models", "wide": "limits", "closes-metrics": "metrics"}.items():
        mine = {r: v for (b, r), v in errors.items() if b == name}
        assert set(mine) == {reason} and mine[reason] >= 2, (name, mine)
    assert not [key for key in errors if key[0] in ("refused", "closes-all")], errors


ESTABLISHED, LISTEN = "01", "0A"  # /proc/net/tcp's states


def _sockets(port: int, state: str) -> int:
    """The kernel's sockets on 127.0.0.1:`port` in `state` (/proc/net/tcp): with ESTABLISHED,
    connections to it, taken or still waiting in the listener's accept queue."""
    rows = [row.split() for row in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for row in rows if row[1] == f"0100007F:{port:04X}" and row[3] == state)


async def test_a_server_killed_with_the_read_in_flight_is_down_and_no_round_error(tmp_path):
    """What a restart of a stopped server does to the round that is reading it (the
    restarter's capture stops the process, then the restart kills it): a real server
    process, SIGSTOPped, the round's connection taken by the kernel and its request sent,
    then SIGKILL. The read ends before a byte of the answer, /v1/models is refused: the
    backend is `down` for that round, as with a refused connection, and no round error."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    slot = make_slot(Backend("gpu0", f"http://127.0.0.1:{port}", "vllm", Timing(metrics_timeout=DEADLINE, models_timeout=10.0)))
    try:
        deadline = time.monotonic() + DEADLINE
        while not _sockets(port, LISTEN):
            assert time.monotonic() < deadline and server.poll() is None, "http.server did not start"
            await asyncio.sleep(0.05)
        os.kill(server.pid, signal.SIGSTOP)
        while proc_state(server.pid) != "T":  # stopped before the round connects: it cannot accept it
            assert time.monotonic() < deadline, "http.server did not stop"
            await asyncio.sleep(0.01)
        before = _sockets(port, ESTABLISHED)
        round_ = asyncio.ensure_future(run_round(slot))
        while _sockets(port, ESTABLISHED) == before:  # the round's connection is in the stopped server's queue
            assert time.monotonic() < deadline and not round_.done(), "the round never connected"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # its request sent: nothing answers it
        assert not round_.done()
        server.kill()
        server.wait(timeout=DEADLINE)
        await asyncio.wait_for(round_, DEADLINE)
        assert slot.monitor.stats.metrics is not None and slot.monitor.stats.metrics.closed
        assert slot.verdict is not None and slot.verdict.state == "down", slot.verdict
        assert "/metrics: server closed the connection" in slot.verdict.reason and "/v1/models: " in slot.verdict.reason
        assert slot.errors == {}
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        await slot.close()


async def test_a_round_that_raises_is_counted_as_exception_and_the_rounds_go_on(sim_server, aiohttp_client):
    """`exception` is a bug: nothing a backend sends reaches it, so the bug is made here, in
    process: the monitor's round raises. Counted, and the backend's task keeps running."""
    idle = await sim_server("idle", scenario="idle")
    timing = Timing(interval=0.05, probe_interval=600)
    exporter = Exporter(Config(timing=timing, backends=(Backend("buggy", idle.url, "vllm", timing),)))
    client = await aiohttp_client(exporter.app())
    calls = {"n": 0}

    async def broken(now: float | None = None) -> Any:
        calls["n"] += 1
        raise RuntimeError("a bug")

    exporter.slots["buggy"].monitor.round = broken  # type: ignore[method-assign]
    deadline = time.monotonic() + DEADLINE
    while calls["n"] < 3:
        assert time.monotonic() < deadline, "the backend's rounds stopped after a failed one"
        await asyncio.sleep(0.05)
    errors = counters(await (await client.get("/metrics")).text(), "llm_exporter_round_errors_total")
    assert errors[("buggy", "exception")] >= 2, errors


async def test_no_redirect_is_followed(tmp_path, hostile, llm_health):
    """A 302 on `/metrics`, `/v1/models` and `/is_sleeping` is an error status: the paths it
    points to are never asked for (each would have given a healthy or sleeping answer)."""
    moved = await hostile()

    def redirect(path: str) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            raise web.HTTPFound(path)

        return handle

    moved.on("GET", "/metrics", redirect("/moved/metrics"))
    moved.on("GET", "/v1/models", redirect("/moved/v1/models"))
    moved.text("GET", "/moved/metrics", vllm_payload(running=0))
    moved.text("GET", "/moved/v1/models", '{"data": [{"id": "m"}]}', content_type="application/json")
    still = await engine_server(hostile, vllm_payload(running=4, steps=10))
    still.on("GET", "/is_sleeping", redirect("/moved/is_sleeping"))
    still.text("GET", "/moved/is_sleeping", '{"is_sleeping": true}', content_type="application/json")
    exporter = llm_health("serve", "--config.file", config(tmp_path, {"moved": (moved.url, ""), "still": (still.url, "")})).wait_ready()
    status = await settled(exporter, {"moved": "down", "still": "stalled"}, rounds=4)
    assert status["moved"]["reason"] == "/metrics: HTTP 302; /v1/models: HTTP 302", status["moved"]["reason"]
    asked = {path for _, path in moved.requests + still.requests}
    assert {"/metrics", "/v1/models", "/is_sleeping"} <= asked, asked
    assert not [p for p in asked if p.startswith("/moved")], asked


# `llm-health serve` as `python -m llm_health serve` runs it, with one startup hook more,
# appended last (after the server's own): it writes the garbage collector's freeze count as
# it was when the app was handed to aiohttp, and as it is once the app has started.
FREEZE_REPORT = """
import gc, sys
from aiohttp import web

run_app = web.run_app

def reporting_run_app(app, **kw):
    before = gc.get_freeze_count()

    async def report(_app):
        with open(sys.argv[1], "w") as f:
            f.write(f"{before} {gc.get_freeze_count()}")

    app.on_startup.append(report)
    run_app(app, **kw)

web.run_app = reporting_run_app
from llm_health.cli import main
sys.exit(main(sys.argv[2:]))
"""


async def test_the_server_freezes_the_garbage_collectors_view_after_start(tmp_path, sim_server):
    idle = await sim_server("idle", scenario="idle")
    script, report = tmp_path / "serve.py", tmp_path / "freeze-count"
    script.write_text(FREEZE_REPORT)
    listen = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, str(script), str(report), "serve", "--config.file", config(tmp_path, {"idle": (idle.url, "")}), "--web.listen-address", listen]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + DEADLINE
        while not report.exists() or not report.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "serve never started"
            await asyncio.sleep(0.1)
        before, after = map(int, report.read_text().split())
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert before == 0 and after > 0, (before, after, err.decode()[-2000:])


async def test_redis_down_leaves_the_engine_part_working(tmp_path, sim_server, ticker, llm_health):
    """A `redis:` section pointing at a port nothing listens on: `llm_redis_up 0`, and the
    simulated vLLM beside it is read as busy, round after round."""
    busy = await sim_server("busy", scenario="saturated")
    ticker.append(busy)
    redis = (
        f"redis: {{url: 'redis://127.0.0.1:{free_port()}/0', timeout_s: 0.5, reconnect_max_s: 0.5, "
        "pools: [{name: a100, gpus: [gpu0], backends: {gpu0: busy}}]}\n"
    )
    exporter = llm_health("serve", "--config.file", config(tmp_path, {"busy": (busy.url, "")}, redis)).wait_ready()
    await settled(exporter, {"busy": "busy"}, rounds=4)
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(await get(exporter.url + "/metrics")) for s in f.samples}
    assert samples[("llm_redis_up", frozenset())] == 0
    assert samples[("llm_backend_state", frozenset({("backend", "busy"), ("state", "busy")}))] == 1
    assert samples[("llm_backend_requests_running", frozenset({("backend", "busy"), ("model_name", "sim-model"), ("engine", "0")}))] == 12
    redis_status = json.loads(await get(exporter.url + "/status"))["redis"]
    assert redis_status["up"] is False and redis_status["error"], redis_status
