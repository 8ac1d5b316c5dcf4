"""The exporter's `redis:` section: the GPU pools and admission routes it reads.

```yaml
redis:
  url: redis://127.0.0.1:6379/0     # or redis+sentinel://h1:26379,h2:26379/mymaster/0, redis+cluster://h1:7000,h2:7001
  lease_prefix: "gpu:lease:"          # what the schedulers already use
  pools:
    - {name: a100, gpus: [gpu0, gpu1], backends: {gpu0: vllm-a}}
    - {name: x, set_key: "gpu:pool:x"}
    - {name: seen, discover: true}     # the GPUs a bounded SCAN finds leased
  routes: [chat, batch]               # or omitted: the queue's routes set
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..store.keys import DEFAULT_LEASE_PREFIX, DEFAULT_QUEUE_PREFIX, DEFAULT_RETENTION_MS, LeaseKeys, QueueKeys
from ..store.target import TargetError, parse_target
from .fields import Section


@dataclass(frozen=True)
class PoolConfig:
    """A GPU pool: fixed ``gpus``, the members of the Redis set ``set_key``, or
    (``discover``) the GPUs a bounded SCAN finds leased. ``backends`` maps a GPU id to
    the backend name of the exporter's config, for drift."""

    name: str
    gpus: tuple[str, ...] = ()
    set_key: str | None = None
    discover: bool = False
    backends: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    lease_keys: LeaseKeys = field(default_factory=LeaseKeys)
    queue_prefix: str = DEFAULT_QUEUE_PREFIX
    queue_retention_ms: int = DEFAULT_RETENTION_MS
    pools: tuple[PoolConfig, ...] = ()
    routes: tuple[str, ...] | None = None  # None: the queue's routes set
    routes_set_key: str | None = None
    timeout_s: float = 2.0
    reconnect_max_s: float = 5.0
    queue_gc: bool = True
    discover_max_keys: int = 10_000
    discover_interval_s: float = 300.0

    @property
    def queue_keys(self) -> QueueKeys:
        return QueueKeys(self.queue_prefix)

    @property
    def routes_key(self) -> str:
        return self.routes_set_key or self.queue_keys.routes()


def redis_url(s: Section, name: str = "url", default: str = RedisConfig.url) -> str:
    """A Redis URL of any deployment (store.target): one server, Sentinel or Cluster.
    The error never repeats the URL: it may hold a password."""
    url = s.string(name, default)
    try:
        parse_target(url)
    except TargetError as e:
        raise s.error(name, str(e)) from None
    return url


def parse_redis_config(data: object, where: str, path: str = "redis") -> RedisConfig:
    """Parse the `redis:` section. Raises ConfigError naming the key (`redis.pools[1].gpus` ...)."""
    s = Section(data, where, path)
    d = RedisConfig()
    url = redis_url(s)
    try:
        lease_keys = LeaseKeys(
            s.string("lease_prefix", DEFAULT_LEASE_PREFIX),
            info_prefix=s.string("info_prefix", None),
            fence_prefix=s.string("fence_prefix", None),
            waiters_prefix=s.string("waiters_prefix", None),
        )
    except ValueError as e:
        raise s.error("lease_prefix", str(e)) from None
    routes = s.strings("routes", None)
    routes_set_key = s.string("routes_set_key", None)
    if routes is not None and routes_set_key is not None:
        raise s.error("routes_set_key", "give either routes or routes_set_key, not both")
    cfg = RedisConfig(
        url=url,
        lease_keys=lease_keys,
        queue_prefix=s.string("queue_prefix", d.queue_prefix),
        queue_retention_ms=s.integer("queue_retention_ms", d.queue_retention_ms),
        pools=_pools(s),
        routes=routes,
        routes_set_key=routes_set_key,
        timeout_s=s.number("timeout_s", d.timeout_s, above=0, maximum=600),
        reconnect_max_s=s.number("reconnect_max_s", d.reconnect_max_s, above=0, maximum=3600),
        queue_gc=s.boolean("queue_gc", d.queue_gc),
        discover_max_keys=s.integer("discover_max_keys", d.discover_max_keys),
        discover_interval_s=s.number("discover_interval_s", d.discover_interval_s, above=0),
    )
    s.done()
    return cfg


def _pools(s: Section) -> tuple[PoolConfig, ...]:
    pools: list[PoolConfig] = []
    for p in s.items("pools"):
        name = p.string("name")
        if any(other.name == name for other in pools):
            raise p.error("name", f"pool {name!r} is defined twice")
        sources = [k for k in ("gpus", "set_key", "discover") if k in p]
        if len(sources) != 1:
            raise p.whole_error(f"needs exactly one of gpus, set_key, discover; got {sources or 'none'}")
        gpus = p.strings("gpus", ())
        for i, gpu in enumerate(gpus):
            if any(c.isspace() for c in gpu):
                raise p.error(f"gpus[{i}]", f"GPU id {gpu!r} contains whitespace")
        set_key = p.string("set_key", None)
        discover = p.raw("discover", False)
        if "discover" in p and discover is not True:
            raise p.error("discover", "must be true (or leave it out)")
        backends = p.mapping("backends")
        for gpu, backend in backends.items():
            if not isinstance(gpu, str) or not gpu:
                raise p.error("backends", f"GPU ids must be non-empty strings, got {gpu!r}")
            if not isinstance(backend, str) or not backend:
                raise p.error(f"backends.{gpu}", f"must be a backend name, got {backend!r}")
            if gpus and gpu not in gpus:
                raise p.error(f"backends.{gpu}", f"GPU {gpu!r} is not in {p.path}.gpus")
        p.done()
        pools.append(PoolConfig(name, gpus, set_key, bool(discover), dict(backends)))
    return tuple(pools)
