"""The nginx Lua door's plan: what nginx needs to decide by itself, compiled from the
gate's configuration file (`llm-health nginx-lua`).

nginx with its Lua module (Debian: libnginx-mod-http-lua, lua-nginx-redis) runs the door
in `gate/nginx/llm_health.lua`: it reads the headers, hashes the body into the retry
fingerprint, sends the one decision script every door sends (`store.scripts.DECIDE_LUA`,
the policy inside it: `store.policy`) in one `EVALSHA` over a keepalive pool, answers a
refusal as every door does, and records each attempt's end from `log_by_lua`, carried
by the worker's next decision or its ends timer (`store.ends`). No Python runs on the request path. What varies by configuration (the Redis server, the
routes with their policies, keys, backends and allowlists, the tenants' budgets) and the
scripts themselves come from here, as a Lua table: the configuration is validated once,
by the same parser as the gate's, and nginx never parses YAML.

Written by hand because nothing turns a Python structure into Lua source; it emits only
tables, strings (every byte outside printable ASCII as a decimal escape), integers,
floats (repr, read back exactly) and booleans.
"""

from __future__ import annotations

import hashlib
import re
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from ..config.gate import GateConfig, Route
from ..core import forwarding
from ..store.codes import RETRYABLE_CODES
from ..store.ends import DECIDE_ARGS, DECIDE_ENDS_LUA, ENDS_LUA
from ..store.keys import DEFAULT_RETENTION_MS, QueueKeys
from ..store.policy import POLICY_LUA, policy_args
from ..store.scripts import DECIDE_LUA, GAVE_UP_MS, GC_LIMIT
from ..store.target import parse_target
from .headers import GateError

MODULE = "llm_health.lua"  # the door itself, shipped in this package (gate/nginx/)
PLAN = "llm_health_plan.lua"


class PlanError(GateError, ValueError):
    """A configuration the nginx Lua door cannot run; the message says what and why."""


def module_source() -> str:
    """The door's Lua module, as shipped."""
    return resources.files("llm_health.gate").joinpath("nginx", MODULE).read_text()


def lua(value: Any, indent: str = "") -> str:
    """`value` as Lua source: dicts as tables with string keys, lists and tuples as arrays."""
    if value is None:
        return "nil"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(c if " " <= c <= "~" and c not in '"\\' else "".join(f"\\{b:03d}" for b in c.encode()) for c in value) + '"'
    inner = indent + "  "
    if isinstance(value, dict):
        items = [f"{inner}[{lua(str(k))}] = {lua(v, inner)}," for k, v in value.items()]
    else:
        items = [f"{inner}{lua(v, inner)}," for v in value]
    return "{\n" + "\n".join(items) + f"\n{indent}}}" if items else "{}"


# The allowlist as Lua patterns: a `*` is one segment (core.forwarding._SEGMENT).
_SEGMENT_LUA = "[%w_][%w_%.%-]*"


def _rule(rule: forwarding.Rule) -> dict[str, str]:
    parts = [_SEGMENT_LUA if seg == "*" else re.sub(r"([^A-Za-z0-9])", r"%\1", seg) for seg in rule.path.split("/")]
    return {"method": rule.method, "pattern": "^" + "/".join(parts) + "$"}


def _route(keys: QueueKeys, route: Route) -> dict[str, Any]:
    p = route.policy
    return {
        "name": route.name,
        "keys": keys.route_keys(route.name),
        "inflight": list(keys.route_inflight(route.name)),
        "engine_age": [keys.engine_age(b) for b in route.backends],
        "engine_waiting": [keys.engine_waiting(b) for b in route.backends],
        "policy": policy_args(p),
        "default_deadline_ms": p.default_deadline_ms,
        "redis_down": p.redis_down,
        "retry_match_window_ms": int(p.retry_match_window_ms),
        "models": list(route.models),
        "allow": [_rule(r) for r in route.allow],
    }


def _script(text: str) -> dict[str, str]:
    return {"text": text, "sha": hashlib.sha1(text.encode()).hexdigest()}


def plan(cfg: GateConfig) -> dict[str, Any]:
    """What the door runs on: the Redis server, the queue's keys, each route, the tenants'
    budgets and the scripts. PlanError where the door cannot run the configuration."""
    target = parse_target(cfg.redis_url)
    if not target.plain_tcp:
        raise PlanError(
            f"gate.redis: the nginx Lua door reaches one Redis server over TCP (redis://host:port/db); {target.describe()} "
            "is not supported by it: use `llm-health decide` (nginx auth_request) in front of a Sentinel, Cluster, TLS or unix-socket Redis"
        )
    url = urlsplit(target.single_url)
    keys = QueueKeys(cfg.queue_prefix)
    routes = {name: _route(keys, r) for name, r in cfg.routes.items()}
    any_rules = [_rule(r) for route in cfg.routes.values() for r in route.allow]
    return {
        "redis": {"host": url.hostname or "127.0.0.1", "port": url.port or 6379, "db": target.db, "username": target.username, "password": target.password},
        "queue": {
            "record_prefix": keys.record(""),
            "routes_key": keys.routes(),
            "tenant_prefix": keys.tenant("", 0)[: -len(":0")],
            "fp_prefix": keys.retry_match(""),
            "retention_ms": DEFAULT_RETENTION_MS,
            "gc_limit": GC_LIMIT,
            "gave_up_ms": GAVE_UP_MS,
        },
        "routes": routes,
        "route_order": list(cfg.routes),
        "by_model": any(r.models for r in cfg.routes.values()),
        "any_allow": any_rules,
        "never": list(forwarding.NEVER),
        "tenants": dict(cfg.tenants),
        "scripts": {
            "decide": _script(DECIDE_LUA),
            "decide_ends": _script(DECIDE_ENDS_LUA),  # the decision carrying the worker's queued ends (store.ends)
            "ends": _script(ENDS_LUA),  # the ends alone (the timer's, a refusal's)
        },
        "decide_args": DECIDE_ARGS,  # the decision's arguments: the carried ends follow them
        "down_codes": sorted(RETRYABLE_CODES),  # an error reply that is Redis down (store.errors: one classification)
        "policy_lua": POLICY_LUA,
    }


def render(cfg: GateConfig) -> str:
    """The plan as the Lua module `llm_health_plan` (`return {...}`)."""
    head = f"-- Generated by `llm-health nginx-lua` from {cfg.source}: edit that file and run it again.\n"
    secret = "-- It holds the Redis password of gate.redis: readable by nginx's master process only.\n" if plan(cfg)["redis"]["password"] else ""
    return head + secret + "return " + lua(plan(cfg)) + "\n"
