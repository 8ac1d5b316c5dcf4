"""Redis URLs of the three deployments (store.target) and the Cluster key layout
(store.keys): pure, no server."""

from __future__ import annotations

import pytest

from llm_health.config.errors import ConfigError
from llm_health.config.redis import parse_redis_config
from llm_health.store.keys import LeaseKeys, QueueKeys
from llm_health.store.target import ALL_REPLICAS, TargetError, parse_target


def test_one_server_url_keeps_redis_py_form_and_drops_our_parameters():
    t = parse_target("redis://:s3cret@10.0.0.1:6380/2?wait_replicas=1&wait_timeout_ms=50&health_check_interval=3")
    assert (t.kind, t.db, t.wait_replicas, t.wait_timeout_ms) == ("single", 2, 1, 50)
    assert t.single_url == "redis://:s3cret@10.0.0.1:6380/2?health_check_interval=3"
    assert "s3cret" not in t.describe() and "s3cret" not in repr(t)
    assert parse_target("unix:///run/redis.sock?db=4").single_url == "unix:///run/redis.sock?db=4"
    assert parse_target("redis://h/0").wait_replicas == 0  # nothing to wait for by default


def test_sentinel_url_names_the_sentinels_the_service_and_the_database():
    t = parse_target("redis+sentinel://app:pw@s1:26379,s2,[::1]:26380/mymaster/3?sentinel_password=sp")
    assert t.kind == "sentinel" and t.service == "mymaster" and t.db == 3
    assert t.hosts == (("s1", 26379), ("s2", 26379), ("::1", 26380))
    assert (t.username, t.password, t.sentinel_password) == ("app", "pw", "sp")
    assert t.wait_replicas == ALL_REPLICAS  # every replica Sentinel lists as up, by default
    assert parse_target("redis+sentinel://s1/m?wait_replicas=1").wait_replicas == 1
    assert parse_target("redis+sentinel://s1/m?wait_replicas=all").wait_replicas == ALL_REPLICAS
    assert parse_target("rediss+sentinel://s1/m").tls and parse_target("redis+sentinel://s1/m").db == 0


def test_cluster_url_names_seed_nodes_and_has_database_zero_only():
    t = parse_target("redis+cluster://n1:7000,n2:7001?wait_replicas=0")
    assert (t.kind, t.hosts, t.wait_replicas) == ("cluster", (("n1", 7000), ("n2", 7001)), 0)
    assert "n1:7000,n2:7001" in t.describe()


@pytest.mark.parametrize(
    ("url", "names"),
    [
        ("http://h:1", "must start with one of"),
        ("redis+sentinel://s1:26379", "needs the service name"),
        ("redis+sentinel://s1/m/x", "/<service>[/<db>]"),
        ("redis+cluster://n1:notaport", "'n1:notaport' is not host:port"),
        ("redis+cluster://n1:7000/2", "database 0 only"),
        ("redis://h/0?wait_replicas=-1", "wait_replicas=-1 must be at least 0"),
        ("redis://h/0?wait_timeout_ms=x", "wait_timeout_ms='x' is not an integer"),
        ("redis://h/zero", "database 'zero' is not a number"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, names: str):
    with pytest.raises(TargetError, match=None) as err:
        parse_target(url)
    assert names in str(err.value)


def test_config_refuses_a_bad_url_naming_the_key_without_echoing_a_password():
    with pytest.raises(ConfigError) as err:
        parse_redis_config({"url": "redis+cluster://:hunter2@n1:7000/5"}, "llm-health.yaml")
    assert err.value.key == "redis.url" and "database 0 only" in str(err.value)
    assert "hunter2" not in str(err.value)
    assert parse_redis_config({"url": "redis+sentinel://s1,s2/mymaster/0"}, "x").url.startswith("redis+sentinel://")


def test_cluster_layout_tags_each_gpu_and_the_whole_queue():
    k = LeaseKeys().tagged()
    assert (k.lease("gpu0"), k.info("gpu0"), k.fence("gpu0"), k.waiters("a100")) == (
        "gpu:lease:{gpu0}",
        "gpu:leaseinfo:{gpu0}",
        "gpu:fence:{gpu0}",
        "gpu:waiters:{a100}",
    )
    assert k.gpu_of("gpu:lease:{gpu0}") == "gpu0" and k.gpu_of("gpu:lease:gpu0") is None
    assert LeaseKeys("sched:lease:").tagged().lease("g") == "sched:lease:{g}"
    assert QueueKeys().tagged().record("t/1") == "{llm:admission}:req:t/1"
    assert QueueKeys("{q}:").tagged().prefix == "{q}:"  # a prefix with a tag is kept
