"""`llm-health demo`: the whole product on loopback (sim.demo), a live view, what it proved."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .common import add_log_level, listen_address, positive_seconds


def cmd(args: argparse.Namespace) -> int:
    from ..sim.demo import run_demo  # imports redis (the pool, the gate): `llm-health check` installs without it

    return asyncio.run(
        run_demo(duration=args.duration, listen=args.web_listen_address, interval=args.interval, view_every=args.view_every, until_proven=args.until_proven)
    )


def add(sub: Any) -> None:
    d = sub.add_parser(
        "demo",
        help="the whole product on loopback: a simulated fleet and the exporter, Redis leases, the gate, "
        "Prometheus, Alertmanager and the restarter (where installed); a live view, then what was proven",
    )
    d.add_argument("--duration", type=float, default=60.0, help="seconds to run (0: until interrupted)")
    d.add_argument("--interval", type=positive_seconds, default=1.0, help="exporter round interval")
    d.add_argument("--view-every", type=positive_seconds, default=None, help="seconds between views (default: every round on a terminal, 5 s otherwise)")
    d.add_argument("--until-proven", action="store_true", help="stop as soon as every line of the summary holds (at most --duration)")
    d.add_argument("--web.listen-address", dest="web_listen_address", type=listen_address, default=listen_address("127.0.0.1:9118"))
    add_log_level(d)
    d.set_defaults(func=cmd)
