"""The nginx Lua door: a real nginx with its Lua module (Debian's libnginx-mod-http-lua and
lua-nginx-redis) running the shipped deploy/nginx/nginx-lua.conf and the module and plan
`llm-health nginx-lua` writes, a real redis-server, an engine on loopback that records what
reaches it. No Python on the request path: nginx reads the headers, hashes the body, sends
the decision script and records each attempt's end itself.

The same answers as the gate: each case is sent to both, on one Redis, and the statuses,
JSON bodies and admission headers compare equal (the request ids and timing figures
aside)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from multidict import CIMultiDict

from llm_health.config.gate import parse_gate_config
from llm_health.gate.app import Gate
from llm_health.store.queue import AdmissionQueue
from tests.fixtures.nginx import NginxLua
from tests.harness.processes import free_port
from tests.integration.hostile.test_gate_and_restarter import BAD_HEADERS
from tests.integration.test_door_nginx import USAGE, Engine
from tests.integration.test_gate import recorded, serve
from tests.integration.test_gate_records import Stalled, not_running

PREFIX = "llm:admission:"


def gate_file(tmp_path, redis_url: str, engine_url: str, **route: Any) -> Any:
    path = tmp_path / "gate.yml"
    path.write_text(yaml.safe_dump({"gate": {"redis": redis_url, "routes": {"chat": {"upstream": engine_url, "default_deadline_ms": 30000, **route}}}}))
    return path


@pytest.fixture
async def lua_door(own_redis_server, tmp_path):
    """(nginx url, engine, gate url): the Lua door and the gate on one Redis and engine,
    route `chat` failing closed when Redis is down."""
    engine = Engine()
    eapp = web.Application()
    eapp.router.add_route("*", "/{tail:.*}", engine.any)
    erunner, eurl = await serve(eapp)
    path = gate_file(tmp_path, own_redis_server.url, eurl, redis_down="closed")
    gate = Gate(parse_gate_config(yaml.safe_load(path.read_text()), str(path)))
    grunner, gurl = await serve(gate.app())
    nginx = NginxLua(tmp_path, gate_file=path, engine_port=int(eurl.rsplit(":", 1)[1]))
    try:
        with nginx:
            yield nginx.url, engine, gurl, nginx
            print(nginx.error_log()[-4000:])  # shown where a test failed
    finally:
        await grunner.cleanup()
        await erunner.cleanup()


async def send(
    url: str, path: str = "/v1/completions", headers: dict[str, str] | None = None, method: str = "POST", body: Any = None
) -> tuple[int, bytes, CIMultiDict[str]]:
    payload = {"model": "m", "prompt": "hi"} if body is None else body
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=payload, headers=headers or {}) as r:
        return r.status, await r.read(), CIMultiDict(r.headers)


ADMISSION_HEADERS = ("X-LLM-Health-Decision", "Retry-After", "x-should-retry", "Allow")


def comparable(status: int, body: bytes, headers: CIMultiDict[str]) -> tuple[int, Any, dict[str, str]]:
    """What two doors must agree on: the status, the JSON body and the admission headers,
    less what differs per request (ids, figures that move with time)."""
    parsed = json.loads(body) if body else None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        for k in ("request_id", "deadline_slack_ms", "queue_age_ms"):
            parsed["error"].pop(k, None)
        if "message" in parsed["error"]:
            parsed["error"]["message"] = re.sub(r"-?[0-9]+", "N", parsed["error"]["message"])
    return status, parsed, {k: headers[k] for k in ADMISSION_HEADERS if k in headers}


async def test_a_fresh_request_is_admitted_forwarded_and_its_end_recorded_with_its_tokens(lua_door, own_redis_server):
    url, engine, _, nginx = lua_door
    assert "llm_health_plan.lua" in nginx.generated
    status, body, headers = await send(url, headers={"X-Request-Id": "fresh-1", "X-Request-Timeout-Ms": "30000"})
    assert status == 200, body
    assert json.loads(body)["usage"] == USAGE
    assert headers["X-LLM-Health-Decision"] == "admit_once" and headers["X-Request-Id"] == "fresh-1" and int(headers["x-deadline-slack-ms"]) > 0
    [(method, path, up)] = engine.seen
    assert (method, path, up.get("X-Request-Id")) == ("POST", "/v1/completions", "fresh-1")
    assert "x-queue-age-ms" in up and 0 < int(up["x-deadline-slack-ms"]) <= 30000
    rec = await recorded(own_redis_server.url, PREFIX, "fresh-1")
    assert rec is not None and (rec.attempts, rec.http_status, rec.token_units) == (1, 200, USAGE["total_tokens"]), rec


async def test_the_answer_carries_the_door_s_headers_not_the_engine_s_own(lua_door):
    """The door sets its headers on the answer in access: the engine's copies of those names
    are not passed on (proxy_hide_header), so each comes once, the door's."""
    url, _, _, _ = lua_door
    status, _, headers = await send(url, headers={"X-Request-Id": "own-1", "X-Test-Own-Headers": "1", "X-Request-Timeout-Ms": "30000"})
    assert status == 200
    assert headers.getall("X-Request-Id") == ["own-1"]
    assert headers.getall("X-LLM-Health-Decision") == ["admit_once"]
    [age] = headers.getall("x-queue-age-ms")
    [slack] = headers.getall("x-deadline-slack-ms")
    assert age != "999999" and 0 < int(slack) <= 30000


async def test_nginx_s_own_502_for_a_dead_engine_still_carries_the_door_s_headers(own_redis_server, tmp_path):
    dead = free_port()
    path = gate_file(tmp_path, own_redis_server.url, f"http://127.0.0.1:{dead}")
    with NginxLua(tmp_path, gate_file=path, engine_port=dead) as nginx:
        status, _, headers = await send(nginx.url, headers={"X-Request-Id": "dead-1", "X-Request-Timeout-Ms": "30000"})
    assert status == 502
    assert headers.getall("X-Request-Id") == ["dead-1"] and headers["X-LLM-Health-Decision"] == "admit_once"
    rec = await recorded(own_redis_server.url, PREFIX, "dead-1")
    assert rec is not None and rec.http_status == 502, rec


async def test_a_tenant_s_budget_is_charged_by_the_ends_and_refuses_once_spent(own_redis_server, tmp_path):
    """A tenant with a budget: each attempt's end charges its `usage` to the tenant's minute
    (the end sent with the tenant's key), and the decision refuses once it is spent, as the
    gate does (tests/integration/test_gate.py, test_tenant_budget)."""
    engine = Engine()
    eapp = web.Application()
    eapp.router.add_route("*", "/{tail:.*}", engine.any)
    erunner, eurl = await serve(eapp)
    path = tmp_path / "gate.yml"
    gate = {"redis": own_redis_server.url, "tenants": {"small": {"token_units_per_minute": 8}}, "routes": {"chat": {"upstream": eurl}}}
    path.write_text(yaml.safe_dump({"gate": gate}))
    while time.time() % 60 > 50:  # the budget is per wall-clock minute: not across one
        await asyncio.sleep(1)
    h = {"X-Tenant": "small", "X-Request-Timeout-Ms": "90000"}
    try:
        with NginxLua(tmp_path, gate_file=path, engine_port=int(eurl.rsplit(":", 1)[1])) as nginx:
            for rid in ("t1", "t2"):  # 5 units each: the second admitted with 3 left
                assert (await send(nginx.url, headers={**h, "X-Request-Id": rid}))[0] == 200
                rec = await recorded(own_redis_server.url, PREFIX, rid, tenant="small")
                assert rec is not None and rec.token_units == USAGE["total_tokens"], rec
            status, body, headers = await send(nginx.url, headers={**h, "X-Request-Id": "t3"})
    finally:
        await erunner.cleanup()
    assert status == 429 and json.loads(body)["error"]["code"] == "reject_tenant_budget" and headers["Retry-After"] == "60", body
    r = AdmissionQueue.from_url(own_redis_server.url, prefix=PREFIX)
    try:
        spent = await r.redis.get(r.keys.tenant("small", int(time.time() // 60)))
    finally:
        await r.aclose()
    assert int(spent) == 2 * USAGE["total_tokens"]


CASES = [
    ("late retry", {"X-Request-Id": "late-1", "X-Retry-Count": "1", "X-Request-Timeout-Ms": "0"}, "/v1/completions", "POST"),
    ("deadline malformed", {"X-Request-Timeout-Ms": "1e20"}, "/v1/completions", "POST"),
    ("deadline signed", {"X-Request-Deadline-Ms": "+5"}, "/v1/completions", "POST"),
    ("ttl malformed", {"x-llm-d-inference-ttl": "5 s"}, "/v1/completions", "POST"),
    ("ttl past a week", {"x-llm-d-inference-ttl": "169h"}, "/v1/completions", "POST"),
    ("retry count past range", {"X-Retry-Count": "1001"}, "/v1/completions", "POST"),
    ("id with a space", {"X-Request-Id": "a b"}, "/v1/completions", "POST"),
    ("id too long", {"Idempotency-Key": "x" * 257}, "/v1/completions", "POST"),
    ("tenant with a slash", {"X-Tenant": "a/b"}, "/v1/completions", "POST"),
    ("tenant with quotes", {"X-Tenant": 'it\'s "x"'}, "/v1/completions", "POST"),
    ("unknown route", {"X-Route": "nope"}, "/v1/completions", "POST"),
    ("admin endpoint", {}, "/sleep", "POST"),
    ("traversal", {}, "/v1/completions/../../sleep", "POST"),
    ("encoded", {}, "/%73leep", "POST"),
    ("method not forwarded", {}, "/v1/models", "POST"),
    ("retry past its deadline", {"X-Request-Id": "late-2", "X-Retry-Count": "2"}, "/v1/completions", "POST"),
]


@pytest.mark.parametrize(("what", "headers", "path", "method"), CASES, ids=[c[0] for c in CASES])
async def test_the_lua_door_answers_every_refusal_as_the_gate_does(lua_door, what, headers, path, method):
    url, engine, gurl, _ = lua_door
    if what == "retry past its deadline":
        headers = {**headers, "X-Request-Deadline-Ms": str(int(time.time() * 1000) - 5000)}
    lua = comparable(*await send(url, path, headers, method))
    gate = comparable(
        *await send(
            gurl,
            path,
            {**headers, "X-Request-Id": headers["X-Request-Id"] + "-g"} if "X-Request-Id" in headers and what != "id with a space" else headers,
            method,
        )
    )
    assert lua == gate, what
    assert lua[0] in (400, 404, 405, 422), lua
    assert engine.seen == []


async def test_the_engine_s_metrics_are_never_forwarded(lua_door):
    """The gate answers its own /metrics there; the Lua door forwards none of the engine's."""
    url, engine, _, _ = lua_door
    status, body, _ = await send(url, "/metrics", method="GET")
    assert (status, json.loads(body)["error"]["message"]) == (404, "'/metrics': an engine admin or dev endpoint, never forwarded")
    assert engine.seen == []


async def test_queue_age_beating_slack_is_refused_with_retry_after_as_the_gate_does(lua_door, own_redis_server):
    url, engine, gurl, _ = lua_door
    q = AdmissionQueue.from_url(own_redis_server.url, prefix=PREFIX)
    now = int(time.time() * 1000)
    await q.enqueue("default/old", "chat", "default", deadline_ms=now + 600_000, enqueued_ms=now - 4000)  # waiting 4 s
    await q.aclose()
    lua = await send(url, headers={"X-Request-Id": "young", "X-Request-Timeout-Ms": "60000"})
    gate = await send(gurl, headers={"X-Request-Id": "young-g", "X-Request-Timeout-Ms": "60000"})
    assert lua[0] == 503 and json.loads(lua[1])["error"]["code"] == "reject_age_beats_slack", lua
    assert int(lua[2]["Retry-After"]) >= 1 and int(lua[2]["x-queue-age-ms"]) >= 4000
    assert comparable(*lua) == comparable(*gate)
    assert engine.seen == []
    rec = await recorded(own_redis_server.url, PREFIX, "young", attempts=0)
    assert rec is not None and (rec.state, rec.http_status) == ("done", 503), rec  # a refusal is marked done at once


async def test_a_retry_of_one_body_is_matched_to_its_own_first_copy_among_bodies_of_its_length(lua_door, own_redis_server):
    """The OpenAI SDK sends no id: a retry is matched by fingerprint. The Lua door hashes the
    body, so two first copies of one length and different content stay apart (nginx
    auth_request sees only the length): X, then Y, answered 503 by the engine, then Y's
    retry, which must take Y's id (Y's end is in Redis before the retry is decided: the
    retry's decision carries it)."""
    url, _, _, _ = lua_door
    base = {"X-Request-Timeout-Ms": "30000", "Authorization": "Bearer sk-shared", "X-Stainless-Retry-Count": "0"}
    x, y = {"model": "m", "prompt": "xxxx"}, {"model": "m", "prompt": "yyyy"}
    assert len(json.dumps(x)) == len(json.dumps(y))
    sx = await send(url, headers={**base, "X-Test-Delay": "0"}, body=x)
    sy = await send(url, headers={**base, "X-Test-Status": "503"}, body=y)
    retry = await send(url, headers={**base, "X-Stainless-Retry-Count": "1"}, body=y)
    assert (sx[0], sy[0], retry[0]) == (200, 503, 200), (sx, sy, retry)
    assert retry[2]["X-Request-Id"] == sy[2]["X-Request-Id"] != sx[2]["X-Request-Id"]
    rid = sy[2]["X-Request-Id"]
    rec = await recorded(own_redis_server.url, PREFIX, rid, attempts=2)
    assert rec is not None and (rec.attempts, rec.retry_count) == (2, 1), rec


async def test_redis_down_is_the_route_s_redis_down_policy(lua_door, own_redis_server):
    url, engine, gurl, _ = lua_door
    own_redis_server.kill()
    try:
        lua = await send(url, headers={"X-Request-Id": "down-1"})
        gate = await send(gurl, headers={"X-Request-Id": "down-1g"})
    finally:
        own_redis_server.start()
    assert lua[0] == 503 and json.loads(lua[1])["error"]["code"] == "reject_redis_down" and lua[2]["Retry-After"] == "5", lua
    assert json.loads(lua[1])["error"]["queue_age_ms"] is None
    assert comparable(*lua) == comparable(*gate)
    assert engine.seen == []


async def test_redis_down_fails_open_where_the_route_says_so(own_redis_server, tmp_path):
    engine = Engine()
    eapp = web.Application()
    eapp.router.add_route("*", "/{tail:.*}", engine.any)
    erunner, eurl = await serve(eapp)
    path = gate_file(tmp_path, own_redis_server.url, eurl, redis_down="open")
    try:
        with NginxLua(tmp_path, gate_file=path, engine_port=int(eurl.rsplit(":", 1)[1])) as nginx:
            own_redis_server.kill()
            try:
                ok = await send(nginx.url, headers={"X-Request-Id": "open-1"})
                late = await send(nginx.url, headers={"X-Request-Id": "open-2", "X-Retry-Count": "1", "X-Request-Timeout-Ms": "0"})
            finally:
                own_redis_server.start()
    finally:
        await erunner.cleanup()
    assert ok[0] == 200 and ok[2]["X-LLM-Health-Decision"] == "admit_unrecorded", ok
    assert late[0] == 422 and json.loads(late[1])["error"]["code"] == "reject_retry_late", late  # its own deadline still judged
    assert len(engine.seen) == 1


async def test_a_restarted_redis_without_the_script_is_sent_it_again(lua_door, own_redis_server):
    """NOSCRIPT (a restart, a failover to a replica that never loaded it): EVAL, then EVALSHA
    again; the finishes' batch loads the scripts and is sent again."""
    url, _, _, _ = lua_door
    assert (await send(url, headers={"X-Request-Id": "before"}))[0] == 200
    own_redis_server.kill()
    own_redis_server.start()
    status, body, _ = await send(url, headers={"X-Request-Id": "after"})
    assert status == 200, body
    rec = await recorded(own_redis_server.url, PREFIX, "after")
    assert rec is not None and (rec.attempts, rec.http_status) == (1, 200), rec


async def test_a_redis_stall_leaves_no_record_running_after_its_answer(lua_door, own_redis_server):
    """Redis SIGSTOPped while the attempt is at the engine: its end is sent again while Redis
    does not answer, and once it does, the record is done."""
    url, _, _, _ = lua_door
    task = asyncio.ensure_future(send(url, headers={"X-Request-Id": "stall-1", "X-Test-Delay": "1.0"}))
    q = AdmissionQueue.from_url(own_redis_server.url, prefix=PREFIX)
    try:
        while (rec := await q.read("default/stall-1")) is None or rec.state != "running":
            await asyncio.sleep(0.01)
    finally:
        await q.aclose()
    with Stalled(own_redis_server):
        status, _, _ = await task
        await asyncio.sleep(1.5)  # the end sent while Redis does not answer
    assert status == 200
    recs = await not_running(own_redis_server.url, PREFIX, ["stall-1"])
    assert recs["stall-1"] is not None and (recs["stall-1"].state, recs["stall-1"].attempts) == ("done", 1), recs


async def test_an_enqueue_run_late_by_a_stall_leaves_no_record_running(lua_door, own_redis_server):
    """Redis SIGSTOPped before the request, longer than the door waits (1 s): the decision
    times out (the route fails closed: 503), the script runs once Redis resumes, and the
    refusal's end sent late makes the record done."""
    url, _, _, _ = lua_door
    with Stalled(own_redis_server):
        status, body, _ = await send(url, headers={"X-Request-Id": "late-enq"})
        await asyncio.sleep(0.5)
    assert status == 503 and json.loads(body)["error"]["code"] == "reject_redis_down", body
    recs = await not_running(own_redis_server.url, PREFIX, ["late-enq"])
    assert recs["late-enq"] is not None and recs["late-enq"].state == "done", recs


async def test_a_stream_passes_through_unbuffered(lua_door):
    url, _, _, _ = lua_door
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json={"model": "m"}, headers={"X-Request-Id": "stream-1"}) as r:
        assert r.status == 200
        first = await asyncio.wait_for(r.content.readline(), 5)
        assert first.startswith(b"data: "), first
        rest = await r.read()
    assert rest.rstrip().endswith(b"data: [DONE]")


# The hostile-input table's header rows (tests/integration/hostile/test_gate_and_restarter.py):
# the same answer from the Lua door as from the gate, nothing forwarded, the door going on.
HOSTILE = [
    *BAD_HEADERS,
    ("X-Request-Timeout-Ms", " 500 junk"),
    ("x-llm-d-inference-ttl", "-1s"),
    ("x-llm-d-inference-ttl", "1.5.2s"),
    ("x-llm-d-inference-ttl", "1\u00b5"),
    ("X-Tenant", "acme\u2003x"),
    ("X-Request-Timeout-Ms", "5\u00a05"),
]


async def send_multi(url: str, headers: list[tuple[str, str]]) -> tuple[int, bytes, CIMultiDict[str]]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={"model": "m"}, headers=CIMultiDict(headers)) as r:
        return r.status, await r.read(), CIMultiDict(r.headers)


@pytest.mark.parametrize(("header", "value"), HOSTILE)
async def test_hostile_headers_are_refused_by_name_as_the_gate_does(lua_door, header, value):
    url, engine, gurl, _ = lua_door
    lua = await send_multi(url, [("X-Request-Id", "h1"), (header, value)])
    gate = await send_multi(gurl, [("X-Request-Id", "h1g"), (header, value)])
    assert lua[0] == 400 and header in json.loads(lua[1])["error"]["message"], lua
    assert comparable(*lua) == comparable(*gate)
    assert engine.seen == []
    assert (await send(url, headers={"X-Request-Id": "h2"}))[0] == 200  # the door goes on


@pytest.mark.parametrize(
    ("header", "first", "second"),
    [("X-Request-Deadline-Ms", "FUTURE", "PAST"), ("X-Request-Timeout-Ms", "60000", "1"), ("X-Retry-Count", "0", "3"), ("X-Tenant", "tenant-a", "tenant-b")],
)
async def test_a_header_repeated_with_different_values_is_refused_as_the_gate_does(lua_door, header, first, second):
    url, engine, gurl, _ = lua_door
    now = int(time.time() * 1000)
    values = [{"FUTURE": str(now + 60000), "PAST": str(now - 1000)}.get(v, v) for v in (first, second)]
    lua = await send_multi(url, [("X-Request-Id", "rep-0"), (header, values[0]), (header, values[1])])
    gate = await send_multi(gurl, [("X-Request-Id", "rep-0g"), (header, values[0]), (header, values[1])])
    assert lua[0] == 400 and header in json.loads(lua[1])["error"]["message"], lua
    assert comparable(*lua) == comparable(*gate)
    assert engine.seen == []
    same = await send_multi(url, [("X-Request-Id", "rep-9"), (header, values[0]), (header, values[0])])
    assert same[0] == 200, same  # two copies of one value are one


async def test_request_ids_are_scoped_by_tenant(lua_door):
    url, _, _, _ = lua_door
    late = str(int(time.time() * 1000) - 1000)
    assert (await send(url, headers={"X-Request-Id": "order-1001", "X-Tenant": "tenant-a", "X-Request-Deadline-Ms": late}))[0] == 422
    assert (await send(url, headers={"X-Request-Id": "order-1001", "X-Tenant": "tenant-b"}))[0] == 200


def test_the_plan_s_strings_read_back_exactly_in_lua(redis_server):
    """`gate.nginx_lua.lua` writes Lua source by hand: strings with quotes, backslashes,
    control and non-ASCII characters, and digits after an escaped byte, read back byte for
    byte by Lua (a real redis-server's Lua 5.1, as LuaJIT reads it)."""
    import redis as redis_py

    from llm_health.gate.nginx_lua import lua

    client = redis_py.Redis.from_url(redis_server.url)
    try:
        for value in ['a"b\\c', "new\nline\ttab", "\x00\x01" + "9", "caf\u00e9 \u00b5s 1", "{tag}:prefix:", "%w[^]$"]:
            assert client.eval(f"return {lua(value)}", 0) == value.encode(), value
        assert client.eval(f"return ({lua({'k': [1, 2.5, 'x'], 'n': None, 't': True})}).k[2] * 2", 0) == 5
    finally:
        client.close()


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("redis+sentinel://127.0.0.1:26379/mymaster/0", "sentinel"),
        ("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", "cluster"),
        ("rediss://127.0.0.1:6380/0", "TLS"),
        ("unix:///run/redis.sock?db=0", "unix-socket"),
    ],
)
def test_a_redis_the_lua_door_cannot_reach_is_refused_by_the_command_with_the_door_to_use(tmp_path, url, said):
    path = tmp_path / "gate.yml"
    path.write_text(yaml.safe_dump({"gate": {"redis": url, "routes": {"chat": {"upstream": "http://127.0.0.1:1", "default_deadline_ms": 3000}}}}))
    done = subprocess.run(
        [sys.executable, "-m", "llm_health", "nginx-lua", "--config.file", str(path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "gate.redis" in done.stderr and "llm-health decide" in done.stderr, done.stderr
    assert said.lower() in done.stderr.lower(), done.stderr
    assert not (tmp_path / "out").exists()


async def test_unicode_whitespace_is_stripped_as_the_gate_strips_it(lua_door):
    """Python's str.strip() takes Unicode's spaces too (NBSP, EM SPACE): a tenant and a
    timeout padded with them are read as the gate reads them."""
    url, _, gurl, _ = lua_door
    headers = [("X-Tenant", "\u00a0acme\u2003"), ("X-Request-Timeout-Ms", "\u200030000\u00a0")]
    lua = await send_multi(url, [("X-Request-Id", "ws-1"), *headers])
    gate = await send_multi(gurl, [("X-Request-Id", "ws-1g"), *headers])
    assert lua[0] == gate[0] == 200, (lua, gate)


async def test_a_client_gone_mid_stream_is_recorded_as_499(lua_door, own_redis_server):
    """nginx keeps the status it began with (200); the answer's end never passed: the attempt
    is 499, as the gate records it, and its record done."""
    url, _, _, _ = lua_door
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/v1/chat/completions", json={"model": "m"}, headers={"X-Request-Id": "gone-1"})
        assert r.status == 200
        assert (await asyncio.wait_for(r.content.readline(), 5)).startswith(b"data: ")
        r.close()  # the client leaves after the first event
    rec = await recorded(own_redis_server.url, PREFIX, "gone-1", timeout=20)
    assert rec is not None and (rec.state, rec.http_status, rec.attempts) == ("done", 499, 1), rec


async def test_a_reload_with_a_stream_in_flight_still_records_its_end(lua_door, own_redis_server):
    """`nginx -s reload` (SIGHUP): the old worker runs its timers early and exits once its
    streams end; an end that comes after that is written by a timer of its own."""
    url, _, _, nginx = lua_door
    task = asyncio.ensure_future(send(url, "/v1/chat/completions", {"X-Request-Id": "reload-1"}))
    q = AdmissionQueue.from_url(own_redis_server.url, prefix=PREFIX)
    try:
        while (rec := await q.read("default/reload-1")) is None or rec.state != "running":
            await asyncio.sleep(0.01)
    finally:
        await q.aclose()
    assert nginx.proc is not None
    nginx.proc.send_signal(signal.SIGHUP)
    status, body, _ = await task
    assert status == 200 and body.rstrip().endswith(b"data: [DONE]"), body
    rec = await recorded(own_redis_server.url, PREFIX, "reload-1", timeout=20)
    assert rec is not None and (rec.state, rec.http_status, rec.attempts) == ("done", 200, 1), rec


def test_a_plan_whose_decision_takes_another_count_is_refused_at_start(tmp_path):
    """The ends carried with a decision start after its arguments (store.ends.DECIDE_ARGS):
    a plan written for another count (another version's) stops nginx with what to do,
    rather than have ends read as the decision's arguments."""
    path = gate_file(tmp_path, "redis://127.0.0.1:9/0", "http://127.0.0.1:9")
    lua_dir = tmp_path / "llm-health"
    done = subprocess.run(
        [sys.executable, "-m", "llm_health", "nginx-lua", "--config.file", str(path), "--out", str(lua_dir)], capture_output=True, check=False
    )
    assert done.returncode == 0, done.stderr
    plan = lua_dir / "llm_health_plan.lua"
    text = plan.read_text()
    assert text.count('["decide_args"] = 23,') == 1
    plan.write_text(text.replace('["decide_args"] = 23,', '["decide_args"] = 22,'))
    with pytest.raises(RuntimeError, match="DECIDE_LUA takes 22 arguments: run llm-health nginx-lua again"), NginxLua(tmp_path, lua_dir=lua_dir, engine_port=9):
        pass
