"""What a client, an upstream or a webhook sender can do to the gate and the restarter:
real `llm-health gate` and `llm-health restarter` processes, a real redis-server, hostile
peers on loopback. Each test names the row of the hostile-input table it answers; each
failed on the code before its fix."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp
import pytest
from multidict import CIMultiDict

from llm_health.store.queue import AdmissionQueue

OK = {"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}


def gate_config(tmp_path, redis_url: str, upstream: str) -> str:
    path = tmp_path / "gate.yml"
    path.write_text(
        "admission: {reject_if_queue_age_ms_gte: 3000, reject_if_retry_count_gte: 1, ignore_worker_util_when_slack_ms_lte: 0}\n"
        f"gate:\n  redis: {redis_url}\n  queue_prefix: 'hostile:'\n  routes:\n    chat: {{upstream: '{upstream}', default_deadline_ms: 30000}}\n"
    )
    return str(path)


async def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json={"model": "m"}, headers=headers or {}) as r:
        return r.status, await r.text()


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}")


@pytest.fixture
async def gate(tmp_path, redis_url, hostile, llm_health):
    upstream = await hostile()
    upstream.text("POST", "/v1/completions", json.dumps(OK), content_type="application/json")
    proc = llm_health("gate", "--config.file", gate_config(tmp_path, redis_url, upstream.url)).wait_ready()
    return proc, upstream


# Row 7's headers (tests/integration/test_door_nginx_lua.py sends them to the Lua door too).
BAD_HEADERS = [
    ("X-Request-Timeout-Ms", "inf"),
    ("X-Request-Timeout-Ms", "1e20"),
    ("X-Request-Timeout-Ms", "99999999999999"),
    ("X-Request-Deadline-Ms", "1e14"),
    ("X-Request-Deadline-Ms", "100000000000000"),
    ("X-Retry-Count", str(10**25)),
    ("X-Retry-Count", "-1"),
    ("X-Retry-Count", "+1"),
    ("X-Request-Timeout-Ms", "+5000"),
    ("X-Request-Timeout-Ms", "-5"),
    ("X-Tenant", "a/b"),
    ("X-Request-Id", "x" * 300),
]


@pytest.mark.parametrize("header,value", BAD_HEADERS)
async def test_numeric_and_id_headers_are_refused_by_name(gate, header, value):
    """Row 7: `X-Request-Timeout-Ms: inf` and `1e20` gave 500s, `X-Request-Deadline-Ms: 1e14`
    kept a record ~3,100 years, a retry count of 10^25 made Redis refuse a script, read as
    "Redis down" (llm_gate_redis_up 0, 503 on closed routes for ever)."""
    proc, upstream = gate
    status, body = await post(proc.url, {"X-Request-Id": "h1", header: value})
    assert status == 400 and header in json.loads(body)["error"]["message"], body
    assert upstream.requests == []
    assert await metric(proc.url, "llm_gate_redis_up") == 1
    assert (await post(proc.url, {"X-Request-Id": "h2"}))[0] == 200  # the gate goes on


@pytest.mark.parametrize(
    "header,first,second",
    [
        ("X-Request-Deadline-Ms", "FUTURE", "PAST"),
        ("X-Request-Timeout-Ms", "60000", "1"),
        ("X-Retry-Count", "0", "3"),
        ("X-Request-Id", "rep-1", "rep-2"),
        ("X-Tenant", "tenant-a", "tenant-b"),
    ],
)
async def test_a_header_repeated_with_different_values_is_refused_by_name(gate, header, first, second):
    """A retry carrying `X-Request-Deadline-Ms` twice, a future value then a past one, was
    admitted (the first copy won): a request whose deadline is ambiguous is refused, 400
    naming the header, nothing forwarded; two copies of one value are one."""
    proc, upstream = gate
    now = int(time.time() * 1000)
    values = [{"FUTURE": str(now + 60000), "PAST": str(now - 1000)}.get(v, v) for v in (first, second)]
    base = [] if header == "X-Request-Id" else [("X-Request-Id", "rep-0")]
    status, body = await post_multi(proc.url, [*base, (header, values[0]), (header, values[1])])
    assert status == 400 and header in json.loads(body)["error"]["message"], body
    assert upstream.requests == []
    # Two copies of one value are one.
    same = [("X-Request-Id", "rep-9")] * 2 if header == "X-Request-Id" else [("X-Request-Id", "rep-9"), (header, values[0]), (header, values[0])]
    status, body = await post_multi(proc.url, same)
    assert status == 200, body


async def post_multi(url: str, headers: list[tuple[str, str]]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json={"model": "m"}, headers=CIMultiDict(headers)) as r:
        return r.status, await r.text()


async def test_request_ids_are_scoped_by_tenant(gate):
    """Row 8: tenant A sends `order-1001` with a past deadline; tenant B's own `order-1001`
    got a non-retryable 422."""
    proc, _upstream = gate
    late = str(int(time.time() * 1000) - 1000)
    status, _ = await post(proc.url, {"X-Request-Id": "order-1001", "X-Tenant": "tenant-a", "X-Request-Deadline-Ms": late})
    assert status == 422
    status, body = await post(proc.url, {"X-Request-Id": "order-1001", "X-Tenant": "tenant-b"})
    assert status == 200, body


@pytest.mark.parametrize("how", ["reset-mid-stream", "not-http"])
async def test_a_broken_upstream_is_a_502_and_the_record_is_finished(tmp_path, redis_url, llm_health, how):
    """Row 9: an upstream that reset mid-stream, or did not speak HTTP, gave a 500 and left
    the record `running`; a reset mid-stream logged an ERROR traceback."""
    upstream = socket.create_server(("127.0.0.1", 0))
    port = upstream.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = upstream.accept()
            except OSError:
                return
            conn.recv(65536)
            if how == "not-http":
                conn.sendall(b"\x00\x01 not http at all\r\n\r\n")
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n")
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        proc = llm_health("gate", "--config.file", gate_config(tmp_path, redis_url, f"http://127.0.0.1:{port}")).wait_ready()
        try:
            status, _ = await post(proc.url, {"X-Request-Id": f"broken-{how}"})
        except aiohttp.ClientError:
            status = None  # the answer had begun: the gate cut the connection
        assert status in (502, None) and (how == "reset-mid-stream" or status == 502), status
        queue = AdmissionQueue.from_url(redis_url, prefix="hostile:")
        try:
            deadline = time.monotonic() + 10
            record = None
            while time.monotonic() < deadline:
                record = await queue.read(f"default/broken-{how}")
                if record is not None and record.state == "done":
                    break
                await asyncio.sleep(0.05)
        finally:
            await queue.aclose()
        assert record is not None and (record.state, record.http_status) == ("done", 502), record
        # An expected upstream failure is one line, not a traceback.
        log = proc.output()
        assert "Traceback" not in log and "ERROR" not in log, log
        assert (how == "not-http") or log.count("upstream of route chat broke mid-answer") == 1, log
    finally:
        upstream.close()


async def test_deeply_nested_json_to_the_restarter_is_a_400(tmp_path, llm_health, sim_server):
    """Row 14: 100,000-deep nested JSON with a valid token gave a 500 (RecursionError)."""
    s = await sim_server(scenario="idle")
    cfg = tmp_path / "restarter.yml"
    cfg.write_text(f"backends:\n  - {{name: gpu0, url: '{s.url}', restart: [/bin/true]}}\n")
    proc = llm_health("restarter", "--config.file", str(cfg), env={"LLM_HEALTH_RESTARTER_TOKEN": "tok"}).wait_ready()
    body = b"[" * 100_000 + b"]" * 100_000
    async with aiohttp.ClientSession() as http, http.post(proc.url + "/alerts", data=body, headers={"Authorization": "Bearer tok"}) as r:
        assert r.status == 400, await r.text()
        assert "nested too deeply" in await r.text()
    async with aiohttp.ClientSession() as http, http.get(proc.url + "/-/healthy") as r:
        assert r.status == 200
