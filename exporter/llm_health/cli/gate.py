"""`llm-health gate`: the age-first admission gate (needs the `gate` extra)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..config.errors import ConfigError
from ..config.gate import GateConfig, parse_gate_config
from ..config.load import load_yaml
from ..config.web import WebConfig, load_web_config
from .common import add_server


def load_configs(args: argparse.Namespace) -> tuple[GateConfig, WebConfig] | None:
    """The gate file and the web config of `gate` and `decide`; None (reported) if bad."""
    try:
        return parse_gate_config(load_yaml(args.config_file), args.config_file), load_web_config(args.web_config_file)
    except ConfigError as exc:
        print(f"llm-health: bad config: {exc}", file=sys.stderr)
        return None


def cmd(args: argparse.Namespace) -> int:
    if (loaded := load_configs(args)) is None:
        return 2
    cfg, web_config = loaded
    from ..gate.app import Gate, tune_gc  # the `gate` extra: redis and uvloop
    from ..web import run_app

    host, port = args.web_listen_address
    gate = Gate(cfg, config_file=args.config_file)
    tune_gc()
    run_app(
        gate.app(web_config), host, port, ssl_context=web_config.ssl_context, handler_cancellation=True
    )  # a client that disconnects cancels its upstream request
    return 0


def add(sub: Any) -> None:
    g = add_server(sub, "gate", "the age-first admission gate: a reverse proxy in front of OpenAI-compatible backends")
    g.set_defaults(func=cmd)
