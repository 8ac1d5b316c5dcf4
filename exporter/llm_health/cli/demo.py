"""`llm-health demo`: a simulated fleet on loopback, the exporter on it, a live table."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ..sim.demo import run_demo
from .common import add_log_level, listen_address, positive_seconds


def cmd(args: argparse.Namespace) -> int:
    return asyncio.run(run_demo(duration=args.duration, listen=args.web_listen_address, interval=args.interval))


def add(sub: Any) -> None:
    d = sub.add_parser("demo", help="a simulated fleet on loopback, the exporter on it, a live state table")
    d.add_argument("--duration", type=float, default=60.0, help="seconds to run (0: until interrupted)")
    d.add_argument("--interval", type=positive_seconds, default=2.0, help="exporter round interval")
    d.add_argument("--web.listen-address", dest="web_listen_address", type=listen_address, default=listen_address("127.0.0.1:9118"))
    add_log_level(d)
    d.set_defaults(func=cmd)
