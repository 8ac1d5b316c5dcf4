"""`llm-health incident show ID`: an incident record, read from its directory (`--dir`,
the restarter's `incidents.dir`) or from the restarter's API (`--url` and its token),
printed as a summary: the engine, how long without progress, what was in flight, the top
frames of each thread, what could not be captured (core.incident.summary).

    llm-health incident list --dir /var/lib/llm-health/incidents
    llm-health incident show 20261202T141503Z-gpu0-1 --dir /var/lib/llm-health/incidents
    llm-health incident show 20261202T141503Z-gpu0-1 --url http://127.0.0.1:9120 --token-file /etc/llm-health/token
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..config.capture import Incidents
from ..config.errors import ConfigError
from ..config.restarter import TOKEN_ENV, read_token
from ..core.incident import INCIDENT_ID, summary
from .common import CliError


class NotFound(CliError):
    pass


def _from_dir(directory: str, incident_id: str) -> tuple[dict[str, Any], dict[str, str]]:
    from ..restarter.incidents import IncidentStore

    store = IncidentStore(Incidents(dir=directory))
    index = store.index(incident_id)
    if index is None:
        raise NotFound(f"no incident {incident_id} in {directory}")
    files = {name: (store.file(incident_id, name) or b"").decode("utf-8", "replace") for name in index.get("files", {})}
    return index, files


def _get(url: str, token: str) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            data: bytes = resp.read()
            return data
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise NotFound(f"{url}: no such incident") from None
        raise NotFound(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise NotFound(f"{url}: {getattr(exc, 'reason', exc)}") from None


def _from_api(base: str, token: str, incident_id: str) -> tuple[dict[str, Any], dict[str, str]]:
    base = base.rstrip("/")
    index = json.loads(_get(f"{base}/incidents/{incident_id}", token))
    files = {
        name: _get(f"{base}/incidents/{incident_id}/files/{name}", token).decode("utf-8", "replace")
        for name in index.get("files", {})
        if name.startswith(("stacks-", "maps-"))
    }
    return index, files


def cmd(args: argparse.Namespace) -> int:
    if args.action == "show" and not INCIDENT_ID.match(args.id or ""):
        print(f"llm-health incident: {args.id!r} is not an incident id (like 20261202T141503Z-gpu0-1)", file=sys.stderr)
        return 2
    if bool(args.dir) == bool(args.url):
        print("llm-health incident: give --dir DIR (the restarter's incidents.dir) or --url URL (the restarter)", file=sys.stderr)
        return 2
    try:
        token = read_token(args.token_file, args.token_env) if args.url else ""
        if args.action == "list":
            if args.dir:
                from ..restarter.incident_api import listing
                from ..restarter.incidents import IncidentStore

                if not Path(args.dir).is_dir():
                    raise NotFound(f"{args.dir}: no such directory")
                items = listing(IncidentStore(Incidents(dir=args.dir)))
            else:
                items = json.loads(_get(args.url.rstrip("/") + "/incidents", token))["incidents"]
            for i in items:
                print(f"{i['id']}  {i['backend']}  {i['alertname']}  stacks {i['stacks']}  failures {i['failures'] or 'none'}")
            return 0
        index, files = _from_dir(args.dir, args.id) if args.dir else _from_api(args.url, token, args.id)
    except ConfigError as exc:
        print(f"llm-health incident: {exc}", file=sys.stderr)
        return 2
    except NotFound as exc:
        print(f"llm-health incident: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(index, indent=1))
    else:
        print(summary(index, files, top=args.frames))
    return 0


def add(sub: Any) -> None:
    p = sub.add_parser("incident", help="show the incident records the restarter kept before its restarts")
    p.add_argument("action", choices=("show", "list"))
    p.add_argument("id", nargs="?", help="the incident's id (GET /incidents, the restarter's log line)")
    p.add_argument("--dir", help="the restarter's incidents.dir")
    p.add_argument("--url", help="the restarter, e.g. http://127.0.0.1:9120")
    p.add_argument("--token-file", help="the restarter's bearer token (with --url)")
    p.add_argument("--token-env", default=TOKEN_ENV, help="environment variable holding the token when no file is given")
    p.add_argument("--frames", type=int, default=5, help="top frames shown per thread (default 5)")
    p.add_argument("--json", action="store_true", help="print the index as JSON")
    p.set_defaults(func=cmd)
