"""The gate's YAML configuration (`llm-health gate`), parsed once into typed values.

```yaml
admission: {reject_if_queue_age_ms_gte: 3000, reject_if_retry_count_gte: 1, ignore_worker_util_when_slack_ms_lte: 0}
gate:
  redis: redis://127.0.0.1:6379/0
  sample_interval: 15s
  max_body_bytes: 67108864                              # 64 MiB (the default): larger bodies are a 413
  admin_token_file: /etc/llm-health/gate-admin.token    # or admin_token_env
  routes:
    chat: {upstream: http://10.0.0.5:8000, models: [llama], default_deadline_ms: 30000, redis_down: open, backends: [gpu-a, gpu-b]}
    # allow: ["POST /v1/chat/completions", "GET /v1/models"]   # default: the inference API
  tenants:
    acme: {token_units_per_minute: 200000}
```

`admission:` holds the policy for every route; a route may override any of its keys.
A route forwards only the inference API (`core.forwarding.DEFAULT_ALLOW`) unless its
`allow:` lists the endpoints it forwards; an engine's admin and dev endpoints never.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..core.admission import MODES, REDIS_DOWN_MODES, Policy, ReopenGuard
from ..core.forwarding import DEFAULT_RULES, AllowError, Rule, parse_allow
from ..store.keys import DEFAULT_QUEUE_PREFIX
from .fields import NAME, Section
from .redis import redis_url

ROUTE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_DEADLINE_MS = 7 * 86400 * 1000  # a week: any longer is a unit mistake


@dataclass
class Route:
    name: str
    upstream: str
    policy: Policy
    models: tuple[str, ...] = ()
    guard: ReopenGuard = field(default_factory=ReopenGuard)
    allow: tuple[Rule, ...] = DEFAULT_RULES  # the endpoints forwarded (core.forwarding)
    # The exporter's names of the backends the route sends to: their engine queue ages
    # (published by `llm-health serve` to Redis) count in the route's queue age.
    backends: tuple[str, ...] = ()


@dataclass
class GateConfig:
    routes: dict[str, Route]
    redis_url: str = "redis://127.0.0.1:6379/0"
    queue_prefix: str = DEFAULT_QUEUE_PREFIX
    tenants: dict[str, float] = field(default_factory=dict)  # token units per minute
    sample_interval: float = 15.0  # the scrape interval the reopen rule counts in
    upstream_timeout: float = 600.0
    max_body_bytes: int = 64 * 1024 * 1024  # a request body over this is a 413 before admission
    admin_token: str | None = field(default=None, repr=False)
    source: str = "<config>"


def read_policy(s: Section, base: Policy) -> Policy:
    """The policy keys of `s` (the `admission:` block, or a route's overrides) over `base`."""
    return Policy(
        reject_if_queue_age_ms_gte=s.number("reject_if_queue_age_ms_gte", base.reject_if_queue_age_ms_gte, minimum=0, maximum=MAX_DEADLINE_MS),
        reject_if_retry_count_gte=s.integer("reject_if_retry_count_gte", base.reject_if_retry_count_gte, minimum=0),
        ignore_worker_util_when_slack_ms_lte=s.number(
            "ignore_worker_util_when_slack_ms_lte", base.ignore_worker_util_when_slack_ms_lte, minimum=-MAX_DEADLINE_MS, maximum=MAX_DEADLINE_MS
        ),
        mode=s.choice("mode", MODES, base.mode),
        default_deadline_ms=s.number("default_deadline_ms", base.default_deadline_ms, above=0, maximum=MAX_DEADLINE_MS),
        late_status=s.integer("late_status", base.late_status, minimum=400, maximum=599),
        redis_down=s.choice("redis_down", REDIS_DOWN_MODES, base.redis_down),
        engine_age_unknown=s.choice("engine_age_unknown", REDIS_DOWN_MODES, base.engine_age_unknown) if "engine_age_unknown" in s else base.engine_age_unknown,
        retry_match_window_ms=s.number("retry_match_window_ms", base.retry_match_window_ms, minimum=0, maximum=MAX_DEADLINE_MS),
        expected_service_ms=s.number("expected_service_ms", base.expected_service_ms, minimum=0, maximum=MAX_DEADLINE_MS),
    )


def parse_gate_config(data: object, where: str = "<config>") -> GateConfig:
    top = Section(data, where)
    admission = top.section("admission")
    base = read_policy(admission, Policy())
    admission.done()
    if "gate" not in top:
        raise top.error("gate", "missing or not a mapping (needs at least gate.routes)")
    gate = top.section("gate")
    if "routes" not in gate or not gate.mapping("routes"):
        raise gate.error("routes", "expected a mapping of route name to {upstream: URL, ...}")
    routes: dict[str, Route] = {}
    for name, r in gate.entries("routes"):
        if not ROUTE_NAME.match(name):
            raise r.whole_error("route names use letters, digits and _ . : - only")
        upstream = r.url("upstream").rstrip("/")
        models = r.strings("models", (), nonempty=False)
        allow = DEFAULT_RULES
        if "allow" in r:
            try:
                allow = parse_allow(r.strings("allow"))
            except AllowError as exc:
                raise r.error("allow", str(exc)) from None
        backends = r.strings("backends", (), nonempty=False)
        for i, b in enumerate(backends):
            if not NAME.match(b):
                raise r.error(f"backends[{i}]", f"not a backend name of the exporter (letters, digits and _ . : -, at most 128), got {b[:64]!r}")
        if len(set(backends)) != len(backends):
            raise r.error("backends", "lists a backend twice")
        routes[name] = Route(name, upstream, read_policy(r, base), models, allow=allow, backends=backends)
        r.done()
    tenants: dict[str, float] = {}
    for tenant, t in gate.entries("tenants"):
        tenants[tenant] = t.number("token_units_per_minute", above=0)
        t.done()
    cfg = GateConfig(
        routes=routes,
        redis_url=redis_url(gate, "redis", GateConfig.redis_url),
        queue_prefix=gate.string("queue_prefix", DEFAULT_QUEUE_PREFIX),
        tenants=tenants,
        sample_interval=gate.duration("sample_interval", GateConfig.sample_interval),
        upstream_timeout=gate.duration("upstream_timeout", GateConfig.upstream_timeout),
        max_body_bytes=gate.integer("max_body_bytes", GateConfig.max_body_bytes, minimum=1024, maximum=1024**3),
        admin_token=gate.secret("admin_token"),
        source=where,
    )
    gate.done()
    top.done()
    return cfg
