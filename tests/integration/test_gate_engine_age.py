"""The engine's queue age in the one decision: a route names the exporter's backends it sends
to, the exporter publishes each backend's figure to Redis (`QueueKeys.engine_age`, an
expiry of a few rounds, deleted while unknown), and every door reads them in its one
round trip. Here the figures are written as the exporter writes them, on a real
redis-server, and the gate and nginx + `llm-health decide` answer from them."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import redis

from llm_health.gate.decision import engine_queue_age
from llm_health.store.keys import QueueKeys
from tests.integration.test_gate import post, stack  # noqa: F401  (the fixture)


def publish(url: str, prefix: str, **ages: int | str | None) -> None:
    keys = QueueKeys(prefix)
    with redis.Redis.from_url(url) as r:
        for backend, age in ages.items():
            if age is None:
                r.delete(keys.engine_age(backend))
            else:
                r.set(keys.engine_age(backend), age, px=60000)


@pytest.mark.parametrize(
    "values,age",
    [
        ([b"4000", None], 4000),  # one backend unknown: the known one
        ([b"4000", b"100"], 100),  # a least-loaded balancer sends a new request to the shortest queue
        ([None, None], None),  # none known: unknown, never 0
        ([b"abc", b"-5", b"1e9", b""], None),  # not a non-negative integer: unknown
        ([b"0"], 0),  # an empty queue is a known 0
    ],
)
def test_a_routes_engine_age_is_the_youngest_known(values, age):
    assert engine_queue_age(values) == age


async def test_the_gate_refuses_on_the_engines_queue_age(stack, redis_url):  # noqa: F811
    routes = {
        "chat": {"upstream": "UPSTREAM", "default_deadline_ms": 3000, "backends": ["gpu-a", "gpu-b"], "engine_age_unknown": "closed"},
        "open": {"upstream": "UPSTREAM", "default_deadline_ms": 60000, "backends": ["gpu-c"], "engine_age_unknown": "open"},
    }
    url, up, gate = await stack(routes=routes)
    prefix = gate.cfg.queue_prefix
    # The 02:14 page: the engine's queue is older than the deadline while the gate's own is empty.
    publish(redis_url, prefix, **{"gpu-a": 4000})
    status, body, headers = await post(url, {"X-Route": "chat"})
    err = json.loads(body)["error"]
    assert (status, err["code"], err["engine_queue_age_ms"], headers["x-queue-age-ms"]) == (422, "reject_age_beats_slack", 4000, "4000"), body
    assert headers["x-should-retry"] == "false" and up.calls == []
    # A younger queue on the other backend: a new request goes there, admitted.
    publish(redis_url, prefix, **{"gpu-b": 100})
    status, body, headers = await post(url, {"X-Route": "chat"})
    assert (status, headers["x-queue-age-ms"]) == (200, "100") and len(up.calls) == 1, body
    # Neither known: the route fails closed, with a Retry-After inside the deadline only.
    publish(redis_url, prefix, **{"gpu-a": None, "gpu-b": None})
    status, body, headers = await post(url, {"X-Route": "chat", "X-Request-Timeout-Ms": "60000"})
    assert (status, json.loads(body)["error"]["code"], headers["Retry-After"]) == (503, "reject_queue_age_unknown", "5"), body
    assert json.loads(body)["error"]["engine_queue_age_ms"] is None
    status, body, _ = await post(url, {"X-Route": "chat"})  # 3 s left: coming back in 5 s would be late
    assert (status, json.loads(body)["error"]["code"], json.loads(body)["error"]["retryable"]) == (422, "reject_queue_age_unknown", False)
    # A route that fails open on an unknown age decides on its own queue.
    status, _, headers = await post(url, {"X-Route": "open"})
    assert status == 200 and headers["X-LLM-Health-Decision"] == "admit_once"
    publish(redis_url, prefix, **{"gpu-c": 61000})
    status, body, _ = await post(url, {"X-Route": "open"})
    assert (status, json.loads(body)["error"]["code"]) == (422, "reject_age_beats_slack")
    assert len(up.calls) == 2


async def test_an_expired_figure_is_unknown(stack, redis_url):  # noqa: F811
    url, _, gate = await stack(routes={"chat": {"upstream": "UPSTREAM", "default_deadline_ms": 60000, "backends": ["gpu-a"], "engine_age_unknown": "closed"}})
    keys = QueueKeys(gate.cfg.queue_prefix)
    with redis.Redis.from_url(redis_url) as r:
        r.set(keys.engine_age("gpu-a"), 10, px=60000)
    assert (await post(url, {}))[0] == 200
    with redis.Redis.from_url(redis_url) as r:
        r.pexpire(keys.engine_age("gpu-a"), 1)
        while r.exists(keys.engine_age("gpu-a")):
            pass
    status, body, _ = await post(url, {})
    assert (status, json.loads(body)["error"]["code"]) == (503, "reject_queue_age_unknown")


async def test_reopen_waits_for_the_engines_queue_to_be_young_again(stack, redis_url):  # noqa: F811
    """The rollback's last step reads the real age: a closed route reopens only after two
    sampling intervals with its engines' queue under the deadline (unknown never counts)."""
    url, _, gate = await stack(routes={"chat": {"upstream": "UPSTREAM", "default_deadline_ms": 30000, "backends": ["gpu-a"]}})
    prefix = gate.cfg.queue_prefix
    auth = {"Authorization": "Bearer admin-secret"}
    publish(redis_url, prefix, **{"gpu-a": 47000})  # 47 s old against a 30 s deadline
    async with aiohttp.ClientSession() as s:
        assert (await s.post(url + "/-/routes/chat/reject_all", headers=auth)).status == 200
        await asyncio.sleep(0.35)  # the sampler runs every 100 ms in these tests
        r = await s.post(url + "/-/routes/chat/open", headers=auth)
        assert r.status == 409 and (await r.json())["good_intervals"] == 0
        publish(redis_url, prefix, **{"gpu-a": None})  # unknown: still not good
        await asyncio.sleep(0.35)
        assert (await s.post(url + "/-/routes/chat/open", headers=auth)).status == 409
        publish(redis_url, prefix, **{"gpu-a": 200})
        for _ in range(100):  # two good intervals, however slowly this machine runs them
            await asyncio.sleep(0.1)
            r = await s.post(url + "/-/routes/chat/open", headers=auth)
            if r.status == 200:
                break
        assert r.status == 200
