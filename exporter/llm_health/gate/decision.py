"""The one admission decision every door uses: the gate's reverse proxy (`gate.app`), the
decision endpoint for nginx `auth_request` and Envoy `ext_authz` (`gate.doors`), and the
LiteLLM hook. A door hands over what it knows of the request (method, raw path, headers,
the body where it has one) and gets an `Outcome`: admitted, with the headers to pass to
the upstream and the client, or refused, with the status, the JSON body and the headers
(`Retry-After`) to answer with. Every door answers the same vocabulary; none holds a copy
of the decision.

What it does, in order: the route's allowlist (`core.forwarding`: 404/405), the headers
(`gate.headers`: 400 naming the header), one Redis round trip, one script
(`store.scripts.DECIDE_LUA`: the request enqueued or a resent id recognised, the route's
queue age, the tenant's spend), the policy
(`core.admission.decide`). A refusal is marked done at once. An admitted request comes
with an `Attempt` the door finishes when it knows the upstream's answer (`finish`): the
attempt's status and token units, the id done, the tenant charged, in one idempotent
script, the finishes of one short tick in one round trip (`store.batch`), sent again
(bounded) while Redis does not answer, counted when given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import Coroutine, Mapping
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis import asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from ..config.gate import GateConfig, Route
from ..core import admission, forwarding
from ..store.batch import WriteBatch
from ..store.deployment import connect, wrap
from ..store.errors import ERRORS, REDIS_DOWN, as_down, may_run_late, retryable
from ..store.fast_redis import FastRedis, Pipe
from ..store.policy import policy_args
from ..store.queue import ENDED, GAVE_UP, AdmissionQueue, Decided, engine_queue_age, now_ms, parse_decide
from ..tasks import cancel_and_wait
from .headers import BadRequest, read_deadline_ms, read_request_id, read_retry_count, read_tenant, retry_fingerprint
from .outcome import UPSTREAM_REFUSALS, Attempt, Outcome, error_outcome, spent_units

log = logging.getLogger("llm_health.gate")


# Redis down or failing over (store.errors.REDIS_DOWN, as_down): the route's redis_down
# policy applies. Any other Redis error means Redis is up and answered.
# The headers a door hands the proxy (and the proxy the upstream and the client), in the
# user's field names.
QUEUE_AGE_HEADER = "x-queue-age-ms"
SLACK_HEADER = "x-deadline-slack-ms"
DECISION_HEADER = "X-LLM-Health-Decision"
SHOULD_RETRY_HEADER = "x-should-retry"  # the OpenAI SDKs obey it before their status rules

# Finishing an attempt while Redis does not answer: sent again after these pauses (about
# 7 s in all, past a Sentinel failover's few seconds), then given up and counted.
FINISH_RETRY_S = (0.1, 0.3, 1.0, 2.0, 4.0)
# A late attempt's finish is sent once more this long after Redis answered it: by then
# the enqueue it sent before the stall (in Redis' buffer, run as soon as Redis resumed)
# has surely run, whichever connection Redis read first.
LATE_RESEND_S = 1.0
FINISH_TICK_S = 0.01  # finishes gathered this long go to Redis in one round trip (store.batch)
LATE_PENDING_MAX = 4096  # background writes pending past which a late attempt is not followed
FORWARDED_CACHE = 1024  # (method, path) pairs remembered as forwarded (`not_forwarded`)


@functools.lru_cache(maxsize=256)
def _policy_args(p: admission.Policy) -> list[str]:
    """A route's policy as the decision script's arguments (store.policy), once per policy."""
    return policy_args(p)


class Admission:
    """The decision and the record, shared by every door of one process."""

    def __init__(self, cfg: GateConfig, redis: aioredis.Redis | Any = None, registry: CollectorRegistry | None = None):
        self.cfg = cfg
        # One server, Sentinel or Cluster, from the URL (store.deployment); on one server
        # at most 64 connections, a caller waiting up to 1 s for a free one.
        self.deployment = wrap(redis) if redis is not None else connect(cfg.redis_url, socket_timeout=1.0, max_connections=64, blocking_timeout=1.0)
        self.redis = self.deployment.client
        self.queue = AdmissionQueue(self.deployment, prefix=cfg.queue_prefix)
        self.fast_redis = FastRedis.for_deployment(self.deployment)  # one server: the hot path's own connection (store.fast_redis)
        self.redis_up = True
        self._pending: set[asyncio.Task[None]] = set()  # attempts being recorded after their response
        self._sampler: asyncio.Task[None] | None = None
        self._finishes = WriteBatch(self._pipeline, self._execute, FINISH_TICK_S)
        self._index_routes()
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.m_decisions = Counter("llm_gate_decisions", "Admission decisions by route.", ["route", "decision"], registry=r)
        self._decision_children: dict[tuple[str, str], Any] = {}
        why = "Requests refused before admission: 404 (an endpoint not forwarded, an engine admin or dev one), 405 (a method not forwarded)."
        self.m_not_forwarded = Counter("llm_gate_not_forwarded", why, ["code"], registry=r)
        for code in ("404", "405"):
            self.m_not_forwarded.labels(code)
        self.m_redis = Gauge("llm_gate_redis_up", "1 if the gate's last Redis call succeeded.", registry=r)
        self.m_closed = Gauge("llm_gate_route_closed", "1 while an operator holds the route at reject_all.", ["route"], registry=r)
        self.m_record_retries = Counter("llm_gate_record_retries", "Attempt records sent to Redis again after it did not answer.", registry=r)
        self.m_records_lost = Counter(
            "llm_gate_records_given_up", "Attempt records given up after Redis did not answer for every retry (the record expires).", registry=r
        )
        why = "Upstream answers that refused the work (an engine shedding load: 503, Dynamo's 529), recorded with no token units, by route and code."
        self.m_upstream_refusals = Counter("llm_gate_upstream_refusals", why, ["route", "code"], registry=r)
        why = "Token units the upstream reported for answers that ended after their request's deadline (work its client could not use), by route."
        self.m_late_units = Counter("llm_gate_late_token_units", why, ["route"], registry=r)
        self.m_redis.set(1)
        self._label_routes()

    def _index_routes(self) -> None:
        self._forwarded: set[tuple[str, str, int]] = set()  # (method, path, rules) found forwarded
        routes = self.cfg.routes.values()
        self._by_model = any(r.models for r in routes)
        self._any_rules = tuple(rule for r in routes for rule in r.allow)  # before a route is chosen

    def _label_routes(self) -> None:
        for name, route in self.cfg.routes.items():
            self.m_closed.labels(name).set(1 if route.policy.mode == "reject_all" else 0)
            for d in admission.DECISIONS:
                self.m_decisions.labels(name, d)
            for code in UPSTREAM_REFUSALS:
                self.m_upstream_refusals.labels(name, str(code))
            self.m_late_units.labels(name)

    def replace_config(self, new: GateConfig) -> str:
        """A reloaded configuration: a route keeps its current mode (an operator's
        reject_all survives a reload) and its reopen guard; everything else is the file's."""
        note = ""
        if (new.redis_url, new.queue_prefix) != (self.cfg.redis_url, self.cfg.queue_prefix):
            note = " (gate.redis and gate.queue_prefix take effect on restart only)"
        for name, route in new.routes.items():
            old = self.cfg.routes.get(name)
            if old is not None:
                route.policy = replace(route.policy, mode=old.policy.mode)
                route.guard = old.guard
        new.redis_url, new.queue_prefix = self.cfg.redis_url, self.cfg.queue_prefix
        self.cfg = new
        self._index_routes()
        self._label_routes()
        return f"{len(new.routes)} routes{note}"

    # --- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self._sampler = asyncio.create_task(self._sample())

    async def stop(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._sampler:
            await cancel_and_wait(self._sampler)  # its Redis read may swallow one cancellation
        if self.fast_redis is not None:
            self.fast_redis.close()
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
                    if retryable(exc):
                        self._redis(False)
                    else:
                        log.error("redis refused the queue read of route %s: %s", route.name, exc)
                    continue
                self._redis(True)
                age: float = stats.oldest_age_ms or 0
                if route.backends:
                    engine_age = await self._engine_age(route)
                    # Unknown is not "under the deadline": the interval does not count as good.
                    age = max(age, engine_age) if engine_age is not None else math.inf
                deadline = route.policy.default_deadline_ms or route.policy.reject_if_queue_age_ms_gte
                route.guard.observe(age, deadline)

    def _counted(self, route: str, decision: str) -> Any:
        """The decisions counter's child (prometheus_client's `labels` looks it up under a lock)."""
        child = self._decision_children.get((route, decision))
        if child is None:
            child = self._decision_children[(route, decision)] = self.m_decisions.labels(route, decision)
        return child

    def _redis(self, ok: bool) -> None:
        self.redis_up = ok
        self.m_redis.set(1 if ok else 0)

    # --- the decision ------------------------------------------------------------------
    def not_forwarded(self, method: str, raw_path: str, route: Route | None = None) -> Outcome | None:
        """404/405 for what the route (or, with no route yet, any route) does not forward."""
        rules = route.allow if route is not None else self._any_rules
        path = raw_path.split("?", 1)[0]
        if (method, path, id(rules)) in self._forwarded:
            return None
        verdict = forwarding.check(method, path, rules)
        if verdict.forward:
            if len(self._forwarded) < FORWARDED_CACHE:  # the few endpoints a door sees, not every path a client invents
                self._forwarded.add((method, path, id(rules)))
            return None
        self.m_not_forwarded.labels(str(verdict.status)).inc()
        headers = {"Allow": ", ".join(verdict.allow)} if verdict.allow else None
        return error_outcome(verdict.status, "not_forwarded", verdict.reason, headers)

    def route_for(self, headers: Mapping[str, str], body: bytes | None) -> Route:
        name = headers.get("X-Route")
        if name:
            if name not in self.cfg.routes:
                raise BadRequest(f"X-Route {name!r} is not a configured route ({', '.join(self.cfg.routes)})")
            return self.cfg.routes[name]
        first = next(iter(self.cfg.routes.values()))
        if len(self.cfg.routes) == 1 or not self._by_model or not body or body[:1] != b"{":
            return first
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            return first
        return next((r for r in self.cfg.routes.values() if model is not None and model in r.models), first)

    async def decide(self, method: str, raw_path: str, headers: Mapping[str, str], body: bytes | None = None, *, allowlist_checked: bool = False) -> Outcome:
        """The whole decision for one request at a door (see the module's docstring);
        ``allowlist_checked``: the door already asked `not_forwarded` with no route."""
        if not allowlist_checked and (refused := self.not_forwarded(method, raw_path)) is not None:
            return refused
        now = now_ms()
        try:
            client_id = read_request_id(headers)
            route = self.route_for(headers, body)
            if len(self.cfg.routes) > 1 and (refused := self.not_forwarded(method, raw_path, route)) is not None:
                return refused
            tenant = read_tenant(headers)
            deadline_ms = read_deadline_ms(headers, now, route.policy.default_deadline_ms)
            header_retries = read_retry_count(headers)
        except BadRequest as exc:
            return error_outcome(400, "bad_request", str(exc))
        # Without an id (the OpenAI SDK's way) a retry (count >= 1) takes the id, deadline and
        # retry count of the oldest first copy of its fingerprint not yet retried at that
        # count (store.scripts.DECIDE_LUA); a fresh request is never matched.
        fingerprint: str | None = None
        if client_id is not None:
            request_id = client_id
        else:
            fingerprint = retry_fingerprint(tenant, route.name, method, raw_path, headers, body)
            request_id = f"gate-{uuid.uuid4()}"
        # Ids are the client's, scoped by tenant: two tenants' `order-1001` are two requests.
        queue_id = f"{tenant}/{request_id}"
        fields: dict[str, Any] = {"request_id": request_id}
        recorded, late = True, False
        try:
            got = await self._enqueue_and_read(queue_id, route, tenant, deadline_ms, now, fingerprint, header_retries)
            self._redis(True)
            if got.record.request_id != queue_id:  # a retry without an id, matched to its first copy
                queue_id = got.record.request_id
                request_id = fields["request_id"] = queue_id.split("/", 1)[1]
            # The one decision, made in the script (store.policy, the reference core.admission):
            # age first, over the route's own Redis queue and its backends' engines; a resent
            # id keeps the deadline of its first copy, and its lateness is in its slack.
            fig, v = got.figures, got.verdict
            assert fig is not None and v is not None
            deadline_ms = got.record.deadline_ms
            fields.update(queue_age_ms=fig.queue_age_ms, deadline_slack_ms=fig.slack_ms, retry_count=fig.retry_count)
            if route.backends:
                fields["engine_queue_age_ms"] = fig.engine_age_ms
            if fig.wait_ms is not None:
                fields["expected_wait_ms"] = fig.wait_ms
            decision = admission.Decision(v.decision, v.reason, v.status, v.retry_after_s, v.retryable)
        except REDIS_DOWN as exc:
            self._redis(False)
            recorded, late = False, may_run_late(exc)
            log.warning("redis unreachable for route %s (%s): failing %s", route.name, type(exc).__name__, route.policy.redis_down)
            slack = deadline_ms - now
            # A rejection's body has every documented key; the queue age is unknown (null).
            fields.update(queue_age_ms=None, deadline_slack_ms=slack, retry_count=header_retries)
            if route.policy.redis_down == "closed":
                decision = admission.bounded(
                    admission.Decision(
                        admission.REJECT_REDIS_DOWN, "Redis unreachable: queue age unknown; route fails closed", 503, retry_after_s=5.0, retryable=True
                    ),
                    slack,
                    route.policy,
                )
            else:
                # Fail open: the policy still sees this request's own deadline and retries.
                decision = admission.decide(admission.Request(queue_age_ms=0, deadline_slack_ms=slack, retry_count=header_retries), route.policy)
                if decision.admitted:
                    decision = replace(decision, decision=admission.ADMIT_UNRECORDED, reason=f"{decision.reason}; Redis unreachable, failing open")
        except RedisError as exc:
            # Redis answered, and refused: a value of this request, or a bug; Redis is up.
            log.error("redis refused the request record for route %s: %s", route.name, exc)
            return error_outcome(500, "internal", "the request could not be recorded", request_id=request_id)

        self._counted(route.name, decision.decision).inc()
        out = {"X-Request-Id": request_id, DECISION_HEADER: decision.decision}
        if fields.get("queue_age_ms") is not None:
            out[QUEUE_AGE_HEADER] = str(int(fields["queue_age_ms"]))
        out[SLACK_HEADER] = str(int(fields["deadline_slack_ms"]))
        if decision.admitted:
            attempt = Attempt(request_id, queue_id, route.name, tenant, fields.get("retry_count"), recorded, late=late, deadline_ms=deadline_ms)
            return Outcome(True, 200, decision.decision, out, route=route, attempt=attempt)
        if recorded:
            await self.quiet(self.queue.complete(queue_id, decision.status, route=route.name))
        elif late and self._late_room():
            self.background(self._complete_late(queue_id, decision.status, route.name))
        if decision.retry_after_s is not None:
            out["Retry-After"] = str(admission.retry_after_header(decision.retry_after_s))
        # The OpenAI SDKs obey this before their status rules: a non-retryable refusal is
        # never retried, whatever its status.
        out[SHOULD_RETRY_HEADER] = "true" if decision.retryable else "false"
        refusal = {
            "error": {
                "type": "admission_rejected",
                "code": decision.decision,
                "message": decision.reason,
                "retryable": decision.retryable,
                "route": route.name,
                **fields,
            }
        }
        return Outcome(False, decision.status, decision.decision, out, refusal, route=route)

    async def _engine_age(self, route: Route) -> int | None:
        try:
            return engine_queue_age(await self.redis.mget([self.queue.keys.engine_age(b) for b in route.backends]))
        except RedisError:
            return None

    def _tenant_key(self, tenant: str) -> str:
        return self.queue.keys.tenant(tenant, int(time.time() // 60))

    async def _enqueue_and_read(
        self, request_id: str, route: Route, tenant: str, deadline_ms: int, now: int, fingerprint: str | None = None, retries: int = 0
    ) -> Decided:
        """One round trip (store.queue.pipe_decide): a retry without an id matched to its
        first copy (the record is then that copy's), enqueue (or a resent id recognised),
        the route's queue stats, the tenant's spend, the backends' engine age, the wait
        projected for this request, the id taken off the waiting set, and the decision."""
        q = self.queue
        pipe = await self._pipeline()
        limit = self.cfg.tenants.get(tenant)
        # A first copy is matched until its deadline plus the window its client may retry in.
        until = deadline_ms + int(route.policy.retry_match_window_ms)
        fp = (q.keys.retry_match(fingerprint), retries, until) if fingerprint is not None else None
        q.pipe_decide(
            pipe,
            request_id,
            route.name,
            tenant,
            deadline_ms,
            now,
            tenant_key=self._tenant_key(tenant) if limit is not None else None,
            fingerprint=fp,
            backends=route.backends,
            retries=retries,
            budget=limit,
            policy=_policy_args(route.policy),
        )
        return parse_decide(request_id, (await self._execute(pipe))[0], now)

    # --- finishing an attempt -------------------------------------------------------------
    async def finish(self, attempt: Attempt, status: int | None, units: int = 0) -> bool:
        """The attempt's end as a door knows it, counted once: an upstream refusal (503, 529)
        with no token units (`llm_gate_upstream_refusals_total`), the units of an answer that
        ended past its deadline (`llm_gate_late_token_units_total`); then recorded (`_finish`)."""
        units = spent_units(status, units)
        if status in UPSTREAM_REFUSALS:
            self.m_upstream_refusals.labels(attempt.route, str(status)).inc()
        elif units and attempt.deadline_ms is not None and now_ms() > attempt.deadline_ms:
            self.m_late_units.labels(attempt.route).inc(units)
        return await self._finish(attempt, status, units)

    async def _finish(self, attempt: Attempt, status: int | None, units: int = 0) -> bool:
        """Record the attempt's end (status, token units), the id done, the tenant charged:
        one idempotent script and the leave (status None: not known to the door), sent again while Redis does not answer
        (FINISH_RETRY_S), then given up (counted). True once written. A late attempt
        (`Attempt.late`) is sent once more LATE_RESEND_S after Redis answered: the scripts
        change nothing where there is no record, and count one attempt id once."""
        if not attempt.recorded and not attempt.late:
            return False
        for pause in (*FINISH_RETRY_S, None):
            try:
                await self._finish_once(attempt, status, units)
                self._redis(True)
                if attempt.late:
                    await asyncio.sleep(LATE_RESEND_S)
                    return await self._finish(replace(attempt, late=False, recorded=True), status, units)
                return True
            except REDIS_DOWN as exc:
                self._redis(False)
                if pause is None:
                    self.m_records_lost.inc()
                    log.warning(
                        "gave up recording the attempt of %s on route %s: Redis did not answer (%s)", attempt.request_id, attempt.route, type(exc).__name__
                    )
                    return False
                self.m_record_retries.inc()
                await asyncio.sleep(pause)
            except RedisError as exc:
                log.error("redis refused the attempt record of route %s: %s", attempt.route, exc)
                return False
        return False  # not reached

    async def _finish_once(self, attempt: Attempt, status: int | None, units: int) -> None:
        """One try, in the batch of finishes open now (store.batch: one round trip per tick)."""
        q = self.queue
        now = now_ms()
        tenant_key = self._tenant_key(attempt.tenant) if attempt.tenant in self.cfg.tenants and units else None

        def add(pipe: Any) -> None:
            q.pipe_attempt(pipe, q.attempt_call(attempt.queue_id, attempt.route, units, status, attempt.retry_count, now, attempt.attempt_id, tenant_key))
            q.pipe_leave(pipe, attempt.queue_id, attempt.route, "done", status, now, ended=GAVE_UP if status == 499 else ENDED)

        await self._finishes.run(add)

    async def _complete_late(self, queue_id: str, status: int, route: str) -> None:
        """A refusal whose enqueue may run late (`may_run_late`): marked done once Redis
        answers, and again LATE_RESEND_S later (no record: nothing changes)."""
        for pause in (*FINISH_RETRY_S, None):
            try:
                await self.queue.complete(queue_id, status, route=route)
            except ERRORS:
                if pause is None:
                    self.m_records_lost.inc()
                    return
                await asyncio.sleep(pause)
                continue
            await asyncio.sleep(LATE_RESEND_S)
            with contextlib.suppress(*ERRORS):
                await self.queue.complete(queue_id, status, route=route)
            return

    def finish_later(self, attempt: Attempt, status: int | None, units: int = 0) -> None:
        """`finish` off the client's path; `stop()` waits for it."""
        if attempt.recorded or (attempt.late and self._late_room()):
            self.background(self.finish(attempt, status, units))

    def _late_room(self) -> bool:
        """Room for one more late attempt's finish (at most LATE_PENDING_MAX pending: a
        Redis black-holed for minutes under load must not pile up tasks); else counted
        as given up (the record, if the enqueue ever runs, expires with its retention)."""
        if len(self._pending) < LATE_PENDING_MAX:
            return True
        self.m_records_lost.inc()
        return False

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def quiet(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a write off the client's path; only an unreachable Redis counts as down."""
        try:
            await coro
            self._redis(True)
        except REDIS_DOWN:
            self._redis(False)
        except RedisError as exc:
            if retryable(exc):
                self._redis(False)
            else:
                log.error("redis refused a queue write: %s", exc)

    # --- Redis ---------------------------------------------------------------------------
    async def _pipeline(self) -> Pipe:
        """The seam of store.fast_redis: its pipe on one server, redis-py's elsewhere."""
        return self.fast_redis.pipeline() if self.fast_redis is not None else await self.queue.pipeline()

    async def _execute(self, pipe: Pipe) -> list[Any]:
        """`AdmissionQueue.execute` (scripts reloaded, a Cluster's MOVED followed), or on one
        server the fast path's pipe (`store.fast_redis`); Redis down or failing over refreshes
        the topology for the next request and raises."""
        try:
            if self.fast_redis is None:
                return await self.queue.execute(pipe)
            try:
                return await pipe.execute()
            except NoScriptError:  # a restarted Redis: the scripts loaded, the commands sent again
                await self.queue.load_scripts()
                return await pipe.execute()
        except REDIS_DOWN:
            await self.deployment.refresh_topology()  # Cluster: the next request finds the new primary
            raise
        except RedisError as exc:  # a failover's answer (NOREPLICAS, ...) is Redis down too
            raise as_down(exc) from exc
