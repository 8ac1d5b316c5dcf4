"""What one backend, or one `/probe` caller, can do to the exporter and to `check`: real
llm-health processes on loopback against hostile servers on loopback. Every test here
failed on the code before its fix (the row of the hostile-input table it answers is named
in its docstring); the limits it relies on are in docs/limits.md."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.parse

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.hostile import models_ok, sglang_payload, trickle, vllm_payload

INTERVAL = 0.5


def config(tmp_path, backends: list[tuple[str, str]], extra: str = "") -> str:
    lines = [
        "global: {interval: 0.5s, hung_after_seconds: 1, probe_interval: 60s, probe_timeout: 2s, metrics_timeout: 5s, models_timeout: 5s, connect_timeout: 2s}"
    ]
    lines.append("backends:" if backends else "backends: []")
    lines += [f"  - {{name: {name}, url: '{url}'}}" for name, url in backends]
    path = tmp_path / "llm-health.yml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return str(path)


async def get(url: str, timeout: float = 30.0, **params: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url, params=params or None, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return r.status, await r.text()


async def status_of(exporter, name: str) -> dict:
    _, text = await get(exporter.url + "/status")
    return {b["backend"]: b for b in json.loads(text)["backends"]}[name]


async def until(check, timeout: float = 30.0, what: str = "condition"):
    """Poll an async check; a failure bound, never a measured time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def series(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def test_36000_engine_units_are_refused_not_kept(tmp_path, hostile, sim_server, ticker, llm_health):
    """Row 3: one backend's payload with ~36,000 distinct `engine` values (within the 16 MB
    cap) stalled the loop and grew /metrics to 612k series. Now: refused as no_metrics
    (reason `limits`), /metrics stays small, the other backends go on."""
    evil = await hostile()
    evil.text("GET", "/metrics", vllm_payload(engines=36_000, running=1))
    models_ok(evil)
    busy = await sim_server("busy", scenario="saturated")
    ticker.append(busy)
    exporter = llm_health("serve", "--config.file", config(tmp_path, [("evil", evil.url), ("busy", busy.url)])).wait_ready()

    async def evil_refused():
        s = await status_of(exporter, "evil")
        return s if s["state"] == "no_metrics" else None

    s = await until(evil_refused, what="the hostile backend refused")
    assert "over limits" in s["reason"], s
    rounds = (await status_of(exporter, "busy"))["rounds"]
    await until(lambda: _rounds_past(exporter, "busy", rounds + 4), what="the other backend's rounds to go on")
    assert (await status_of(exporter, "busy"))["state"] == "busy"
    status, text = await get(exporter.url + "/metrics")
    found = series(text)
    assert status == 200 and len(found) < 2000, len(found)
    assert found[("llm_exporter_round_errors_total", frozenset({("backend", "evil"), ("reason", "limits")}))] >= 1


async def _rounds_past(exporter, name: str, rounds: int) -> bool:
    return (await status_of(exporter, name))["rounds"] >= rounds


async def test_probe_state_is_bounded_in_engines_not_only_targets(tmp_path, hostile, llm_health):
    """Row 4: 60 /probe targets of 5,000 engines each took the exporter from 43 to 447 MB.
    Now every such payload is refused whole, and the engines /probe keeps are capped."""
    servers = []
    for _ in range(6):
        s = await hostile()
        s.text("GET", "/metrics", vllm_payload(engines=5000, running=1))
        servers.append(s)
    small = []
    for _ in range(8):
        s = await hostile()
        s.text("GET", "/metrics", vllm_payload(engines=200, running=1))
        small.append(s)
    exporter = llm_health("serve", "--config.file", config(tmp_path, [], "probe: {max_engines: 1000}\n")).wait_ready()
    rss_before = exporter.rss_bytes()
    for _ in range(10):  # 60 /probe reads of 5,000-engine payloads
        for s in servers:
            await get(exporter.url + "/probe", target=s.url)
    for s in small:
        await get(exporter.url + "/probe", target=s.url)
    _, text = await get(exporter.url + "/status")
    probe = json.loads(text)["probe"]
    assert probe["engine_units"] <= 1000 and probe["evicted"] >= 3, probe
    assert exporter.rss_bytes() - rss_before < 100 * 1024 * 1024


async def test_a_trickling_neighbour_on_the_same_host_port_changes_nothing(tmp_path, hostile, llm_health):
    """Row 5: four slow backends and one healthy one on one host:port shared a connection
    pool, and waiting for a slot counted as connect time: the healthy one read `down`.
    Now each backend has its own pool, and only the TCP connect is timed as a connect."""
    server = await hostile()
    for i in range(4):
        server.on("GET", f"/slow{i}/metrics", trickle)
        server.on("GET", f"/slow{i}/v1/models", trickle)
    server.text("GET", "/ok/metrics", vllm_payload(running=0))
    models_ok(server)
    server.text("GET", "/ok/v1/models", '{"data": [{"id": "m"}]}', content_type="application/json")
    server.text("POST", "/ok/v1/completions", '{"choices": [{"text": "x"}]}', content_type="application/json")
    backends = [(f"slow{i}", f"{server.url}/slow{i}") for i in range(4)] + [("ok", f"{server.url}/ok")]
    exporter = llm_health("serve", "--config.file", config(tmp_path, backends)).wait_ready()
    await until(lambda: _rounds_past(exporter, "ok", 6), what="six rounds of the healthy backend")
    ok = await status_of(exporter, "ok")
    assert ok["state"] == "idle", ok
    # four /probe callers on the same host:port, while a configured backend goes on
    probes = [asyncio.ensure_future(get(exporter.url + "/probe", timeout=60, target=f"{server.url}/slow{i}")) for i in range(4)]
    try:
        rounds = ok["rounds"]
        await until(lambda: _rounds_past(exporter, "ok", rounds + 4), what="the healthy backend's rounds during four slow /probe calls")
        assert (await status_of(exporter, "ok"))["state"] == "idle"
    finally:
        for p in probes:
            p.cancel()


async def test_probe_follows_no_redirect_and_reads_only_plain_targets(tmp_path, hostile, llm_health):
    """Rows 6 and 15: a target answering the probe's POST with a 307 had the exporter POST
    to a path of its choosing; `?x=` or `#` at the end swallowed the fixed path; `http://`
    and `http://[::1` gave 200 `down`; credentials landed in the `backend` label. Each of
    docs/limits.md's refusals is a 400 that says why (a bad port and `..` included)."""
    evil = await hostile()
    evil.text("GET", "/metrics", vllm_payload(running=0))
    models_ok(evil)

    async def redirect(request: web.Request) -> web.StreamResponse:
        raise web.HTTPTemporaryRedirect("/admin/wipe")

    evil.on("POST", "/v1/completions", redirect)
    evil.text("POST", "/admin/wipe", "wiped")
    evil.text("GET", "/admin/secrets", "secrets")
    exporter = llm_health("serve", "--config.file", config(tmp_path, [])).wait_ready()
    status, text = await get(exporter.url + "/probe", target=evil.url)
    assert status == 200 and ("POST", "/v1/completions") in evil.requests  # idle: probed once
    assert ("POST", "/admin/wipe") not in evil.requests
    for bad, why in {
        f"{evil.url}/admin/secrets?x=": "must not have a query (?) or a fragment (#)",
        f"{evil.url}/admin/secrets#": "must not have a query (?) or a fragment (#)",
        "http://": "has no host",
        "http://[::1": "is not a valid URL",
        "file:///etc/passwd": "is not an http(s) URL",
        f"http://user:hunter2@127.0.0.1:{urllib.parse.urlsplit(evil.url).port}": "must not carry credentials",
        "http://h:99999": "is not a valid URL: Port out of range 0-65535",  # a bad port
        f"{evil.url}/v1/../admin/secrets": "path '/v1/../admin/secrets' is not a plain path prefix",  # `..`
    }.items():
        status, text = await get(exporter.url + "/probe", target=bad)
        assert status == 400 and why in text, (bad, status, text)
        assert "hunter2" not in text
    assert ("GET", "/admin/secrets") not in evil.requests
    _, page = await get(exporter.url + "/status")
    assert "hunter2" not in page


async def test_probe_allowlist_and_off_switch(tmp_path, hostile, llm_health):
    """Row 6: there was no allowlist, no way to turn /probe off."""
    server = await hostile()
    server.text("GET", "/metrics", vllm_payload(running=1))
    allowed = config(tmp_path, [], f"probe: {{allowed_targets: ['{server.url}']}}\n")
    exporter = llm_health("serve", "--config.file", allowed).wait_ready()
    assert (await get(exporter.url + "/probe", target=server.url))[0] == 200
    assert (await get(exporter.url + "/probe", target="http://127.0.0.1:9"))[0] == 403
    off = tmp_path / "off.yml"
    off.write_text("backends: []\nprobe: {enabled: false}\n")
    exporter2 = llm_health("serve", "--config.file", str(off)).wait_ready()
    assert (await get(exporter2.url + "/probe", target=server.url))[0] == 404
    assert server.requests.count(("GET", "/metrics")) == 1


async def test_nan_start_time_does_not_hide_a_hang(hostile, llm_health_check):
    """Row 11: `process_start_time_seconds NaN` read as a restart every round: a hung
    engine was `restarted` for ever and `check` exited 0."""
    server = await hostile()
    server.text("GET", "/metrics", vllm_payload(running=4, steps=10, start="NaN"))
    models_ok(server)
    rc, result = await llm_health_check(server.url, "--interval", "0.3", "--hung-after", "0.6")
    assert (rc, result["state"]) == (1, "hung"), result


@pytest.mark.parametrize("running", ["NaN", "-5", "+Inf"])
async def test_running_that_is_no_number_is_never_idle(hostile, llm_health_check, running):
    """Row 13: running = NaN or -5 read as idle, and a probe was sent."""
    server = await hostile()
    server.text("GET", "/metrics", vllm_payload(running=running, waiting=0))
    models_ok(server)
    server.text("POST", "/v1/completions", '{"choices": [{"text": "x"}]}', content_type="application/json")
    rc, result = await llm_health_check(server.url, "--interval", "0.2", "--hung-after", "0.4", "--rounds", "4")
    assert ("POST", "/v1/completions") not in server.requests
    assert result["state"] == "unknown" and rc == 3, result


async def test_an_engine_that_changes_every_round_is_not_unknown_for_ever(tmp_path, hostile, llm_health):
    """Row 16: a payload whose engine type changes every round stayed `unknown` for ever.
    Another engine behind the same URL is a restart: counted, and the restart loop alert
    sees it."""
    server = await hostile()
    reads = {"n": 0}

    def payload() -> str:
        reads["n"] += 1
        return vllm_payload(running=2, steps=reads["n"]) if reads["n"] % 2 else sglang_payload(running=2)

    server.text("GET", "/metrics", payload)
    models_ok(server)
    exporter = llm_health("serve", "--config.file", config(tmp_path, [("flip", server.url)])).wait_ready()
    await until(lambda: _rounds_past(exporter, "flip", 5), what="five rounds")
    s = await status_of(exporter, "flip")
    assert s["state"] == "restarted" and "another engine answers" in s["reason"], s
    assert s["restarts"] >= 3


@pytest.fixture
def llm_health_check():
    """`llm-health check URL ARGS --json` as a subprocess: (exit code, the JSON line)."""

    async def run(url: str, *args: str) -> tuple[int, dict]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llm_health", "check", url, *args, "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        lines = [line for line in out.decode().splitlines() if line.startswith("{")]
        assert lines, err.decode()
        return proc.returncode or 0, json.loads(lines[-1])

    return run
