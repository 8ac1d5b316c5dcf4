"""`llm-health decide`: the admission decision as an endpoint for nginx `auth_request` and
Envoy `ext_authz` (needs the `gate` extra; the same configuration file as the gate)."""

from __future__ import annotations

import argparse
from typing import Any

from .common import add_server, listen_address
from .gate import load_configs


def cmd(args: argparse.Namespace) -> int:
    if (loaded := load_configs(args)) is None:
        return 2
    cfg, web_config = loaded
    from ..gate import fast_doors
    from ..gate.app import tune_gc  # the `gate` extra: redis
    from ..gate.doors import Doors
    from ..web import run_app

    host, port = args.web_listen_address
    doors = Doors(cfg, config_file=args.config_file)
    app = doors.app(web_config, syslog=args.syslog_listen_address)
    tune_gc()
    if web_config.users or web_config.headers:  # basic auth and the configured headers guard the doors too: aiohttp's middleware
        run_app(app, host, port, ssl_context=web_config.ssl_context)
    else:  # the door requests on the fast path (gate.fast_doors), the rest on aiohttp
        fast_doors.run(doors, app, host, port, ssl_context=web_config.ssl_context)
    return 0


def add(sub: Any) -> None:
    d = add_server(
        sub, "decide", "the admission decision as an endpoint: nginx auth_request, Envoy ext_authz", "the gate's configuration file (routes, admission, redis)"
    )
    d.add_argument(
        "--syslog.listen-address",
        dest="syslog_listen_address",
        type=listen_address,
        default=None,
        help="UDP HOST:PORT for nginx's `access_log syslog:` reports of each attempt's end (off by default)",
    )
    d.set_defaults(func=cmd)
