"""`shard: {index, total}`: every backend watched by exactly one shard, refused settings
named by key. That the hash is Prometheus' own `hashmod` is checked against a real
Prometheus in tests/integration/test_sharding.py."""

from __future__ import annotations

import hashlib

import pytest

from llm_health.config import exporter as config
from llm_health.config.errors import ConfigError
from llm_health.core.shard import Shard, hashmod

NAMES = [f"gpu-{i}" for i in range(300)] + ["a", "node7:8000", "ünïcode"]


def fleet(n: int, shard: str = "") -> str:
    lines = ["backends:"] + [f"  - {{name: gpu-{i}, url: 'http://10.0.0.{i % 250}:8000'}}" for i in range(n)]
    return "\n".join(lines) + "\n" + shard


@pytest.mark.parametrize("total", [1, 2, 3, 7])
def test_every_backend_has_exactly_one_shard(total):
    owners = {name: [i for i in range(total) if Shard(i, total).owns(name)] for name in NAMES}
    assert all(len(o) == 1 for o in owners.values()), owners
    if total > 1:  # md5 spreads 303 names: no shard is empty or holds nearly all of them
        sizes = [sum(1 for o in owners.values() if o == [i]) for i in range(total)]
        assert min(sizes) > len(NAMES) / total / 2, sizes


def test_hashmod_is_md5_last_eight_bytes_big_endian():
    # The definition in Prometheus' relabel.go, written out a second way.
    for name in NAMES:
        tail = hashlib.md5(name.encode()).hexdigest()[16:]
        assert hashmod(name, 5) == int(tail, 16) % 5


def test_watched_is_the_shard_of_the_configured_list(tmp_path):
    f = tmp_path / "c.yml"
    parts = []
    for index in range(3):
        f.write_text(fleet(40, f"shard: {{index: {index}, total: 3}}\n"))
        cfg = config.load(f)
        assert len(cfg.backends) == 40 and cfg.shard == Shard(index, 3)
        parts.append({b.name for b in cfg.watched()})
    assert set().union(*parts) == {f"gpu-{i}" for i in range(40)}
    assert sum(len(p) for p in parts) == 40  # disjoint
    f.write_text(fleet(5))
    assert len(config.load(f).watched()) == 5  # no shard: every backend


@pytest.mark.parametrize(
    "shard,key,problem",
    [
        ("shard: {index: 2, total: 2}", "shard.index", "must be below shard.total (2)"),
        ("shard: {index: 5, total: 3}", "shard.index", "numbered 0 to 2"),
        ("shard: {index: -1, total: 3}", "shard.index", "at least 0"),
        ("shard: {index: 0, total: 0}", "shard.total", "positive integer"),
        ("shard: {total: 2}", "shard.index", "missing"),
        ("shard: {index: 0}", "shard.total", "missing"),
        ("shard: {index: 0, total: 2, replicas: 2}", "shard.replicas", "unknown key"),
        ("shard: {index: '0', total: 2}", "shard.index", "integer"),
    ],
)
def test_a_shard_that_cannot_cover_the_fleet_is_refused(tmp_path, shard, key, problem):
    f = tmp_path / "bad.yml"
    f.write_text(fleet(3, shard + "\n"))
    with pytest.raises(ConfigError) as err:
        config.load(f)
    msg = str(err.value)
    assert str(f) in msg and key in msg and problem in msg, msg


def test_the_shard_class_refuses_what_the_config_refuses():
    with pytest.raises(ValueError):
        Shard(3, 3)
    with pytest.raises(ValueError):
        hashmod("x", 0)
