"""`llm-health gate`: the age-first admission gate, a reverse proxy in front of
OpenAI-compatible backends (vLLM).

For each request it takes the request id, the deadline and the retry count from headers
(`gate.headers`) and from its own record of the id in Redis (a client that resends an id
is a retry even without headers), asks the policy (`core.admission.decide`), and either
streams the request through to the route's upstream without buffering, or rejects it
with a JSON body: `503`/`429` with `Retry-After` where a retry can still make it, a
non-retryable status (422 by default) where it cannot. It records the Redis queue state
of docs/redis-schema.md: enqueue, attempts, token units from the response's `usage`,
last upstream status.

Operator controls (bearer token): `POST /-/routes/<route>/reject_all`,
`POST /-/routes/<route>/open` (refused until queue age stayed under the deadline for two
sampling intervals; `?force=true` overrides), `POST /-/routes/<route>/drain` (ids whose
age exceeds their deadline leave the queue).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis import asyncio as aioredis
from redis.exceptions import ClusterDownError, MovedError, NoScriptError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..config.gate import GateConfig, Route, parse_gate_config
from ..config.load import load_yaml
from ..config.web import WebConfig
from ..core import admission, forwarding
from ..store.deployment import connect, wrap
from ..store.queue import ROUTE_STATS_COMMANDS, AdmissionQueue, QueueRecord, RouteStats, add_route_stats_commands, now_ms, parse_route_stats
from ..web import OPEN_PATHS, BearerToken, add_reload, healthy, metrics_handler, secure
from .headers import BadRequest, read_deadline_ms, read_request_id, read_retry_count, read_tenant, token_units

log = logging.getLogger("llm_health.gate")

# Redis is down or unreachable: the route's redis_down policy applies. Any other Redis
# error (a refused script, a bad value) means Redis is up and answered. On Cluster: a
# cluster that says it is down (CLUSTERDOWN, a failover under way) or whose slot map
# cannot be had (RedisClusterException) is down too.
REDIS_DOWN: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError, ClusterDownError, RedisClusterException)


class UpstreamBroke(Exception):
    """The upstream failed after the answer to the client had begun."""


_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers", "transfer-encoding", "upgrade", "host", "content-length"}


def tune_gc() -> None:
    """For a process that runs the gate: collect the youngest generation less often, to cut
    the tail latency that collections add (measured in bench/bench_gate.py); run_app also
    keeps what start-up allocated out of every collection."""
    gc.set_threshold(100_000, 50, 50)


class Gate:
    def __init__(self, cfg: GateConfig, redis: aioredis.Redis | Any = None, config_file: str | os.PathLike[str] | None = None):
        self.cfg = cfg
        self.config_file = config_file
        self._admin = BearerToken(cfg.admin_token) if cfg.admin_token else None
        # One server, Sentinel or Cluster, from the URL (store.deployment); on one server
        # at most 64 connections, a caller waiting up to 1 s for a free one.
        self.deployment = wrap(redis) if redis is not None else connect(cfg.redis_url, socket_timeout=1.0, max_connections=64, blocking_timeout=1.0)
        self.redis = self.deployment.client
        self.queue = AdmissionQueue(self.deployment, prefix=cfg.queue_prefix)
        self.session: aiohttp.ClientSession | None = None
        self.redis_up = True
        self._by_model = any(r.models for r in cfg.routes.values())
        self._any_rules = tuple(rule for r in cfg.routes.values() for rule in r.allow)  # before a route is chosen
        self._pending: set[asyncio.Task[None]] = set()  # attempts being recorded after their response
        self._sampler: asyncio.Task[None] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.m_decisions = Counter("llm_gate_decisions", "Admission decisions by route.", ["route", "decision"], registry=self.registry)
        self.m_upstream = Counter(
            "llm_gate_upstream_responses", "Upstream responses by status code (429 and 503 kept apart).", ["route", "code"], registry=self.registry
        )
        why = "Requests refused before admission: 404 (an endpoint not forwarded, an engine admin or dev one), 405 (a method not forwarded)."
        self.m_not_forwarded = Counter("llm_gate_not_forwarded", why, ["code"], registry=self.registry)
        for code in ("404", "405"):
            self.m_not_forwarded.labels(code)
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

    async def reload(self) -> str:
        """Re-read the configuration file. A route keeps its current mode (an operator's
        reject_all survives a reload) and its reopen guard; everything else is the file's."""
        if self.config_file is None:
            return "no configuration file to reload"
        new = parse_gate_config(load_yaml(self.config_file), str(self.config_file))
        note = ""
        if (new.redis_url, new.queue_prefix) != (self.cfg.redis_url, self.cfg.queue_prefix):
            note = " (gate.redis and gate.queue_prefix take effect on restart only)"
        for name, route in new.routes.items():
            old = self.cfg.routes.get(name)
            if old is not None:
                route.policy = replace(route.policy, mode=old.policy.mode)
                route.guard = old.guard
            self.m_closed.labels(name).set(1 if route.policy.mode == "reject_all" else 0)
            for d in admission.DECISIONS:
                self.m_decisions.labels(name, d)
        new.redis_url, new.queue_prefix = self.cfg.redis_url, self.cfg.queue_prefix
        self.cfg = new
        self._admin = BearerToken(new.admin_token) if new.admin_token else None
        self._by_model = any(r.models for r in new.routes.values())
        self._any_rules = tuple(rule for r in new.routes.values() for rule in r.allow)
        return f"{len(new.routes)} routes{note}"

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
        await self.deployment.aclose()

    async def _sample(self) -> None:
        """Every sample_interval, note per closed route whether queue age is under the deadline."""
        while True:
            await asyncio.sleep(self.cfg.sample_interval)
            for route in self.cfg.routes.values():
                try:
                    stats = await self.queue.route_stats(route.name)
                except REDIS_DOWN:
                    self._redis(False)
                    continue
                except RedisError as exc:
                    log.error("redis refused the queue read of route %s: %s", route.name, exc)
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
        return self.queue.keys.tenant(tenant, int(time.time() // 60))

    async def _enqueue_and_read(self, request_id: str, route: str, tenant: str, deadline_ms: int, now: int) -> tuple[QueueRecord, RouteStats, float | None]:
        """One round trip: enqueue (or recognise a resent id), the route's queue stats,
        the tenant's spend this minute, and the id taken off the waiting set."""
        q = self.queue
        pipe = await self._pipeline()
        # The queue as this request finds it (the others waiting), before it joins.
        add_route_stats_commands(pipe, q.keys, route, now)
        q.pipe_enqueue(pipe, request_id, route, tenant, deadline_ms, now, now)
        limit = self.cfg.tenants.get(tenant)
        if limit is not None:
            pipe.get(self._tenant_key(tenant))
        # Leave the waiting set at once (state running): an admitted request saves a round
        # trip; a rejected one is marked done right after.
        q.pipe_leave(pipe, request_id, route, "running", None, now)
        replies = await self._execute(pipe)
        stats = parse_route_stats(replies[:ROUTE_STATS_COMMANDS], now)
        record = QueueRecord.from_hash(request_id, replies[ROUTE_STATS_COMMANDS])
        assert record is not None  # the enqueue script returns the record it wrote
        budget = None if limit is None else limit - float(replies[ROUTE_STATS_COMMANDS + 1] or 0)
        return record, stats, budget

    async def _finish(self, request_id: str, route: str, tenant: str, units: int, status: int, retry_count: int | None) -> None:
        """One round trip after the response: the attempt (token units, status), the id
        done, the tenant charged."""
        q = self.queue
        now = now_ms()
        pipe = await self._pipeline()
        q.pipe_attempt(pipe, request_id, route, units, status, retry_count, now)
        q.pipe_leave(pipe, request_id, route, "done", status, now)
        if tenant in self.cfg.tenants and units:
            key = self._tenant_key(tenant)
            pipe.incrby(key, units)
            pipe.expire(key, 120)
        await self._execute(pipe, rerun_reads=False)

    async def _pipeline(self) -> Any:
        """A pipeline for the queue's commands. On Cluster the whole queue is one hash tag
        (one slot) and redis-py's cluster pipeline refuses EVALSHA: a plain pipeline on the
        primary owning that slot (the slot map is asked again after a failover: `_execute`)."""
        if not self.deployment.cluster:
            return self.redis.pipeline(transaction=False)
        await self.redis.initialize()  # the slot map, once
        node = self.redis.get_node_from_key(self.queue.keys.routes())
        return self.deployment.node(node.host, node.port).pipeline(transaction=False)

    async def _execute(self, pipe: Any, rerun_reads: bool = True) -> list[Any]:
        """Run a pipeline holding EVALSHAs. On a Redis that lost its scripts (NOSCRIPT: a
        restart, a failover) load them and run again the scripts, which all failed, and the
        reads (`rerun_reads`); writes that did run (INCRBY) are not repeated. On Cluster, a
        MOVED (nothing ran: one slot) runs it all again on the slot's primary now."""
        commands = list(pipe.command_stack)
        try:
            try:
                return await pipe.execute()
            except MovedError:
                if not self.deployment.cluster:
                    raise
                await self.deployment.refresh_topology()
                pipe = await self._pipeline()
                pipe.command_stack = list(commands)
                return await pipe.execute()
        except NoScriptError:
            await self.queue.load_scripts()
            again = await self._pipeline()
            again.command_stack = [c for c in commands if rerun_reads or c[0][0] == "EVALSHA"]
            return await again.execute()
        except REDIS_DOWN:
            await self.deployment.refresh_topology()  # Cluster: the next request finds the new primary
            raise

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

    def _not_forwarded(self, request: web.Request, rules: tuple[forwarding.Rule, ...]) -> web.Response | None:
        """404/405 for what the route (or any route: before the body is read) does not forward."""
        verdict = forwarding.check(request.method, request.raw_path.split("?", 1)[0], rules)
        if verdict.forward:
            return None
        self.m_not_forwarded.labels(str(verdict.status)).inc()
        headers = {"Allow": ", ".join(verdict.allow)} if verdict.allow else None
        return web.json_response({"error": {"type": "not_forwarded", "message": verdict.reason}}, status=verdict.status, headers=headers)

    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        if (refused := self._not_forwarded(request, self._any_rules)) is not None:
            return refused
        body = await request.read()
        now = now_ms()
        try:
            request_id = read_request_id(request.headers) or f"gate-{uuid.uuid4()}"
            route = self._route(request, body)
            if len(self.cfg.routes) > 1 and (refused := self._not_forwarded(request, route.allow)) is not None:
                return refused
            tenant = read_tenant(request.headers)
            deadline_ms = read_deadline_ms(request.headers, now, route.policy.default_deadline_ms)
            header_retries = read_retry_count(request.headers)
        except BadRequest as exc:
            return web.json_response({"error": {"type": "bad_request", "message": str(exc)}}, status=400)
        # Ids are the client's, scoped by tenant: two tenants' `order-1001` are two requests.
        queue_id = f"{tenant}/{request_id}"

        fields: dict[str, Any] = {"request_id": request_id}
        recorded = True
        try:
            record, stats, budget = await self._enqueue_and_read(queue_id, route.name, tenant, deadline_ms, now)
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
        except REDIS_DOWN as exc:
            self._redis(False)
            recorded = False
            log.warning("redis unreachable for route %s (%s): failing %s", route.name, type(exc).__name__, route.policy.redis_down)
            slack = deadline_ms - now
            # A rejection's body has every documented key; the queue age is unknown (null).
            fields.update(queue_age_ms=None, deadline_slack_ms=slack, retry_count=header_retries)
            if route.policy.redis_down == "closed":
                d = admission.Decision(
                    admission.REJECT_REDIS_DOWN, "Redis unreachable: queue age unknown; route fails closed", 503, retry_after_s=5.0, retryable=True
                )
                return self._reject(route.name, d, request_id, fields)
            # Fail open: the policy still sees this request's own deadline and retries.
            decision = admission.decide(admission.Request(queue_age_ms=0, deadline_slack_ms=slack, retry_count=header_retries), route.policy)
            if decision.admitted:
                decision = replace(decision, decision=admission.ADMIT_UNRECORDED, reason=f"{decision.reason}; Redis unreachable, failing open")

        except RedisError as exc:
            # Redis answered, and refused: a value of this request, or a bug; Redis is up.
            log.error("redis refused the request record for route %s: %s", route.name, exc)
            return web.json_response({"error": {"type": "internal", "message": "the request could not be recorded", "request_id": request_id}}, status=500)

        if not decision.admitted:
            if recorded:
                await self._quiet(self.queue.complete(queue_id, decision.status, route=route.name))
            return self._reject(route.name, decision, request_id, fields)

        self.m_decisions.labels(route.name, decision.decision).inc()
        try:
            status, units = await self._forward(request, route, body, request_id)
        except (ConnectionResetError, asyncio.CancelledError, aiohttp.ClientConnectionResetError):
            # The client went away mid-response: the upstream request was closed with it.
            # Record the attempt (status 499, as nginx names it) without holding up the cancellation.
            self.m_upstream.labels(route.name, "499").inc()
            if recorded:
                self._background(self._quiet(self._finish(queue_id, route.name, tenant, 0, 499, fields.get("retry_count"))))
            raise
        except UpstreamBroke as exc:
            # The upstream reset or spoke no HTTP after the answer began: the client's
            # connection is cut (a truncated answer must not look whole), the attempt is 502.
            self.m_upstream.labels(route.name, "502").inc()
            if recorded:
                self._background(self._quiet(self._finish(queue_id, route.name, tenant, 0, 502, fields.get("retry_count"))))
            log.warning("upstream of route %s broke mid-answer: %s", route.name, exc)
            if request.transport is not None:
                request.transport.close()
            # Its end cannot be written (transport closed): a client gone to aiohttp, not a traceback.
            return request["llm_health_response"]
        self.m_upstream.labels(route.name, str(status)).inc()
        self.m_tokens.labels(route.name).inc(units)
        self.m_duration.labels(route.name).observe(time.monotonic() - started)
        response = request["llm_health_response"]
        if response.prepared:
            await response.write_eof()  # the client has its whole answer: Redis is not on its path
        if recorded:
            # Recorded in the background: the connection is free for the client's next request.
            self._background(self._quiet(self._finish(queue_id, route.name, tenant, units, status, fields.get("retry_count"))))
        return response

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` after the response; `stop()` waits for it."""
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _quiet(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a write off the client's path; only an unreachable Redis counts as down."""
        try:
            await coro
            self._redis(True)
        except REDIS_DOWN:
            self._redis(False)
        except RedisError as exc:
            log.error("redis refused a queue write: %s", exc)

    async def _forward(self, request: web.Request, route: Route, body: bytes, request_id: str) -> tuple[int, int]:
        """Stream the upstream response through, chunk by chunk; (status, token units)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["X-Request-Id"] = request_id
        url = route.upstream + request.raw_path  # the path checked by core.forwarding, as sent
        tail = b""
        assert self.session is not None  # started
        try:
            async with self.session.request(request.method, url, data=body, headers=headers, allow_redirects=False) as up:
                out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP})
                out.headers["X-Request-Id"] = request_id
                request["llm_health_response"] = out
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)  # raises if the client went away: the upstream is closed below
                    tail = (tail + chunk)[-16384:]
                # write_eof is left to the caller, which then records the attempt.
                return up.status, token_units(tail)
        except (TimeoutError, aiohttp.ClientError) as exc:
            if isinstance(exc, aiohttp.ClientConnectionResetError):
                raise  # the client went away (a write to it failed), not the upstream
            if "llm_health_response" in request:
                raise UpstreamBroke(f"{type(exc).__name__}: {exc}") from None
            resp = web.json_response(
                {"error": {"type": "upstream_unavailable", "message": f"upstream {route.name}: {type(exc).__name__}", "request_id": request_id}},
                status=502,
            )
            request["llm_health_response"] = resp
            return 502, 0

    # --- operator controls and metrics -----------------------------------------------------
    def _authorised(self, request: web.Request) -> bool:
        return self._admin is not None and self._admin.check(request)

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
            await self.queue.complete(str(rid), 499, route=route)
        return len(ids)

    def app(self, web_config: WebConfig | None = None) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes)  # read whole: routing by model needs it
        # Basic auth guards the gate's own endpoints; proxied requests carry the clients'
        # own credentials for the upstream and pass through. The operator's controls take
        # the admin bearer token in the same Authorization header, and check it themselves.
        secure(app, web_config or WebConfig(), protected=_needs_basic_auth)
        app.router.add_get("/metrics", metrics_handler(self.registry))
        app.router.add_post("/-/routes/{route}/{action}", self.handle_admin)
        app.router.add_get("/-/healthy", healthy)
        add_reload(app, self.reload)
        app.router.add_route("*", "/{tail:.*}", self.handle_proxy)

        async def lifecycle(app: web.Application) -> AsyncIterator[None]:
            await self.start()
            yield
            await self.stop()

        app.cleanup_ctx.append(lifecycle)
        return app


def _needs_basic_auth(r: web.Request) -> bool:
    if r.path.startswith("/-/routes/") and r.headers.get("Authorization", "").lower().startswith("bearer "):
        return False  # handle_admin checks the admin token
    return r.path == "/metrics" or (r.path.startswith("/-/") and r.path not in OPEN_PATHS)
