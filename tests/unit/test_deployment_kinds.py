"""One Deployment class per Redis kind, chosen by the URL's scheme (store.deployment), and
what each answers without a server: the key layout, where its commands go, whether the
gate's lean connection may serve it. The kinds' behaviour on real servers is in
tests/integration (test_leases, test_redis_deployments, ... on every kind)."""

from __future__ import annotations

import pytest
from redis import asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from llm_health.config.gate import GateConfig
from llm_health.gate.nginx_lua import PlanError, plan
from llm_health.store.codes import StoreError
from llm_health.store.deployment import BY_SCHEME, connect, wrap
from llm_health.store.deployment_cluster import ClusterDeployment
from llm_health.store.deployment_sentinel import SentinelDeployment
from llm_health.store.deployment_single import SingleDeployment
from llm_health.store.fast_redis import FastRedis
from llm_health.store.keys import LeaseKeys
from llm_health.store.target import ALL_SCHEMES, RedisTarget, parse_target, redacted

URLS = {
    "redis://:pw@10.0.0.1:6380/2": SingleDeployment,
    "rediss://h:6379/0": SingleDeployment,
    "unix:///run/redis.sock?db=1": SingleDeployment,
    "redis+sentinel://s1:26379,s2:26379/mymaster/3": SentinelDeployment,
    "rediss+sentinel://s1/mymaster": SentinelDeployment,
    "redis+cluster://n1:7000,n2:7001": ClusterDeployment,
    "rediss+cluster://n1:7000": ClusterDeployment,
}


def test_every_scheme_has_a_url_here():
    assert {u.split("://")[0] for u in URLS} == set(ALL_SCHEMES) == set(BY_SCHEME)


@pytest.mark.parametrize(("url", "kind"), URLS.items())
async def test_each_scheme_makes_its_kind_s_class(url: str, kind: type):
    dep = connect(url)
    try:
        assert type(dep) is kind and dep.kind == parse_target(url).kind
        assert type(connect(parse_target(url))) is kind  # a parsed target picks the same
    finally:
        await dep.aclose()


@pytest.mark.parametrize(
    "url",
    ["http://app:hunter2@h:1/0", "redis+memcached://:hunter2@h1:1,h2:2/m?sentinel_password=hunter2", "localhost:6379", "app:hunter2@h"],
)
def test_a_scheme_with_no_kind_is_a_store_error_naming_the_url_without_its_password(url: str):
    with pytest.raises(StoreError) as err:
        connect(url)
    assert redacted(url) in str(err.value) and "hunter2" not in str(err.value)
    assert "redis+sentinel://" in str(err.value)  # and says what would do


def test_a_target_whose_url_has_no_kind_is_refused_the_same():
    with pytest.raises(StoreError, match="'memcached://h:1' is no Redis URL"):
        connect(RedisTarget("single", url="memcached://:hunter2@h:1"))


def test_redacted_keeps_where_and_drops_the_secrets():
    assert redacted("redis+sentinel://app:pw@s1:26379,s2/mymaster/0?sentinel_password=sp") == "redis+sentinel://s1:26379,s2/mymaster/0"
    assert redacted("redis://:p/w@h:1/0") == "redis://h:1/0"  # a password with a slash
    assert redacted("unix:///run/redis.sock?db=2") == "unix:///run/redis.sock"
    # a raw "?" in a password, an "@" in the query: nothing of either shown
    assert redacted("redis://app:pa?ss@h:1/0") == "redis://..."
    assert redacted("redis+sentinel://s1/mymaster?sentinel_password=a@b") == "redis+sentinel://..."


async def test_wrap_picks_the_kind_by_the_client_s_class():
    single = wrap(aioredis.Redis(host="h", port=1, db=3, decode_responses=True))
    cluster = wrap(RedisCluster(startup_nodes=[ClusterNode("n1", 7000)], decode_responses=True))
    try:
        assert type(single) is SingleDeployment and single.db == 3 and single.wait_replicas == 0
        assert type(cluster) is ClusterDeployment and cluster.wait_replicas == 1
    finally:
        await single.aclose()
        await cluster.aclose()


async def test_the_key_layout_is_the_kind_s():
    deps = {kind: connect(url) for url, kind in URLS.items() if url.startswith("redis")}
    try:
        for kind, dep in deps.items():
            tagged = kind is ClusterDeployment
            assert dep.one_keyspace is not tagged
            assert dep.tag("gpu0") == ("{gpu0}" if tagged else "gpu0")
            assert dep.lease_keys().lease("g") == ("gpu:lease:{g}" if tagged else "gpu:lease:g")
            assert dep.lease_keys(LeaseKeys("x:lease:")).lease("g") == ("x:lease:{g}" if tagged else "x:lease:g")
            assert dep.queue_keys("q:").prefix == ("{q}:" if tagged else "q:")
    finally:
        for dep in deps.values():
            await dep.aclose()


async def test_commands_for_a_primary_go_where_the_kind_sends_them():
    single, sentinel, cluster = (connect(u) for u in ("redis://h:1/0", "redis+sentinel://s1/m", "redis+cluster://n1:7000"))
    try:
        assert single.primary_client("h", 1) is single.client and sentinel.primary_client("x", 2) is sentinel.client
        assert cluster.primary_client("n1", 7000) is cluster.node("n1", 7000) is not cluster.client
        # No slot map to ask on one server or Sentinel: a MOVED there is an answer (store.queue).
        assert not await single.refresh_topology() and not await sentinel.refresh_topology()
        assert not await single.follow_primary() and not await cluster.follow_primary()
    finally:
        for dep in (single, sentinel, cluster):
            await dep.aclose()


async def test_only_one_server_has_a_pool_of_its_own_for_the_lean_connection():
    single = connect("redis://h:1/0", max_connections=4, blocking_timeout=0.5)
    others = [connect("redis+sentinel://s1/m"), connect("redis+cluster://n1:7000")]
    try:
        assert isinstance(single.server_pool(), aioredis.BlockingConnectionPool)
        assert [d.server_pool() for d in others] == [None, None]
        assert FastRedis.for_deployment(single) is not None
        assert [FastRedis.for_deployment(d) for d in others] == [None, None]
    finally:
        for dep in (single, *others):
            await dep.aclose()


async def test_one_server_warns_of_nothing_without_asking():
    dep = connect("redis://127.0.0.1:1/0")  # nothing listens: a question would fail
    try:
        assert await dep.startup_warnings() == []
    finally:
        await dep.aclose()


@pytest.mark.parametrize("url", [u for u in URLS if not u.startswith("redis://")])
def test_the_nginx_lua_door_takes_only_one_server_over_plain_tcp(url: str):
    assert not parse_target(url).plain_tcp
    with pytest.raises(PlanError, match="not supported by it"):
        plan(GateConfig(routes={}, redis_url=url))
    assert parse_target("redis://h:1/0").plain_tcp
