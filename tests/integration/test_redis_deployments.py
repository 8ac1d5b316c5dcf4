"""What differs between one server, Sentinel and Cluster, on the real thing: scripts lost
by a node (NOSCRIPT), the start-up checks, the deployment series of the exporter."""

from __future__ import annotations

import logging

import pytest

from llm_health.config.redis import parse_redis_config
from llm_health.exporter.redis_collector import RedisCollector
from llm_health.exporter.redis_view import RedisView
from llm_health.store.leases import LeaseClient
from tests.fixtures.redis_ops import set_everywhere


async def test_a_node_that_lost_its_scripts_still_claims(any_redis_url: str):
    c = LeaseClient.from_url(any_redis_url)
    try:
        assert await c.claim("g0", "a") is not None
        for host, port in await c.deployment.primaries():  # what a failover or restart leaves
            node = c.deployment.primary_client(host, port)
            await node.script_flush()
        lease = await c.claim_any(["g0", "g1"], "b")
        assert lease is not None and lease.gpu == "g1"
        assert await c.renew(lease) and await c.release(lease)
    finally:
        await c.aclose()


async def test_start_up_names_primaries_without_min_replicas_to_write(any_redis_url: str, redis_kind: str, caplog: pytest.LogCaptureFixture):
    cfg = parse_redis_config({"url": any_redis_url, "pools": [{"name": "p", "gpus": ["g0"]}]}, "t.yaml")
    view = RedisView(cfg)
    try:
        await set_everywhere(view.deployment, "min-replicas-to-write", "0")
        with caplog.at_level(logging.WARNING, logger="llm_health.exporter.redis_view"):
            await view.start()
        notes = [r.getMessage() for r in caplog.records if "min-replicas-to-write" in r.getMessage()]
        primaries = await view.deployment.primaries()
        # One server has no replicas to require; Sentinel and Cluster name every primary.
        assert len(notes) == (0 if redis_kind == "single" else len(primaries)), notes
        await view.refresh({})
        status = RedisCollector(view).status()
        assert status["up"] is True
        text = "".join(f"{m.name}{s.labels}{s.value}\n" for m in RedisCollector(view).families(False) for s in m.samples)
        assert f"llm_redis_deployment_info{{'deployment': '{redis_kind}'}}1.0" in text
    finally:
        await view.stop()


async def test_a_redis_py_cluster_client_works_as_given(redis_cluster):
    """redis-py's own RedisCluster handed to LeaseClient: the Cluster layout and routing."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    redis_cluster.flushall()
    host, port = "127.0.0.1", redis_cluster.primary_ports()[0]
    c = LeaseClient(RedisCluster(startup_nodes=[ClusterNode(host, port)], decode_responses=True))
    try:
        lease = await c.claim_any(["g0", "g1", "g2"], "w")
        assert lease is not None and c.keys.lease(lease.gpu) == f"gpu:lease:{{{lease.gpu}}}"
        assert await c.redis.get(c.keys.lease(lease.gpu)) == "w"
        assert await c.check_fence(lease.gpu, lease.token) and await c.release(lease)
    finally:
        await c.aclose()


async def test_each_new_wait_is_woken_by_the_release_and_counts_no_failover(any_redis_url: str):
    """The feed is made and dropped with every wait: made again, it is a fresh
    subscription, not a topology change (which would re-check every GPU and count one)."""
    import asyncio

    from llm_health.store.records import Pool

    c = LeaseClient.from_url(any_redis_url)
    try:
        for i in range(3):
            held = await c.claim("g0", f"busy{i}")
            assert held is not None

            async def release(h=held) -> None:
                assert await c.release(h)

            got = await c.wait_for_gpu(Pool("p", ["g0"]), f"w{i}", timeout=30, fallback_interval_s=3600, after_first_miss=release)
            assert got is not None and got.via == "del", got
            assert await c.release(got)
            await asyncio.sleep(0)
        assert c.deployment.failovers_seen == 0
    finally:
        await c.aclose()
