"""`llm-health decide`: the admission decision as an endpoint, for the proxies teams already
run. Both doors take the original request's method and path (appended to the door's
prefix) and its headers, ask `gate.decision` (the same decision as the gate), and answer:

- **Envoy `ext_authz`, HTTP service** (`path_prefix: /-/ext_authz`): 200 admits, with
  `x-queue-age-ms`, `x-deadline-slack-ms`, `X-Request-Id` and the decision for Envoy's
  `allowed_upstream_headers` / `allowed_client_headers`; a refusal is answered as the gate
  answers it (its status, `Retry-After`, the JSON body), which Envoy sends to the client.
- **nginx `auth_request`** (`proxy_pass http://.../-/auth_request$request_uri`): nginx
  honours only 2xx, 401 and 403 from the subrequest, so a refusal is a 403 carrying the
  refusal (`X-LLM-Health-Refusal`: status, headers, body, base64url JSON); the shipped
  snippet's `error_page 403` sends it to `/-/refused`, which answers it with its own
  status. The attempt's end comes back through nginx's `access_log syslog:` (UDP) to
  `--syslog.listen-address`: the `X-LLM-Health-Record` token the decision gave (signed,
  so a stray datagram cannot finish a record), the upstream status; nginx cannot see
  the response body, so no token units.

Neither door reads the request body: route by `X-Route` (set per location in nginx, per
route in Envoy), or the first route.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import Counter
from redis import asyncio as aioredis

from ..config.gate import GateConfig, parse_gate_config
from ..config.load import load_yaml
from ..config.web import WebConfig
from .controls import Controls
from .decision import Admission, Attempt

log = logging.getLogger("llm_health.gate.doors")

REFUSAL_HEADER = "X-LLM-Health-Refusal"
RECORD_HEADER = "X-LLM-Health-Record"
MAX_REFUSAL_BYTES = 4096  # nginx's proxy_buffer_size holds the subrequest's headers (4-8 KiB)
MAX_DATAGRAM = 8192
_STATUS = re.compile(r"^[1-5][0-9]{2}$")
Answer = tuple[int, dict[str, str], bytes]  # status, headers (Content-Type where a body), body


def _json(status: int, body: dict[str, Any]) -> Answer:
    return status, {"Content-Type": "application/json; charset=utf-8"}, json.dumps(body).encode()


def _response(answer: Answer) -> web.Response:
    status, headers, body = answer
    return web.Response(status=status, headers=headers, body=body or None)


class Doors:
    def __init__(self, cfg: GateConfig, redis: aioredis.Redis | Any = None, config_file: str | os.PathLike[str] | None = None):
        self.config_file = config_file
        self.admission = Admission(cfg, redis)
        self.controls = Controls(self.admission)
        self._key = os.urandom(32)  # signs record tokens: valid for this process's life
        r = self.admission.registry
        self.m_reports = Counter("llm_gate_door_reports", "Attempt reports from a proxy's access log, by result.", ["result"], registry=r)
        for result in ("recorded", "bad_token", "malformed", "not_recorded"):
            self.m_reports.labels(result)
        self._transport: asyncio.DatagramTransport | None = None

    async def reload(self) -> str:
        if self.config_file is None:
            return "no configuration file to reload"
        return self.controls.replace_config(parse_gate_config(load_yaml(self.config_file), str(self.config_file)))

    # --- record tokens ---------------------------------------------------------------------
    def token(self, attempt: Attempt) -> str:
        fields = [attempt.queue_id, attempt.route, attempt.tenant, attempt.retry_count, attempt.attempt_id, attempt.deadline_ms]
        data = base64.urlsafe_b64encode(json.dumps(fields).encode())
        return f"{data.decode()}.{self._mac(data)}"

    def _mac(self, data: bytes) -> str:
        """BLAKE2b in its keyed mode (a MAC by design), 128 bits: a tenth of HMAC-SHA256's
        cost through OpenSSL."""
        return hashlib.blake2b(data, key=self._key, digest_size=16).hexdigest()

    def attempt_of(self, token: str) -> Attempt | None:
        data, _, mac = token.strip().rpartition(".")
        if not data or not hmac.compare_digest(self._mac(data.encode()), mac):
            return None
        try:
            queue_id, route, tenant, retry_count, attempt_id, deadline_ms = json.loads(base64.urlsafe_b64decode(data))
        except (ValueError, binascii.Error, TypeError):
            return None
        request_id = queue_id.split("/", 1)[1] if "/" in queue_id else queue_id
        return Attempt(request_id, queue_id, route, tenant, retry_count, True, attempt_id, deadline_ms=deadline_ms)

    # --- the doors --------------------------------------------------------------------------
    # Each door's answer as (status, headers, body), read by the aiohttp handlers below and
    # by the fast path (`gate.fast_doors`) alike: one answer path, two ways of serving it.
    async def ext_authz(self, method: str, raw_path: str, headers: Mapping[str, str]) -> Answer:
        outcome = await self.admission.decide(method, raw_path[len("/-/ext_authz") :] or "/", headers)  # Envoy sends the original method
        if outcome.admitted:
            assert outcome.attempt is not None
            # Envoy's ext_authz reports no end: the attempt is counted now, its status unknown.
            self.admission.finish_later(outcome.attempt, None)
            return 200, outcome.headers, b""
        return outcome.status, {**outcome.headers, "Content-Type": "application/json"}, outcome.body_bytes()

    async def auth_request(self, raw_path: str, headers: Mapping[str, str]) -> Answer:
        # nginx's subrequest is a GET; the shipped snippet sends the method in X-Original-Method.
        method = headers.get("X-Original-Method", "").upper()
        if not method.isalpha() or len(method) > 16:
            return _json(400, {"error": {"type": "bad_request", "message": "X-Original-Method must be the request's method (deploy/nginx sets it)"}})
        outcome = await self.admission.decide(method, raw_path[len("/-/auth_request") :] or "/", headers)
        if outcome.admitted:
            assert outcome.attempt is not None
            out = dict(outcome.headers)
            if outcome.attempt.recorded:
                out[RECORD_HEADER] = self.token(outcome.attempt)
            elif outcome.attempt.late:  # its enqueue may run when Redis resumes: finished then, status unknown
                self.admission.finish_later(outcome.attempt, None)
            return 200, out, b""
        refusal = {"status": outcome.status, "headers": outcome.headers, "body": outcome.body}
        encoded = base64.urlsafe_b64encode(json.dumps(refusal, separators=(",", ":")).encode()).decode()
        if len(encoded) > MAX_REFUSAL_BYTES:  # a long reason: the body cut to what nginx can carry
            refusal["body"] = {"error": {"type": "admission_rejected", "code": outcome.decision}}
            encoded = base64.urlsafe_b64encode(json.dumps(refusal, separators=(",", ":")).encode()).decode()
        return 403, {**outcome.headers, REFUSAL_HEADER: encoded}, b""

    def refused(self, headers: Mapping[str, str]) -> Answer:
        """The refusal nginx carried from the subrequest, answered with its own status.
        Only what a refusal holds is rendered: a status of 400-599, string headers of the
        decision's set, a JSON body."""
        raw = headers.get(REFUSAL_HEADER, "")
        try:
            if not raw or len(raw) > 2 * MAX_REFUSAL_BYTES:
                raise ValueError("missing or too long")
            refusal = json.loads(base64.urlsafe_b64decode(raw))
            status = int(refusal["status"])
            if not 400 <= status <= 599:
                raise ValueError("status")
            allowed = {"x-request-id", "x-llm-health-decision", "x-queue-age-ms", "x-deadline-slack-ms", "retry-after", "allow", "x-should-retry"}
            out = {str(k): str(v) for k, v in dict(refusal["headers"]).items() if str(k).lower() in allowed and "\n" not in str(v) and "\r" not in str(v)}
            body = json.dumps(refusal["body"], separators=(",", ":")).encode()
        except (ValueError, KeyError, TypeError, binascii.Error):
            return _json(403, {"error": {"type": "forbidden", "message": f"no valid {REFUSAL_HEADER} header"}})
        return status, {**out, "Content-Type": "application/json"}, body

    # A door reads no body, but one over the app's client_max_size (1 KiB) is refused with
    # 413 before any decision, as gate.fast_doors refuses it: read, aiohttp holds the limit.
    async def handle_ext_authz(self, request: web.Request) -> web.Response:
        await request.read()
        return _response(await self.ext_authz(request.method, request.raw_path, request.headers))

    async def handle_auth_request(self, request: web.Request) -> web.Response:
        await request.read()
        return _response(await self.auth_request(request.raw_path, request.headers))

    async def handle_refused(self, request: web.Request) -> web.Response:
        await request.read()
        return _response(self.refused(request.headers))

    # --- nginx's access log: the attempt's end -------------------------------------------------
    def report(self, datagram: bytes) -> str:
        """One syslog line from nginx (`<PRI>... tag: {json}` with `record`, `status` and
        `upstream_status`): the attempt finished. Returns the result counted."""
        line = datagram[:MAX_DATAGRAM].decode("utf-8", "replace")
        start = line.find("{")
        try:
            entry = json.loads(line[start:]) if start >= 0 else None
            if not isinstance(entry, dict):
                raise ValueError("no JSON object")
            token = str(entry.get("record", ""))
            upstream = str(entry.get("upstream_status", "")).rsplit(",", 1)[-1].strip()
            status = int(upstream) if _STATUS.match(upstream) else int(entry["status"])
        except (ValueError, KeyError, TypeError):
            result = "malformed"
        else:
            if not token or token == "-":
                result = "not_recorded"
            elif (attempt := self.attempt_of(token)) is None:
                result = "bad_token"
            else:
                # nginx's 499: the client closed the connection first.
                self.admission.finish_later(attempt, status)
                result = "recorded"
        self.m_reports.labels(result).inc()
        return result

    async def listen_syslog(self, host: str, port: int) -> tuple[str, int]:
        doors = self

        class Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                doors.report(data)

        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(Protocol, local_addr=(host, port))
        self._transport = transport
        sock = transport.get_extra_info("sockname")
        return sock[0], sock[1]

    def app(self, web_config: WebConfig | None = None, syslog: tuple[str, int] | None = None) -> web.Application:
        app = web.Application(client_max_size=1024)  # the doors read no body
        self.controls.add_to(app, web_config, self.reload)
        app.router.add_route("*", "/-/ext_authz{tail:.*}", self.handle_ext_authz)
        app.router.add_route("*", "/-/auth_request{tail:.*}", self.handle_auth_request)
        app.router.add_route("*", "/-/refused", self.handle_refused)

        async def lifecycle(app: web.Application) -> AsyncIterator[None]:
            self.admission.start()
            if syslog is not None:
                bound = await self.listen_syslog(*syslog)
                log.info("nginx access-log reports on udp %s:%d", *bound)
            yield
            if self._transport is not None:
                self._transport.close()
            await self.admission.stop()

        app.cleanup_ctx.append(lifecycle)
        return app
