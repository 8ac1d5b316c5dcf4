"""`llm-health gate`: the age-first admission gate, a reverse proxy in front of
OpenAI-compatible backends (vLLM).

For each request it takes the request id, the deadline and the retry count from headers
and from its own record of the id in Redis (a client that resends an id is a retry even
without headers), asks the policy (`admission.decide`), and either streams the request
through to the route's upstream without buffering, or rejects it with a JSON body:
`503`/`429` with `Retry-After` where a retry can still make it, a non-retryable status
(422 by default) where it cannot. It records the Redis queue state of
docs/redis-schema.md: enqueue, attempts, token units from the response's `usage`, last
upstream status.

Headers read (first one present wins):

| what | headers |
|---|---|
| request id | `X-Request-Id`, `Idempotency-Key` (none: a fresh id, never a retry) |
| deadline, absolute | `X-Request-Deadline-Ms` (Unix ms) |
| deadline, remaining budget | `X-Request-Timeout-Ms`, `X-Envoy-Expected-Rq-Timeout-Ms` |
| retry count | `X-Retry-Count`, `X-Stainless-Retry-Count` (the OpenAI SDKs), `X-Retry-Attempt` |
| route | `X-Route` (else the route whose `models` has the body's model, else the first) |
| tenant | `X-Tenant` (else `default`) |

Operator controls (bearer token): `POST /-/routes/<route>/reject_all`,
`POST /-/routes/<route>/open` (refused until queue age stayed under the deadline for two
sampling intervals; `?force=true` overrides), `POST /-/routes/<route>/drain` (ids whose
age exceeds their deadline leave the queue).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field, replace

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from redis import asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from . import admission
from .config import duration, read_api_key
from .errors import ConfigError
from .queue import DEFAULT_QUEUE_PREFIX, AdmissionQueue, QueueRecord, add_route_stats_commands, now_ms, parse_route_stats, ROUTE_STATS_COMMANDS

log = logging.getLogger("llm_health.gate")

_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
_ID_HEADERS = ("X-Request-Id", "Idempotency-Key")
_RETRY_HEADERS = ("X-Retry-Count", "X-Stainless-Retry-Count", "X-Retry-Attempt")
_USAGE = re.compile(rb'"usage"\s*:\s*(\{[^{}]*\})')
_ROUTE_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass
class Route:
    name: str
    upstream: str
    policy: admission.Policy
    models: tuple[str, ...] = ()
    guard: admission.ReopenGuard = field(default_factory=admission.ReopenGuard)


@dataclass
class GateConfig:
    routes: dict[str, Route]
    redis_url: str = "redis://127.0.0.1:6379/0"
    queue_prefix: str = DEFAULT_QUEUE_PREFIX
    tenants: dict[str, float] = field(default_factory=dict)  # token units per minute
    sample_interval: float = 15.0  # the scrape interval the reopen rule counts in
    upstream_timeout: float = 600.0
    admin_token: str | None = field(default=None, repr=False)
    source: str = "<config>"


def parse_gate_config(data, where: str = "<config>") -> GateConfig:
    """```yaml
    admission: {reject_if_queue_age_ms_gte: 3000, reject_if_retry_count_gte: 1, ignore_worker_util_when_slack_ms_lte: 0}
    gate:
      redis: redis://127.0.0.1:6379/0
      sample_interval: 15s
      admin_token_file: /etc/llm-health/gate-admin.token    # or admin_token_env
      routes:
        chat: {upstream: http://10.0.0.5:8000, models: [llama], default_deadline_ms: 30000, redis_down: open}
      tenants:
        acme: {token_units_per_minute: 200000}
    ```"""
    if not isinstance(data, dict):
        raise ConfigError(where, "(top level)", "expected a mapping")
    base = admission.parse_policy(data.get("admission") or {}, where)
    unknown = set(data.get("admission") or {}) - set(admission.Policy.__dataclass_fields__)
    if unknown:
        raise ConfigError(where, f"admission.{sorted(unknown)[0]}", "unknown key")
    gate = data.get("gate")
    if not isinstance(gate, dict):
        raise ConfigError(where, "gate", "missing or not a mapping (needs at least gate.routes)")
    known = {"redis", "queue_prefix", "sample_interval", "upstream_timeout", "admin_token_file", "admin_token_env", "routes", "tenants"}
    bad = set(gate) - known
    if bad:
        raise ConfigError(where, f"gate.{sorted(bad)[0]}", f"unknown key (expected one of {', '.join(sorted(known))})")
    routes_raw = gate.get("routes")
    if not isinstance(routes_raw, dict) or not routes_raw:
        raise ConfigError(where, "gate.routes", "expected a mapping of route name to {upstream: URL, ...}")
    routes = {}
    route_keys = {"upstream", "models"} | set(admission.Policy.__dataclass_fields__)
    for name, r in routes_raw.items():
        prefix = f"gate.routes.{name}."
        if not _ROUTE_NAME.match(str(name)):
            raise ConfigError(where, f"gate.routes.{name}", "route names use letters, digits and _ . : - only")
        if not isinstance(r, dict):
            raise ConfigError(where, prefix.rstrip("."), "expected a mapping with upstream")
        bad = set(r) - route_keys
        if bad:
            raise ConfigError(where, prefix + sorted(bad)[0], "unknown key")
        upstream = r.get("upstream")
        if not isinstance(upstream, str) or not re.match(r"^https?://[^/\s]+", upstream):
            raise ConfigError(where, prefix + "upstream", f"expected an http(s) URL, got {upstream!r}")
        models = r.get("models") or []
        if not isinstance(models, list):
            raise ConfigError(where, prefix + "models", "expected a list of model names")
        routes[str(name)] = Route(str(name), upstream.rstrip("/"), admission.parse_policy(r, where, prefix, base), tuple(map(str, models)))
    tenants = {}
    for t, spec in (gate.get("tenants") or {}).items():
        units = (spec or {}).get("token_units_per_minute") if isinstance(spec, dict) else None
        if isinstance(units, bool) or not isinstance(units, int | float) or units <= 0:
            raise ConfigError(where, f"gate.tenants.{t}.token_units_per_minute", f"expected a positive number, got {units!r}")
        tenants[str(t)] = float(units)
    cfg = GateConfig(routes=routes, tenants=tenants, source=where)
    if "redis" in gate:
        cfg.redis_url = str(gate["redis"])
    if "queue_prefix" in gate:
        cfg.queue_prefix = str(gate["queue_prefix"])
    if "sample_interval" in gate:
        cfg.sample_interval = duration(gate["sample_interval"], where, "gate.sample_interval")
    if "upstream_timeout" in gate:
        cfg.upstream_timeout = duration(gate["upstream_timeout"], where, "gate.upstream_timeout")
    keyspec = {k.replace("admin_token", "api_key"): v for k, v in gate.items() if k.startswith("admin_token")}
    cfg.admin_token = read_api_key(keyspec, where, "gate.") if keyspec else None
    return cfg


def tune_gc() -> None:
    """For a process that runs the gate: collect the youngest generation less often and keep
    what start-up allocated out of every collection, to cut the tail latency collections add
    (bench/bench_gate.py on a shared 2-core machine: p99 added 1.5-2.6 ms in most runs with
    this, 4.6-7.5 ms without; single runs of either still reach 10-25 ms)."""
    import gc

    gc.freeze()
    gc.set_threshold(100_000, 50, 50)


async def _healthy(request: web.Request) -> web.Response:
    return web.Response(text="OK\n")


class BadRequest(ValueError):
    pass


def _first(request: web.Request, names) -> str | None:
    for n in names:
        v = request.headers.get(n)
        if v is not None and v.strip():
            return v.strip()
    return None


def read_deadline_ms(request: web.Request, now: int, default_ms: float | None) -> int:
    """The absolute deadline in Unix ms, from the headers or the route's default."""
    absolute = request.headers.get("X-Request-Deadline-Ms")
    if absolute is not None:
        try:
            value = float(absolute)
        except ValueError:
            raise BadRequest(f"X-Request-Deadline-Ms must be Unix time in milliseconds, got {absolute!r}") from None
        if not 1e12 <= value <= 1e14:
            raise BadRequest(f"X-Request-Deadline-Ms {absolute!r} is not Unix time in milliseconds (expected 13 digits)")
        return int(value)
    for name in ("X-Request-Timeout-Ms", "X-Envoy-Expected-Rq-Timeout-Ms"):
        budget = request.headers.get(name)
        if budget is not None:
            try:
                ms = float(budget)
            except ValueError:
                raise BadRequest(f"{name} must be a number of milliseconds, got {budget!r}") from None
            if ms < 0 or ms != ms:
                raise BadRequest(f"{name} must not be negative, got {budget!r}")
            return now + int(ms)
    if default_ms is None:
        raise BadRequest("no deadline: send X-Request-Deadline-Ms (Unix ms) or X-Request-Timeout-Ms (remaining ms), or set the route's default_deadline_ms")
    return now + int(default_ms)


def read_retry_count(request: web.Request) -> int:
    for name in _RETRY_HEADERS:
        v = request.headers.get(name)
        if v is not None:
            try:
                n = int(v)
            except ValueError:
                raise BadRequest(f"{name} must be a non-negative integer, got {v!r}") from None
            if n < 0:
                raise BadRequest(f"{name} must be a non-negative integer, got {v!r}")
            return n
    return 0


def token_units(tail: bytes) -> int:
    """Token units of a response: `usage.total_tokens` (or prompt + completion) of the
    last `usage` object in the body or the SSE stream's tail."""
    found = _USAGE.findall(tail)
    if not found:
        return 0
    try:
        usage = json.loads(found[-1])
    except ValueError:
        return 0
    total = usage.get("total_tokens")
    if total is None:
        total = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0)
    return int(total) if isinstance(total, int | float) else 0


class Gate:
    def __init__(self, cfg: GateConfig, redis: aioredis.Redis | None = None):
        self.cfg = cfg
        if redis is None:
            pool = aioredis.BlockingConnectionPool.from_url(
                cfg.redis_url, decode_responses=True, socket_timeout=1.0, socket_connect_timeout=1.0, max_connections=64, timeout=1.0
            )
            redis = aioredis.Redis(connection_pool=pool)
        self.redis = redis
        self.queue = AdmissionQueue(self.redis, prefix=cfg.queue_prefix)
        self.session: aiohttp.ClientSession | None = None
        self.redis_up = True
        self._by_model = any(r.models for r in cfg.routes.values())
        self._pending: set[asyncio.Task] = set()  # attempts being recorded after their response
        self._sampler: asyncio.Task | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.m_decisions = Counter("llm_gate_decisions", "Admission decisions by route.", ["route", "decision"], registry=self.registry)
        self.m_upstream = Counter("llm_gate_upstream_responses", "Upstream responses by status code (429 and 503 kept apart).", ["route", "code"], registry=self.registry)
        self.m_redis = Gauge("llm_gate_redis_up", "1 if the gate's last Redis call succeeded.", registry=self.registry)
        self.m_closed = Gauge("llm_gate_route_closed", "1 while an operator holds the route at reject_all.", ["route"], registry=self.registry)
        self.m_duration = Histogram(
            "llm_gate_request_duration_seconds", "Time from request to the end of the response, by route.", ["route"], registry=self.registry
        )
        self.m_tokens = Counter("llm_gate_token_units", "Token units reported by upstream usage, by route.", ["route"], registry=self.registry)
        self.m_redis.set(1)
        for name, route in cfg.routes.items():
            self.m_closed.labels(name).set(1 if route.policy.mode == "reject_all" else 0)
            for d in admission.DECISIONS:
                self.m_decisions.labels(name, d)

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=self.cfg.upstream_timeout, connect=5))
        self._sampler = asyncio.create_task(self._sample())

    async def stop(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._sampler:
            self._sampler.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
        if self.session:
            await self.session.close()
        await self.redis.aclose()

    async def _sample(self) -> None:
        """Every sample_interval, note per closed route whether queue age is under the deadline."""
        while True:
            await asyncio.sleep(self.cfg.sample_interval)
            for route in self.cfg.routes.values():
                try:
                    stats = await self.queue.route_stats(route.name)
                except RedisError:
                    self._redis(False)
                    continue
                self._redis(True)
                age = stats.oldest_age_ms or 0
                deadline = route.policy.default_deadline_ms or route.policy.reject_if_queue_age_ms_gte
                route.guard.observe(age, deadline)

    def _redis(self, ok: bool) -> None:
        self.redis_up = ok
        self.m_redis.set(1 if ok else 0)

    # --- the proxy -------------------------------------------------------------------
    def _route(self, request: web.Request, body: bytes) -> Route:
        name = request.headers.get("X-Route")
        if name:
            if name not in self.cfg.routes:
                raise BadRequest(f"X-Route {name!r} is not a configured route ({', '.join(self.cfg.routes)})")
            return self.cfg.routes[name]
        if len(self.cfg.routes) == 1 or not self._by_model:
            return next(iter(self.cfg.routes.values()))
        model = None
        if body[:1] == b"{":
            try:
                model = json.loads(body).get("model")
            except (ValueError, AttributeError):
                model = None
        for route in self.cfg.routes.values():
            if model is not None and model in route.models:
                return route
        return next(iter(self.cfg.routes.values()))

    def _tenant_key(self, tenant: str) -> str:
        return f"{self.cfg.queue_prefix}tenant:{tenant}:{int(time.time() // 60)}"

    async def _enqueue_and_read(self, request_id: str, route: str, tenant: str, deadline_ms: int, now: int):
        """One round trip: enqueue (or recognise a resent id), the route's queue stats,
        the tenant's spend this minute, and the id taken off the waiting set."""
        q = self.queue
        pipe = self.redis.pipeline(transaction=False)
        # The queue as this request finds it (the others waiting), before it joins.
        add_route_stats_commands(pipe, q.keys, route, now)
        q.pipelined(pipe, q._enqueue, q.enqueue_call(request_id, route, tenant, deadline_ms, now, now))
        limit = self.cfg.tenants.get(tenant)
        if limit is not None:
            pipe.get(self._tenant_key(tenant))
        # Leave the waiting set at once (state running): an admitted request saves a round
        # trip; a rejected one is marked done right after.
        q.pipelined(pipe, q._leave, q.leave_call(request_id, route, "running", None, now))
        replies = await self._execute(pipe)
        stats = parse_route_stats(replies[:ROUTE_STATS_COMMANDS], now)
        record = QueueRecord.from_hash(request_id, replies[ROUTE_STATS_COMMANDS])
        budget = None if limit is None else limit - float(replies[ROUTE_STATS_COMMANDS + 1] or 0)
        return record, stats, budget

    async def _finish(self, request_id: str, route: str, tenant: str, units: int, status: int, retry_count: int | None) -> None:
        """One round trip after the response: the attempt (token units, status), the id
        done, the tenant charged."""
        q = self.queue
        now = now_ms()
        pipe = self.redis.pipeline(transaction=False)
        q.pipelined(pipe, q._attempt, q.attempt_call(request_id, route, units, status, retry_count, now))
        q.pipelined(pipe, q._leave, q.leave_call(request_id, route, "done", status, now))
        if tenant in self.cfg.tenants and units:
            key = self._tenant_key(tenant)
            pipe.incrby(key, units)
            pipe.expire(key, 120)
        await self._execute(pipe, rerun_reads=False)

    async def _execute(self, pipe, rerun_reads: bool = True):
        """Run a pipeline holding EVALSHAs. On a Redis that lost its scripts (NOSCRIPT: a
        restart) load them and run again the scripts, which all failed, and the reads
        (`rerun_reads`); writes that did run (INCRBY) are not repeated."""
        commands = list(pipe.command_stack)
        try:
            return await pipe.execute()
        except NoScriptError:
            for script in (self.queue._enqueue, self.queue._attempt, self.queue._leave):
                await self.redis.script_load(script.script)
            again = self.redis.pipeline(transaction=False)
            again.command_stack = [c for c in commands if rerun_reads or c[0][0] == "EVALSHA"]
            return await again.execute()

    def _reject(self, route: str, decision: admission.Decision, request_id: str, extra: dict | None = None) -> web.Response:
        self.m_decisions.labels(route, decision.decision).inc()
        body = {
            "error": {
                "type": "admission_rejected",
                "code": decision.decision,
                "message": decision.reason,
                "retryable": decision.retryable,
                "request_id": request_id,
                "route": route,
                **(extra or {}),
            }
        }
        headers = {"X-Request-Id": request_id, "X-LLM-Health-Decision": decision.decision}
        if decision.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(decision.retry_after_s)))
        return web.json_response(body, status=decision.status, headers=headers)

    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        body = await request.read()
        request_id = _first(request, _ID_HEADERS) or f"gate-{uuid.uuid4()}"
        now = now_ms()
        try:
            route = self._route(request, body)
            tenant = request.headers.get("X-Tenant", "default")
            deadline_ms = read_deadline_ms(request, now, route.policy.default_deadline_ms)
            header_retries = read_retry_count(request)
        except BadRequest as exc:
            return web.json_response({"error": {"type": "bad_request", "message": str(exc), "request_id": request_id}}, status=400)

        fields = {"request_id": request_id}
        recorded = True
        try:
            record, stats, budget = await self._enqueue_and_read(request_id, route.name, tenant, deadline_ms, now)
            self._redis(True)
            retry_count = max(header_retries, record.retry_count)
            deadline_ms = record.deadline_ms  # a resent id keeps the deadline of its first copy
            # Age first: how long the requests ahead of this one have waited. A resent id's own
            # lateness is in its slack (it keeps its first deadline) and its retry count.
            queue_age_ms = stats.oldest_age_ms or 0
            req = admission.Request(
                queue_age_ms=queue_age_ms,
                deadline_slack_ms=deadline_ms - now,
                retry_count=retry_count,
                last_upstream_status=record.http_status,
                tenant_budget_left=budget,
            )
            decision = admission.decide(req, route.policy)
            fields.update(queue_age_ms=queue_age_ms, deadline_slack_ms=deadline_ms - now, retry_count=retry_count)
        except RedisError as exc:
            self._redis(False)
            recorded = False
            log.warning("redis unreachable for route %s (%s): failing %s", route.name, type(exc).__name__, route.policy.redis_down)
            if route.policy.redis_down == "closed":
                d = admission.Decision("reject_redis_down", "Redis unreachable: queue age unknown; route fails closed", 503, retry_after_s=5.0, retryable=True)
                return self._reject(route.name, d, request_id)
            # Fail open: the policy still sees this request's own deadline and retries.
            slack = deadline_ms - now
            decision = admission.decide(admission.Request(queue_age_ms=0, deadline_slack_ms=slack, retry_count=header_retries), route.policy)
            if decision.admitted:
                decision = replace(decision, decision="admit_unrecorded", reason=f"{decision.reason}; Redis unreachable, failing open")
            fields.update(deadline_slack_ms=slack, retry_count=header_retries)

        if not decision.admitted and decision.decision != "admit_unrecorded":
            if recorded:
                await self._quiet(self.queue.complete(request_id, decision.status, route=route.name))
            return self._reject(route.name, decision, request_id, fields)

        self.m_decisions.labels(route.name, decision.decision).inc()
        try:
            status, units = await self._forward(request, route, body, request_id)
        except (ConnectionResetError, asyncio.CancelledError, aiohttp.ClientConnectionResetError):
            # The client went away mid-response: the upstream request was closed with it.
            # Record the attempt (status 499, as nginx names it) without holding up the cancellation.
            self.m_upstream.labels(route.name, "499").inc()
            if recorded:
                asyncio.ensure_future(self._quiet(self.queue.complete(request_id, 499, route=route.name)))
            raise
        self.m_upstream.labels(route.name, str(status)).inc()
        self.m_tokens.labels(route.name).inc(units)
        self.m_duration.labels(route.name).observe(time.monotonic() - started)
        response = request["llm_health_response"]
        if response.prepared:
            await response.write_eof()  # the client has its whole answer: Redis is not on its path
        if recorded:
            # Recorded in the background: the connection is free for the client's next request.
            task = asyncio.create_task(self._quiet(self._finish(request_id, route.name, tenant, units, status, fields.get("retry_count"))))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        return response

    async def _quiet(self, coro) -> None:
        try:
            await coro
            self._redis(True)
        except RedisError:
            self._redis(False)

    async def _forward(self, request: web.Request, route: Route, body: bytes, request_id: str) -> tuple[int, int]:
        """Stream the upstream response through, chunk by chunk; (status, token units)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["X-Request-Id"] = request_id
        url = route.upstream + request.rel_url.path_qs
        tail = b""
        try:
            async with self.session.request(request.method, url, data=body, headers=headers) as up:
                out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP})
                out.headers["X-Request-Id"] = request_id
                request["llm_health_response"] = out
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)  # raises if the client went away: the upstream is closed below
                    tail = (tail + chunk)[-16384:]
                # write_eof is left to the caller, which then records the attempt.
                return up.status, token_units(tail)
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError, aiohttp.ServerDisconnectedError) as exc:
            if "llm_health_response" in request:
                raise
            resp = web.json_response(
                {"error": {"type": "upstream_unavailable", "message": f"upstream {route.name}: {type(exc).__name__}", "request_id": request_id}},
                status=502,
            )
            request["llm_health_response"] = resp
            return 502, 0

    # --- operator controls and metrics -----------------------------------------------------
    def _authorised(self, request: web.Request) -> bool:
        if self.cfg.admin_token is None:
            return False
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.cfg.admin_token}".encode())

    async def handle_admin(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "unauthorised: a bearer token (gate.admin_token_file) is required"}, status=401)
        name, action = request.match_info["route"], request.match_info["action"]
        route = self.cfg.routes.get(name)
        if route is None:
            return web.json_response({"error": f"no route {name!r}"}, status=404)
        if action == "reject_all":
            route.policy = replace(route.policy, mode="reject_all")
            route.guard.good = 0
            self.m_closed.labels(name).set(1)
            return web.json_response({"route": name, "mode": "reject_all"})
        if action == "open":
            force = request.query.get("force") in ("1", "true")
            if route.policy.mode == "reject_all" and not force and route.guard.good < route.guard.intervals_needed:
                return web.json_response(
                    {
                        "error": "refused: queue age has not stayed under the deadline for two sampling intervals",
                        "good_intervals": route.guard.good,
                        "needed": route.guard.intervals_needed,
                    },
                    status=409,
                )
            route.policy = replace(route.policy, mode="open")
            self.m_closed.labels(name).set(0)
            return web.json_response({"route": name, "mode": "open"})
        if action == "drain":
            drained = await self.drain(name)
            return web.json_response({"route": name, "drained": drained})
        return web.json_response({"error": f"unknown action {action!r} (reject_all, open, drain)"}, status=404)

    async def drain(self, route: str) -> int:
        """Remove from the queue every id whose deadline has passed (its age exceeds its deadline)."""
        now = now_ms()
        ids = await self.redis.zrangebyscore(self.queue.keys.route(route, "deadline"), "-inf", now, start=0, num=10000)
        for rid in ids:
            await self.queue.complete(rid, 499, route=route)
        return len(ids)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_post("/-/routes/{route}/{action}", self.handle_admin)
        app.router.add_get("/-/healthy", _healthy)
        app.router.add_route("*", "/{tail:.*}", self.handle_proxy)

        async def lifecycle(app):
            await self.start()
            yield
            await self.stop()

        app.cleanup_ctx.append(lifecycle)
        return app
