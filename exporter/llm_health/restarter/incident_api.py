"""The restarter's incident records over HTTP, authenticated like /status:

GET /incidents                     the newest first: id, backend, when, stacks read, what failed
GET /incidents/{id}                the record's index (JSON)
GET /incidents/{id}/files/{name}   one raw file the index names (text)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .incidents import IncidentStore


def listing(store: IncidentStore, limit: int = 1000) -> list[dict[str, Any]]:
    out = []
    for incident_id in store.ids()[:limit]:
        index = store.index(incident_id)
        if index is None:
            continue
        out.append(
            {
                "id": incident_id,
                "url": f"/incidents/{incident_id}",
                "backend": index.get("backend"),
                "action": index.get("action"),
                "created_at": index.get("created_at"),
                "alertname": (index.get("alert") or {}).get("alertname"),
                "stacks": {s["pid"]: s["outcome"] for s in index.get("stacks", [])},
                "failures": sorted({f["reason"] for f in (index.get("capture") or {}).get("failures", [])}),
            }
        )
    return out


def add_routes(
    app: web.Application, stores: Callable[[], IncidentStore], authorised: Callable[[web.Request], bool], refuse: Callable[[web.Request], web.Response]
) -> None:
    def dumps(o: object) -> str:
        return json.dumps(o, default=str)

    async def index(request: web.Request) -> web.Response:
        if not authorised(request):
            return refuse(request)
        store = stores()
        return web.json_response({"directory": str(store.directory) if store.directory else None, "incidents": listing(store)}, dumps=dumps)

    async def one(request: web.Request) -> web.Response:
        if not authorised(request):
            return refuse(request)
        found = stores().index(request.match_info["id"])
        if found is None:
            return web.json_response({"error": "no such incident"}, status=404)
        return web.json_response(found, dumps=dumps)

    async def file(request: web.Request) -> web.Response:
        if not authorised(request):
            return refuse(request)
        data = stores().file(request.match_info["id"], request.match_info["name"])
        if data is None:
            return web.json_response({"error": "no such incident or file"}, status=404)
        return web.Response(body=data, content_type="text/plain", charset="utf-8")

    app.router.add_get("/incidents", index)
    app.router.add_get("/incidents/{id}", one)
    app.router.add_get("/incidents/{id}/files/{name}", file)
