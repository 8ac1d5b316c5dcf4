"""The exporter's YAML configuration (`llm-health serve`), parsed once into typed values.

```yaml
global:                      # every key optional; these are the defaults
  interval: 10s              # seconds between rounds per backend
  hung_after_seconds: 60     # least time without progress before `hung`
  no_output_after_seconds: 120  # requests running, steps moving, no token or finished request: a livelock past this
  probe_interval: 60s        # at most one 1-token probe per idle backend per this
  probe_timeout: 5s
  connect_timeout: 3s
  metrics_timeout: 30s       # a slow /metrics is load, not death: keep this generous
  models_timeout: 10s
  max_metrics_bytes: 16777216  # a /metrics body (after gzip is undone) past this is refused
  max_engines: 256           # engine units (model_name x rank) one payload may hold
  max_samples: 10000         # samples of the series llm-health reads, per payload
  max_label_length: 512      # characters of a model_name or engine label value
  max_probe_targets: 1000    # state kept for /probe?target=... (least recently used dropped)
probe:                       # the blackbox-style /probe endpoint
  enabled: true
  allowed_targets: []        # regular expressions a target URL must match in full; empty: any
  max_engines: 10000         # engine units kept across every /probe target (least recently used dropped)
backends:
  - name: gpu0               # the `backend` label
    url: http://10.0.0.5:8000
    kind: engine             # engine (any engine with /metrics, detected) or proxy (/v1/models only); vllm: old spelling of engine
    interval: 10s            # optional, overrides global
    api_key_env: VLLM_API_KEY      # or api_key_file: /etc/llm-health/gpu0.key
redis: {...}                 # optional: see docs/redis-schema.md
shard:                       # optional: several replicas share the backends above
  index: 0                   # this replica's shard, 0 .. total-1
  total: 1                   # replicas (not counting HA copies) the fleet is split over
```
With `shard:`, a replica watches only the backends whose name hashes to its index, with
Prometheus' `hashmod` (core/shard.py); every replica is given the whole list.
Durations are seconds, or strings with a unit: `500ms`, `10s`, `5m`, `1h`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

from ..core import kinds, timing
from ..core.engines import Limits
from ..core.health import Settings
from ..core.shard import Shard
from .fields import NAME, Section
from .load import load_yaml
from .redis import RedisConfig, parse_redis_config

KINDS = kinds.KINDS


@dataclass(frozen=True)
class Timing:
    interval: float = timing.INTERVAL_S
    hung_after_seconds: float = timing.HUNG_AFTER_S
    no_output_after_seconds: float = Settings.no_output_after_seconds
    probe_interval: float = timing.PROBE_INTERVAL_S
    probe_timeout: float = timing.PROBE_TIMEOUT_S
    connect_timeout: float = timing.CONNECT_TIMEOUT_S
    metrics_timeout: float = timing.METRICS_TIMEOUT_S
    models_timeout: float = timing.MODELS_TIMEOUT_S
    max_metrics_bytes: int = 16 * 1024 * 1024
    max_engines: int = Limits.max_engines
    max_samples: int = Limits.max_samples
    max_label_length: int = Limits.max_label_length
    max_probe_targets: int = 1000

    def settings(self) -> Settings:
        return Settings(hung_after_seconds=self.hung_after_seconds, probe_interval=self.probe_interval, no_output_after_seconds=self.no_output_after_seconds)

    def limits(self) -> Limits:
        return Limits(max_engines=self.max_engines, max_samples=self.max_samples, max_label_length=self.max_label_length)


@dataclass(frozen=True)
class ProbeConfig:
    """`/probe`: on or off, which targets it may read, and how much state it keeps."""

    enabled: bool = True
    allowed_targets: tuple[re.Pattern[str], ...] = ()  # empty: any http(s) target
    max_engines: int = 10_000

    def allows(self, target: str) -> bool:
        return not self.allowed_targets or any(p.fullmatch(target) for p in self.allowed_targets)


@dataclass(frozen=True)
class Backend:
    name: str
    url: str
    kind: str = kinds.ENGINE
    timing: Timing = field(default_factory=Timing)
    api_key: str | None = field(default=None, repr=False)  # never printed

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", kinds.normalize(self.kind))  # `vllm`: the old spelling of `engine`


@dataclass(frozen=True)
class Config:
    timing: Timing
    backends: tuple[Backend, ...]
    redis: RedisConfig | None = None
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    source: str = "<config>"
    shard: Shard = field(default_factory=Shard)

    def watched(self) -> tuple[Backend, ...]:
        """The backends this replica watches: those of its shard (all of them unsharded)."""
        return tuple(b for b in self.backends if self.shard.owns(b.name))


_DURATIONS = (
    "interval",
    "hung_after_seconds",
    "no_output_after_seconds",
    "probe_interval",
    "probe_timeout",
    "connect_timeout",
    "metrics_timeout",
    "models_timeout",
)


def _timing(s: Section, base: Timing, *, per_backend: bool = False) -> Timing:
    """The timing and limit keys of `s` over `base`. A backend may override all of them but
    `max_probe_targets`, which only `global:` has."""
    values: dict[str, float | int] = {}
    for key in _DURATIONS:
        if key in s:
            values[key] = s.duration(key, minimum=0.0 if key != "interval" else 0.05)
        else:
            s.raw(key)
    values["max_metrics_bytes"] = s.integer("max_metrics_bytes", base.max_metrics_bytes, maximum=1024**3)
    values["max_engines"] = s.integer("max_engines", base.max_engines, maximum=1_000_000)
    values["max_samples"] = s.integer("max_samples", base.max_samples, maximum=10_000_000)
    values["max_label_length"] = s.integer("max_label_length", base.max_label_length, maximum=1_000_000)
    if not per_backend:
        values["max_probe_targets"] = s.integer("max_probe_targets", base.max_probe_targets, maximum=1_000_000)
    return replace(base, **values)  # type: ignore[arg-type]


def parse(data: object, where: str = "<config>") -> Config:
    top = Section(data, where)
    g = top.section("global")
    timing = _timing(g, Timing())
    g.done()

    backends: list[Backend] = []
    seen: set[str] = set()
    for entry in top.items("backends"):
        name = entry.string("name", pattern=NAME, what="use letters, digits and _ . : - only (at most 128)")
        if name in seen:
            raise entry.error("name", f"duplicate backend name {name!r}")
        seen.add(name)
        url = entry.url("url")
        kind = kinds.normalize(entry.choice("kind", kinds.ACCEPTED, kinds.ENGINE))
        backend_timing = _timing(entry, timing, per_backend=True)
        api_key = entry.secret("api_key")
        entry.done()
        backends.append(Backend(name=name, url=url, kind=kind, timing=backend_timing, api_key=api_key))

    redis = parse_redis_config(top.raw("redis"), where) if "redis" in top else None
    probe = _probe(top.section("probe"))
    shard = _shard(top.section("shard")) if "shard" in top else Shard()
    top.done()
    return Config(timing=timing, backends=tuple(backends), redis=redis, probe=probe, source=where, shard=shard)


def _shard(s: Section) -> Shard:
    """Both keys required: a replica that forgot its index would silently watch shard 0."""
    total = s.integer("total", maximum=10_000)
    index = s.integer("index", minimum=0)
    if index >= total:
        raise s.error("index", f"must be below shard.total ({total}): shards are numbered 0 to {total - 1}, got {index}")
    s.done()
    return Shard(index=index, total=total)


def _probe(s: Section) -> ProbeConfig:
    patterns = []
    for i, text in enumerate(s.strings("allowed_targets", (), nonempty=False)):
        try:
            patterns.append(re.compile(text))
        except re.error as exc:
            raise s.error(f"allowed_targets[{i}]", f"not a regular expression: {exc}") from None
    probe = ProbeConfig(
        enabled=s.boolean("enabled", True),
        allowed_targets=tuple(patterns),
        max_engines=s.integer("max_engines", ProbeConfig.max_engines, maximum=10_000_000),
    )
    s.done()
    return probe


def load(path: str | os.PathLike[str]) -> Config:
    return parse(load_yaml(path), str(path))
