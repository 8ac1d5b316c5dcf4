"""`llm-health gate`: the age-first admission gate, a reverse proxy in front of
OpenAI-compatible backends (the engines of core.engines): the door for a deployment with no proxy of
its own.

For each request it asks `gate.decision` (the one decision every door uses: the
allowlist, the headers, the Redis record of the id, the policy) and either streams the
request through to the route's upstream without buffering, with `x-queue-age-ms` and
`x-deadline-slack-ms` on the way up and back, or answers the refusal: `503`/`429` with
`Retry-After` where a retry can still make it, a non-retryable status (422 by default)
where it cannot. After the response it finishes the attempt: status, token units from
the response's `usage` (of what was streamed, for a client that dropped the stream).

The operator's controls, `/metrics` and `/-/reload` are `gate.controls`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections import deque
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import Counter, Histogram
from redis import asyncio as aioredis

from ..config.gate import GateConfig, Route, parse_gate_config
from ..config.load import load_yaml
from ..config.web import WebConfig
from ..web import run_with
from .controls import Controls
from .decision import Admission, Outcome
from .headers import GateError, token_units
from .outcome import spent_units

log = logging.getLogger("llm_health.gate")


class UpstreamBroke(GateError):
    """The upstream failed after the answer to the client had begun."""


_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers", "transfer-encoding", "upgrade", "host", "content-length"}


def tune_gc() -> None:
    """For a process that runs the gate: collect the youngest generation less often, to cut
    the tail latency that collections add (measured in bench/bench_gate.py); run_app also
    keeps what start-up allocated out of every collection."""
    gc.set_threshold(100_000, 50, 50)


class Tail:
    """The last `size` bytes of a streamed answer (where a dropped stream's `usage` is), kept
    as the chunks that hold them: no copy of the answer per chunk."""

    def __init__(self, size: int = 16384):
        self.size = size
        self.chunks: deque[bytes] = deque()
        self.length = 0

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.length += len(chunk)
        while self.length - len(self.chunks[0]) >= self.size:
            self.length -= len(self.chunks.popleft())

    def units(self) -> int:
        """The token units the answer's tail reports (`usage`), 0 if none."""
        return token_units(b"".join(self.chunks)[-self.size :])


def tail_units(request: web.Request) -> int:
    tail = request.get("llm_health_tail")
    return tail.units() if tail is not None else 0


def answer(outcome: Outcome) -> web.Response:
    """A refusal as every door answers it: the status, the JSON body, the headers."""
    return web.Response(status=outcome.status, body=outcome.body_bytes(), content_type="application/json", headers=outcome.headers)


class Gate:
    """The reverse-proxy door: the decision of `gate.decision`, then the request streamed
    through to the route's upstream and the attempt finished after the response."""

    def __init__(self, cfg: GateConfig, redis: aioredis.Redis | Any = None, config_file: str | os.PathLike[str] | None = None):
        self.config_file = config_file
        self.admission = Admission(cfg, redis)
        self.deployment = self.admission.deployment
        self.redis = self.admission.redis
        self.queue = self.admission.queue
        self.registry = self.admission.registry
        self.controls = Controls(self.admission)
        self.session: aiohttp.ClientSession | None = None
        self.m_upstream = Counter(
            "llm_gate_upstream_responses", "Upstream responses by status code (429 and 503 kept apart).", ["route", "code"], registry=self.registry
        )
        self.m_duration = Histogram(
            "llm_gate_request_duration_seconds", "Time from request to the end of the response, by route.", ["route"], registry=self.registry
        )
        self.m_tokens = Counter("llm_gate_token_units", "Token units reported by upstream usage, by route.", ["route"], registry=self.registry)

    @property
    def cfg(self) -> GateConfig:
        return self.admission.cfg

    @property
    def redis_up(self) -> bool:
        return self.admission.redis_up

    async def reload(self) -> str:
        """Re-read the configuration file (`Admission.replace_config` keeps operator modes)."""
        if self.config_file is None:
            return "no configuration file to reload"
        return self.controls.replace_config(parse_gate_config(load_yaml(self.config_file), str(self.config_file)))

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        # No pool limit (aiohttp's default is 100 connections): an admitted request goes to its
        # upstream at once, so the engine's queue, the one queue_age_ms reads, is the only place
        # it waits; with the limit, the 101st long stream waited in the gate and its connect
        # timeout (which counts the wait for a pooled connection) answered 502 "upstream
        # unavailable" for the gate's own cap. sock_connect times the TCP connect alone.
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.cfg.upstream_timeout, sock_connect=5)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=timeout)
        self.admission.start()

    async def stop(self) -> None:
        await self.admission.stop()
        if self.session:
            await self.session.close()

    # --- the proxy -------------------------------------------------------------------
    async def handle_proxy(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        if (refused := self.admission.not_forwarded(request.method, request.raw_path)) is not None:
            return answer(refused)
        body = await request.read()
        outcome = await self.admission.decide(request.method, request.raw_path, request.headers, body, allowlist_checked=True)
        if not outcome.admitted:
            return answer(outcome)
        assert outcome.route is not None and outcome.attempt is not None
        route, attempt = outcome.route, outcome.attempt
        try:
            status, units = await self._forward(request, route, body, outcome)
        except (ConnectionResetError, asyncio.CancelledError, aiohttp.ClientConnectionResetError):
            # The client went away mid-response: the upstream request was closed with it.
            # Record the attempt (status 499, as nginx names it) with the token units the
            # engine reported so far, without holding up the cancellation.
            self.m_upstream.labels(route.name, "499").inc()
            self.admission.finish_later(attempt, 499, tail_units(request))
            raise
        except UpstreamBroke as exc:
            # The upstream reset or spoke no HTTP after the answer began: the client's
            # connection is cut (a truncated answer must not look whole), the attempt is 502.
            self.m_upstream.labels(route.name, "502").inc()
            self.admission.finish_later(attempt, 502, tail_units(request))
            log.warning("upstream of route %s broke mid-answer: %s", route.name, exc)
            if request.transport is not None:
                request.transport.close()
            # Its end cannot be written (transport closed): a client gone to aiohttp, not a traceback.
            return request["llm_health_response"]
        self.m_upstream.labels(route.name, str(status)).inc()
        units = spent_units(status, units)  # an engine's 503/529: a refusal, no token spent
        self.m_tokens.labels(route.name).inc(units)
        self.m_duration.labels(route.name).observe(time.monotonic() - started)
        response = request["llm_health_response"]
        if response.prepared:
            await response.write_eof()  # the client has its whole answer: Redis is not on its path
        # Recorded in the background: the connection is free for the client's next request.
        self.admission.finish_later(attempt, status, units)
        return response

    async def _forward(self, request: web.Request, route: Route, body: bytes, outcome: Outcome) -> tuple[int, int]:
        """Stream the upstream response through, chunk by chunk; (status, token units). The
        response's last 16 KiB stay in ``request["llm_health_tail"]`` (a Tail: the usage a
        dropped stream had reported)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers.update(outcome.headers)  # X-Request-Id, the decision, x-queue-age-ms, x-deadline-slack-ms
        request_id = outcome.headers["X-Request-Id"]
        url = route.upstream + request.raw_path  # the path checked by core.forwarding, as sent
        tail = request["llm_health_tail"] = Tail()
        assert self.session is not None  # started
        try:
            async with self.session.request(request.method, url, data=body, headers=headers, allow_redirects=False) as up:
                out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP})
                out.headers.update(outcome.headers)
                request["llm_health_response"] = out
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    tail.add(chunk)
                    await out.write(chunk)  # raises if the client went away: the upstream is closed below
                # write_eof is left to the caller, which then records the attempt.
                return up.status, tail.units()
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

    def app(self, web_config: WebConfig | None = None) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes)  # read whole: routing by model needs it
        # Basic auth guards the gate's own endpoints; proxied requests carry the clients'
        # own credentials for the upstream and pass through. The operator's controls take
        # the admin bearer token in the same Authorization header, and check it themselves.
        self.controls.add_to(app, web_config, self.reload)
        app.router.add_route("*", "/{tail:.*}", self.handle_proxy)
        run_with(app, self.start, self.stop)
        return app
