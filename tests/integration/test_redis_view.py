"""The exporter's Redis view against a real redis-server (fixtures: tests/fixtures/redis.py).

Series are checked as Prometheus renders them: generate_latest on a registry holding the
exporter's RedisCollector over the view. Async tests run under `asyncio_mode = "auto"`.
No test asserts a wall-clock time; time bounds are failure bounds only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config.errors import ConfigError
from llm_health.config.redis import parse_redis_config
from llm_health.exporter.redis_collector import RedisCollector
from llm_health.exporter.redis_view import RedisView
from llm_health.store.keys import LeaseKeys
from llm_health.store.leases import LeaseClient
from llm_health.store.queue import AdmissionQueue, now_ms
from tests.fixtures.redis_ops import kill_our_feeds


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    """Every test of this module on one server, Sentinel and Cluster (tests/fixtures/redis_any.py)."""
    return any_redis_url


# ----------------------------------------------------------------------------- helpers


def render(view: RedisView) -> dict[tuple[str, frozenset], float]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(RedisCollector(view))
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def eventually(predicate, what: str, bound_s: float = 10.0) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if loop.time() > end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


def config(url: str, **extra: Any):
    section = {
        "url": url,
        "reconnect_max_s": 0.2,
        "pools": [
            {"name": "a100", "gpus": ["g0", "g1", "g2", "g3"], "backends": {"g0": "vllm-a", "g1": "vllm-b"}},
        ],
        "routes": ["chat", "batch"],
    }
    section.update(extra)
    return parse_redis_config(section, "test.yaml")


@pytest_asyncio.fixture
async def leases(redis_url: str):
    c = LeaseClient.from_url(redis_url, ttl_ms=10_000)
    try:
        yield c
    finally:
        await c.aclose()


@pytest_asyncio.fixture
async def make_view():
    views: list[RedisView] = []

    async def make(cfg) -> RedisView:
        view = RedisView(cfg)
        await view.start()
        views.append(view)
        return view

    try:
        yield make
    finally:
        for v in views:
            await v.stop()


# ----------------------------------------------------------------------------- config


def test_config_shape_parses():
    cfg = parse_redis_config(
        {
            "url": "redis://127.0.0.1:6379/2",
            "lease_prefix": "sched:lease:",
            "pools": [
                {"name": "a100", "gpus": ["gpu0", "gpu1"], "backends": {"gpu0": "vllm-a"}},
                {"name": "x", "set_key": "gpu:pool:x"},
                {"name": "seen", "discover": True},
            ],
            "routes": ["chat", "batch"],
        },
        "llm-health.yaml",
    )
    assert [p.name for p in cfg.pools] == ["a100", "x", "seen"]
    assert cfg.pools[0].backends == {"gpu0": "vllm-a"} and cfg.pools[1].set_key == "gpu:pool:x"
    assert cfg.lease_keys.info("g") == "sched:leaseinfo:g"
    assert cfg.routes == ("chat", "batch")
    default = parse_redis_config({}, "x.yaml")
    assert default.lease_keys == LeaseKeys() and default.routes is None
    assert default.routes_key == "llm:admission:routes"


@pytest.mark.parametrize(
    "section, key",
    [
        ([], "redis"),
        ({"ulr": "redis://x"}, "redis.ulr"),
        ({"url": "http://x"}, "redis.url"),
        ({"url": ""}, "redis.url"),
        ({"timeout_s": 0}, "redis.timeout_s"),
        ({"timeout_s": "2"}, "redis.timeout_s"),
        ({"queue_retention_ms": 1.5}, "redis.queue_retention_ms"),
        ({"queue_gc": "yes"}, "redis.queue_gc"),
        ({"lease_prefix": "lease"}, "redis.lease_prefix"),
        ({"routes": []}, "redis.routes"),
        ({"routes": ["chat", "chat"]}, "redis.routes[1]"),
        ({"routes": ["a"], "routes_set_key": "k"}, "redis.routes_set_key"),
        ({"pools": {"name": "a"}}, "redis.pools"),
        ({"pools": [{"gpus": ["g"]}]}, "redis.pools[0].name"),
        ({"pools": [{"name": "a"}]}, "redis.pools[0]"),
        ({"pools": [{"name": "a", "gpus": ["g"], "set_key": "k"}]}, "redis.pools[0]"),
        ({"pools": [{"name": "a", "gpus": "g0"}]}, "redis.pools[0].gpus"),
        ({"pools": [{"name": "a", "gpus": ["g", 3]}]}, "redis.pools[0].gpus[1]"),
        ({"pools": [{"name": "a", "gpus": ["g", "h\n"]}]}, "redis.pools[0].gpus[1]"),
        ({"pools": [{"name": "a", "discover": "yes"}]}, "redis.pools[0].discover"),
        ({"pools": [{"name": "a", "gpus": ["g"], "colour": 1}]}, "redis.pools[0].colour"),
        ({"pools": [{"name": "a", "gpus": ["g"], "backends": {"h": "b"}}]}, "redis.pools[0].backends.h"),
        ({"pools": [{"name": "a", "gpus": ["g"]}, {"name": "a", "gpus": ["h"]}]}, "redis.pools[1].name"),
    ],
)
def test_config_errors_name_the_key(section, key):
    with pytest.raises(ConfigError) as err:
        parse_redis_config(section, "llm-health.yaml")
    assert err.value.key == key
    assert str(err.value).startswith(f"llm-health.yaml: {key}: ")


# ----------------------------------------------------------------------------- series


async def test_series_of_pools_and_routes(redis_url: str, leases: LeaseClient, make_view):
    r = leases.redis
    ours = await leases.claim("g0", "w0", ttl_ms=10_000, job_id="j0")
    assert ours is not None
    await r.set(leases.keys.lease("g1"), "old-sched", nx=True, px=5_000)  # an old-style lease
    wall = now_ms()
    await r.zadd(leases.keys.waiters("a100"), {"w-a": wall + 60_000, "w-b": wall + 60_000, "w-dead": wall - 1})
    q = AdmissionQueue.from_url(redis_url)
    try:
        await q.enqueue("old", "chat", "t", deadline_ms=wall + 5_000, enqueued_ms=wall - 47_000)
        await q.enqueue("late", "chat", "t", deadline_ms=wall - 2_000, enqueued_ms=wall - 1_000)
        await q.enqueue("late", "chat", "t", deadline_ms=wall - 2_000)  # resent: a retry
        await q.record_attempt("old", token_units=256)
        await q.record_attempt("old", token_units=256)
        await q.record_attempt("old", token_units=256, http_status=503)
    finally:
        await q.aclose()

    view = await make_view(config(redis_url))
    await view.refresh({"vllm-a": "busy", "vllm-b": "busy"})
    s = render(view)
    assert value(s, "llm_redis_up") == 1
    assert value(s, "llm_gpu_pool_size", pool="a100") == 4
    assert value(s, "llm_gpu_leases_held", pool="a100") == 2
    assert value(s, "llm_gpu_free", pool="a100") == 2
    assert value(s, "llm_gpu_waiters", pool="a100") == 2  # the one past its deadline is not counted
    assert 0 < value(s, "llm_gpu_lease_ttl_min_seconds", pool="a100") <= 5  # the old-style lease
    assert value(s, "llm_gpu_lease_age_max_seconds", pool="a100") >= 0
    for reason in ("del", "expired"):
        assert value(s, "llm_gpu_lease_releases_total", pool="a100", reason=reason) == 0
    assert value(s, "llm_gpu_lease_drift", pool="a100", kind="busy_without_lease") == 0
    assert value(s, "llm_admission_queue_depth", route="chat") == 2
    assert 47 <= value(s, "llm_admission_queue_age_seconds", route="chat") < 120
    assert -120 < value(s, "llm_admission_deadline_slack_seconds", route="chat") <= -2
    assert value(s, "llm_admission_past_deadline", route="chat") == 1
    assert value(s, "llm_admission_retried_requests", route="chat") == 1
    assert value(s, "llm_admission_token_duplication_ratio_max", route="chat") == 3
    # An empty route: depth 0, age 0, no slack, no ratio.
    assert value(s, "llm_admission_queue_depth", route="batch") == 0
    assert value(s, "llm_admission_queue_age_seconds", route="batch") == 0
    assert value(s, "llm_admission_deadline_slack_seconds", route="batch") is None
    assert value(s, "llm_admission_token_duplication_ratio_max", route="batch") is None

    status = RedisCollector(view).status()
    chat = status["routes"]["chat"]
    assert chat["queue_depth"] == 2 and chat["queue_age_ms"] >= 47_000 and chat["deadline_slack_ms"] <= -2_000
    pool = status["pools"]["a100"]
    assert (pool["size"], pool["leases_held"], pool["free"], pool["waiters"]) == (4, 2, 2, 2)
    assert status["up"] is True and status["round_trips"] == 1


async def test_busy_backend_without_lease_is_drift(redis_url: str, make_view):
    view = await make_view(config(redis_url))
    # The batch job runs on vllm-a (g0) but never claimed its GPU: nobody else knows.
    await view.refresh({"vllm-a": "busy", "vllm-b": "idle"})
    s = render(view)
    assert value(s, "llm_gpu_lease_drift", pool="a100", kind="busy_without_lease") == 1
    assert value(s, "llm_gpu_lease_drift", pool="a100", kind="lease_on_idle_backend") == 0
    assert RedisCollector(view).status()["pools"]["a100"]["drift"]["busy_without_lease"] == {"count": 1, "gpus": ["g0"]}
    # A hung engine with no lease is the same drift.
    await view.refresh({"vllm-a": "hung"})
    assert value(render(view), "llm_gpu_lease_drift", pool="a100", kind="busy_without_lease") == 1


async def test_lease_on_idle_backend_needs_a_whole_round(redis_url: str, leases: LeaseClient, make_view):
    view = await make_view(config(redis_url))
    assert await leases.claim("g1", "w")  # g1 -> vllm-b
    await view.refresh({"vllm-b": "idle"})  # just claimed: the job may not have started
    assert value(render(view), "llm_gpu_lease_drift", pool="a100", kind="lease_on_idle_backend") == 0
    await view.refresh({"vllm-b": "idle"})  # same lease, idle for a whole round
    assert value(render(view), "llm_gpu_lease_drift", pool="a100", kind="lease_on_idle_backend") == 1
    await view.refresh({"vllm-b": "busy"})
    assert value(render(view), "llm_gpu_lease_drift", pool="a100", kind="lease_on_idle_backend") == 0


async def test_releases_are_counted_by_reason_from_events(redis_url: str, leases: LeaseClient, make_view):
    view = await make_view(config(redis_url))
    await eventually(lambda: view._sub_connected, "the subscriber to connect")
    lease = await leases.claim("g0", "w")
    assert lease and await leases.release(lease)
    assert await leases.claim("g1", "crashed", ttl_ms=100)  # expires
    await leases.redis.set("other:key", "x", px=50)  # not a lease: not counted

    def counted():
        s = render(view)
        return (
            value(s, "llm_gpu_lease_releases_total", pool="a100", reason="del"),
            value(s, "llm_gpu_lease_releases_total", pool="a100", reason="expired"),
        ) == (1, 1)

    await eventually(counted, "del 1 and expired 1")


async def test_subscriber_gap_is_repaired_by_comparing_leases(redis_url: str, leases: LeaseClient, make_view):
    gate = asyncio.Event()
    gate.set()
    view = RedisView(config(redis_url))

    async def before_subscribe() -> None:
        await gate.wait()

    view._before_subscribe = before_subscribe
    await view.start()
    try:
        await eventually(lambda: view._sub_connected, "the subscriber to connect")
        deleted = await leases.claim("g0", "w0", ttl_ms=60_000)
        assert deleted and await leases.claim("g1", "w1", ttl_ms=1_500)
        await view.refresh({})
        assert RedisCollector(view).status()["pools"]["a100"]["leases_held"] == 2  # both in the baseline
        # Cut the feed and keep it down while g0 is released and g1 expires.
        gate.clear()
        assert await kill_our_feeds(leases.deployment) >= 1
        await eventually(lambda: not view._sub_connected, "the subscriber to notice")
        assert await leases.release(deleted)

        async def g1_gone() -> bool:
            return not await leases.redis.exists(leases.keys.lease("g1"))

        await eventually(g1_gone, "g1 to expire")
        s = render(view)
        assert value(s, "llm_gpu_lease_releases_total", pool="a100", reason="del") == 0
        assert value(s, "llm_gpu_lease_releases_total", pool="a100", reason="expired") == 0
        gate.set()

        def repaired():
            s = render(view)
            return (
                value(s, "llm_gpu_lease_releases_total", pool="a100", reason="del"),
                value(s, "llm_gpu_lease_releases_total", pool="a100", reason="expired"),
            ) == (1, 1)

        await eventually(repaired, "the missed releases to be counted")
        await eventually(lambda: view._sub_connected, "the subscriber to reconnect")
        status = RedisCollector(view).status()["subscriber"]
        assert status["repaired_releases"] == {"del": 1, "expired": 1} and status["gaps"] == 1
        # And events flow again, counted once.
        again = await leases.claim("g2", "w2")
        assert again and await leases.release(again)
        await eventually(
            lambda: value(render(view), "llm_gpu_lease_releases_total", pool="a100", reason="del") == 2,
            "the next release",
        )
    finally:
        await view.stop()


async def test_redis_down_is_up_0_without_exception_and_recovers(own_redis_server, make_view):
    url = own_redis_server.url
    view = await make_view(config(url, timeout_s=1.0))
    await view.refresh({})
    assert value(render(view), "llm_redis_up") == 1

    own_redis_server.kill()
    await view.refresh({"vllm-a": "busy"})  # must not raise
    s = render(view)
    assert value(s, "llm_redis_up") == 0
    assert value(s, "llm_gpu_pool_size", pool="a100") is None  # no stale gauges
    assert value(s, "llm_gpu_lease_releases_total", pool="a100", reason="del") == 0  # counters stay
    status = RedisCollector(view).status()
    assert status["up"] is False and status["error"]

    own_redis_server.start()  # same port, empty: as after a crash
    await view.refresh({})
    assert value(render(view), "llm_redis_up") == 1
    # The subscriber is back by itself too.
    await eventually(lambda: view._sub_connected, "the subscriber to reconnect")
    c = LeaseClient.from_url(url)
    try:
        lease = await c.claim("g3", "w")
        assert lease and await c.release(lease)
    finally:
        await c.aclose()
    await eventually(
        lambda: value(render(view), "llm_gpu_lease_releases_total", pool="a100", reason="del") == 1,
        "a release after the restart",
    )


async def test_round_trips_do_not_grow_with_pools_or_routes(redis_url: str, leases: LeaseClient, make_view):
    small = await make_view(config(redis_url))
    big = await make_view(
        config(
            redis_url,
            pools=[{"name": f"p{i}", "gpus": [f"p{i}-g{j}" for j in range(500)]} for i in range(4)],
            routes=[f"r{i}" for i in range(8)],
        )
    )
    for i in range(0, 500, 3):
        assert await leases.claim(f"p0-g{i}", "w")
    q = AdmissionQueue.from_url(redis_url)
    try:
        for i in range(300):
            await q.enqueue(f"id{i}", f"r{i % 8}", "t", deadline_ms=now_ms() + 60_000)
    finally:
        await q.aclose()

    async def calls() -> dict[str, int]:
        stats = await leases.redis.info("commandstats")
        return {k: v["calls"] for k, v in stats.items()}

    before = await calls()
    await small.refresh({})
    await big.refresh({})
    after = await calls()
    assert small.round_trips_last == big.round_trips_last == 1
    assert big.commands_last > small.commands_last
    used = {k for k in after if after[k] != before.get(k, 0)}
    assert not {"cmdstat_keys", "cmdstat_scan"} & used, used
    assert value(render(big), "llm_gpu_leases_held", pool="p0") == 167


async def test_pools_and_routes_from_redis_sets(redis_url: str, leases: LeaseClient, make_view):
    r = leases.redis
    await r.sadd("gpu:pool:x", "x0", "x1", "x2")
    assert await leases.claim("x1", "w")
    assert await leases.claim("stray", "w")  # in no pool but found by discovery
    q = AdmissionQueue.from_url(redis_url)
    try:
        await q.enqueue("a", "chat", "t", deadline_ms=now_ms() + 60_000)
        await q.enqueue("b", "embed", "t", deadline_ms=now_ms() + 60_000)
    finally:
        await q.aclose()
    view = await make_view(
        parse_redis_config(
            {"url": redis_url, "pools": [{"name": "x", "set_key": "gpu:pool:x"}, {"name": "seen", "discover": True}]},
            "t.yaml",
        )
    )
    await view.refresh({})
    s = render(view)
    assert value(s, "llm_gpu_pool_size", pool="x") == 3
    assert value(s, "llm_gpu_leases_held", pool="x") == 1
    assert value(s, "llm_gpu_pool_size", pool="seen") == 2  # x1 and stray
    assert value(s, "llm_admission_queue_depth", route="chat") == 1
    assert value(s, "llm_admission_queue_depth", route="embed") == 1
    assert view.round_trips_last >= 2  # sets, the bounded SCAN (due now), the reads
    await view.refresh({})
    assert view.round_trips_last == 2  # discovery is not due again for discover_interval_s


async def test_keyspace_events_off_is_reported_not_raised(redis_url: str, leases: LeaseClient, make_view):
    await leases.redis.config_set("notify-keyspace-events", "")
    view = await make_view(config(redis_url))
    ks = RedisCollector(view).status()["keyspace_events"]
    assert ks["ok"] is False and ks["fix"] == "CONFIG SET notify-keyspace-events Egx"
    await view.refresh({})
    assert view.up
