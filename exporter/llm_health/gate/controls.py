"""What every admission door's server has besides its door: the operator's controls
(bearer token), `/metrics`, `/-/healthy`, `/-/reload`, and Basic auth on them.

Operator controls: `POST /-/routes/<route>/reject_all`, `POST /-/routes/<route>/open`
(refused until queue age stayed under the deadline for two sampling intervals;
`?force=true` overrides), `POST /-/routes/<route>/drain` (ids whose age exceeds their
deadline leave the queue).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

from aiohttp import web

from ..config.gate import GateConfig
from ..config.web import WebConfig
from ..store.queue import now_ms
from ..web import OPEN_PATHS, BearerToken, add_reload, healthy, metrics_handler, secure
from .decision import Admission


class Controls:
    def __init__(self, admission: Admission):
        self.admission = admission
        token = admission.cfg.admin_token
        self._admin = BearerToken(token) if token else None

    def replace_config(self, new: GateConfig) -> str:
        self._admin = BearerToken(new.admin_token) if new.admin_token else None
        return self.admission.replace_config(new)

    def add_to(self, app: web.Application, web_config: WebConfig | None, reload: Callable[[], Awaitable[str]]) -> None:
        # Basic auth guards the server's own endpoints; the requests a door judges carry the
        # clients' own credentials for the upstream and pass through. The operator's controls
        # take the admin bearer token in the same Authorization header, and check it themselves.
        secure(app, web_config or WebConfig(), protected=needs_basic_auth)
        app.router.add_get("/metrics", metrics_handler(self.admission.registry))
        app.router.add_post("/-/routes/{route}/{action}", self.handle_admin)
        app.router.add_get("/-/healthy", healthy)
        add_reload(app, reload)

    def _authorised(self, request: web.Request) -> bool:
        return self._admin is not None and self._admin.check(request)

    async def handle_admin(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "unauthorised: a bearer token (gate.admin_token_file) is required"}, status=401)
        name, action = request.match_info["route"], request.match_info["action"]
        route = self.admission.cfg.routes.get(name)
        if route is None:
            return web.json_response({"error": f"no route {name!r}"}, status=404)
        if action == "reject_all":
            route.policy = replace(route.policy, mode="reject_all")
            route.guard.good = 0
            self.admission.m_closed.labels(name).set(1)
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
            self.admission.m_closed.labels(name).set(0)
            return web.json_response({"route": name, "mode": "open"})
        if action == "drain":
            drained = await self.drain(name)
            return web.json_response({"route": name, "drained": drained})
        return web.json_response({"error": f"unknown action {action!r} (reject_all, open, drain)"}, status=404)

    async def drain(self, route: str) -> int:
        """Remove from the queue every id whose deadline has passed (its age exceeds its deadline)."""
        queue = self.admission.queue
        ids = await self.admission.redis.zrangebyscore(queue.keys.route(route, "deadline"), "-inf", now_ms(), start=0, num=10000)
        for rid in ids:
            await queue.complete(str(rid), 499, route=route)
        return len(ids)


def needs_basic_auth(r: web.Request) -> bool:
    if r.path.startswith("/-/routes/") and r.headers.get("Authorization", "").lower().startswith("bearer "):
        return False  # handle_admin checks the admin token
    return r.path == "/metrics" or (r.path.startswith("/-/") and r.path not in OPEN_PATHS)
