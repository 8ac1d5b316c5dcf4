"""The Envoy door, by protocol: there is no Envoy binary here, so `EnvoyExtAuthz` below does
what Envoy's ext_authz HTTP filter is documented to do, configured by the fields of the
shipped deploy/envoy/envoy.yaml (path_prefix, headers_to_add, allowed_headers,
allowed_upstream_headers, allowed_client_headers), against the real decision endpoint, a
real redis-server and an engine on loopback:

- the check request has the original method, path_prefix + the original path, Host,
  Authorization, Content-Length 0 (no body), the allowed headers and headers_to_add;
- a 200 lets the request through, with the response's allowed_upstream_headers added;
- any other status is the client's answer: that status, the body, allowed_client_headers.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from llm_health.config.gate import parse_gate_config
from llm_health.gate.doors import Doors
from llm_health.store.queue import AdmissionQueue
from tests.fixtures.doors import SERVERS, serve_doors
from tests.fixtures.paths import ROOT
from tests.integration.test_gate import recorded, serve
from tests.integration.test_gate_records import Stalled, until

ENVOY_YAML = ROOT / "deploy" / "envoy" / "envoy.yaml"


def ext_authz_config() -> dict[str, Any]:
    doc = yaml.safe_load(ENVOY_YAML.read_text())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    [authz] = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_authz"]
    return authz


def patterns(matcher: dict[str, Any]) -> set[str]:
    out = set()
    for p in matcher["patterns"]:
        assert set(p) == {"exact", "ignore_case"} and p["ignore_case"] is True, p
        out.add(p["exact"].lower())
    return out


class EnvoyExtAuthz:
    def __init__(self, authz_url: str, engine_url: str):
        cfg = ext_authz_config()
        http = cfg["http_service"]
        self.authz_url, self.engine_url = authz_url, engine_url
        self.prefix = http["path_prefix"]
        req, resp = http["authorization_request"], http["authorization_response"]
        self.allowed = patterns(req["allowed_headers"]) | {"host", "authorization"}
        self.to_add = {h["key"]: h["value"] for h in req.get("headers_to_add", [])}
        self.upstream = patterns(resp["allowed_upstream_headers"])
        self.client = patterns(resp["allowed_client_headers"])
        self.client_ok = patterns(resp["allowed_client_headers_on_success"])

    async def request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
        check = {k: v for k, v in headers.items() if k.lower() in self.allowed}
        check.update(self.to_add)
        check["Content-Length"] = "0"
        async with aiohttp.ClientSession(auto_decompress=False) as s:
            async with s.request(method, self.authz_url + self.prefix + path, headers=check, skip_auto_headers=("Content-Type",)) as r:
                authz_status, authz_body, authz_headers = r.status, await r.read(), r.headers.copy()
            if authz_status != 200:
                return authz_status, authz_body, {k: v for k, v in authz_headers.items() if k.lower() in self.client}
            up = dict(headers)
            up.update({k: v for k, v in authz_headers.items() if k.lower() in self.upstream})
            async with s.request(method, self.engine_url + path, headers=up, json={"model": "m"}) as r:
                out = dict(r.headers.items())
                out.update({k: v for k, v in authz_headers.items() if k.lower() in self.client_ok})
                return r.status, await r.read(), out


class Engine:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any]] = []

    async def any(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.raw_path, request.headers.copy()))
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture(params=list(SERVERS))
async def envoy(request, own_redis_server):
    """(Envoy's side of ext_authz, engine, doors), decide served by aiohttp or by `gate.fast_doors`."""
    engine = Engine()
    eapp = web.Application()
    eapp.router.add_route("*", "/{tail:.*}", engine.any)
    erunner, eurl = await serve(eapp)
    routes = {"other": {"upstream": eurl, "default_deadline_ms": 30000}, "chat": {"upstream": eurl, "default_deadline_ms": 30000, "redis_down": "closed"}}
    doors = Doors(parse_gate_config({"gate": {"redis": own_redis_server.url, "routes": routes}}, "test.yml"))
    durl, stop = await serve_doors(doors, request.param)
    yield EnvoyExtAuthz(durl, eurl), engine, doors
    await stop()
    await erunner.cleanup()


def timeout_ms(ms: int) -> dict[str, str]:
    return {"X-Request-Timeout-Ms": str(ms)}


async def test_a_fresh_request_is_admitted_with_its_headers_upstream(envoy, own_redis_server):
    proxy, engine, doors = envoy
    status, _, headers = await proxy.request("POST", "/v1/chat/completions", {"X-Request-Id": "e1", "Authorization": "Bearer client-key", **timeout_ms(30000)})
    assert status == 200 and headers["X-LLM-Health-Decision"] == "admit_once" and "x-deadline-slack-ms" in headers
    [(method, path, up)] = engine.seen
    assert (method, path) == ("POST", "/v1/chat/completions")
    assert up["X-Request-Id"] == "e1" and "x-queue-age-ms" in up and "x-deadline-slack-ms" in up
    # headers_to_add named the route: the record is chat's, and done (Envoy reports no end).
    rec = await recorded(own_redis_server.url, doors.admission.cfg.queue_prefix, "e1")
    assert rec is not None and rec.route == "chat" and rec.state == "done" and rec.attempts == 1, rec


async def test_a_late_retry_is_refused_non_retryable(envoy):
    proxy, engine, _ = envoy
    status, body, headers = await proxy.request("POST", "/v1/completions", {"X-Request-Id": "e2", "X-Retry-Count": "1", **timeout_ms(0)})
    err = json.loads(body)["error"]
    assert (status, err["code"], err["retryable"]) == (422, "reject_retry_late", False)
    assert headers["Content-Type"].startswith("application/json") and engine.seen == []


async def test_queue_age_beating_slack_is_refused_with_retry_after(envoy, own_redis_server):
    proxy, engine, doors = envoy
    q = AdmissionQueue.from_url(own_redis_server.url, prefix=doors.admission.cfg.queue_prefix)
    now = int(time.time() * 1000)
    await q.enqueue("default/old", "chat", "default", deadline_ms=now + 60000, enqueued_ms=now - 4000)
    await q.aclose()
    status, body, headers = await proxy.request("POST", "/v1/completions", {"X-Request-Id": "e3", **timeout_ms(60000)})
    assert status == 503 and json.loads(body)["error"]["code"] == "reject_age_beats_slack"
    assert int(headers["Retry-After"]) >= 1 and int(headers["x-queue-age-ms"]) >= 4000 and engine.seen == []


async def test_tenant_a_s_id_never_refuses_tenant_b(envoy):
    proxy, _, _ = envoy
    assert (await proxy.request("POST", "/v1/completions", {"X-Tenant": "a", "X-Request-Id": "o1", **timeout_ms(1)}))[0] == 200
    await asyncio.sleep(0.05)
    assert (await proxy.request("POST", "/v1/completions", {"X-Tenant": "a", "X-Request-Id": "o1"}))[0] == 422
    assert (await proxy.request("POST", "/v1/completions", {"X-Tenant": "b", "X-Request-Id": "o1", **timeout_ms(30000)}))[0] == 200


async def test_redis_down_is_the_route_s_policy(envoy, own_redis_server):
    proxy, engine, _ = envoy
    own_redis_server.kill()
    status, body, headers = await proxy.request("POST", "/v1/completions", timeout_ms(30000))
    assert status == 503 and json.loads(body)["error"]["code"] == "reject_redis_down" and "Retry-After" in headers and engine.seen == []


@pytest.mark.parametrize("method,path", [("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("POST", "/reset_prefix_cache"), ("POST", "/metrics")])
async def test_engine_admin_endpoints_never_reach_the_engine(envoy, method, path):
    proxy, engine, _ = envoy
    status, body, _ = await proxy.request(method, path, timeout_ms(30000))
    assert status in (404, 405) and json.loads(body)["error"]["type"] == "not_forwarded" and engine.seen == []


async def test_hostile_headers_get_the_gate_s_400(envoy):
    proxy, engine, _ = envoy
    status, body, _ = await proxy.request("POST", "/v1/completions", {"X-Request-Timeout-Ms": "1e20"})
    assert status == 400 and "X-Request-Timeout-Ms" in json.loads(body)["error"]["message"] and engine.seen == []


async def test_a_redis_stall_after_the_decision_leaves_no_record_running(envoy, own_redis_server):
    proxy, _, doors = envoy
    adm = doors.admission
    plain, go = adm.finish, asyncio.Event()

    async def held(*args, **kwargs):  # the record's write waits until Redis is stalled
        await go.wait()
        return await plain(*args, **kwargs)

    adm.finish = held  # type: ignore[method-assign]
    status, _, _ = await proxy.request("POST", "/v1/completions", {"X-Request-Id": "e9", **timeout_ms(60000)})
    assert status == 200
    with Stalled(own_redis_server):
        go.set()
        await until(lambda: adm.m_record_retries._value.get(), timeout=60, what="a record sent again")
    rec = await recorded(own_redis_server.url, adm.cfg.queue_prefix, "e9", timeout=30)
    assert rec is not None and rec.state == "done" and rec.attempts == 1, rec
