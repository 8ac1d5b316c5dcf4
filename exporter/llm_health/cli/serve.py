"""`llm-health serve` (the exporter) and `llm-health config check FILE`."""

from __future__ import annotations

import argparse
import logging
import resource
import sys
from typing import Any

from ..config import exporter as exporter_config
from ..config.errors import ConfigError
from ..config.gate import parse_gate_config
from ..config.load import load_yaml
from ..config.restarter import parse_config as parse_restarter_config
from ..config.web import load_web_config
from .common import add_log_level, add_server

# Descriptors the exporter needs besides one connection per backend (listener, scrapes,
# /probe targets, Redis, logs).
FD_HEADROOM = 256


def raise_nofile(backends: int, log: logging.Logger) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit: each backend keeps a connection
    open (up to 4 during a round), and a soft limit of 1024 (systemd's and most shells'
    default) is past at about a thousand backends. Logged when raised; a warning when even
    the hard limit leaves less than one descriptor per backend plus headroom. (soft, hard)
    after the call."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the RLIMIT_NOFILE soft limit from %d to %d: %s", soft, hard, exc)
        else:
            log.info("raised the RLIMIT_NOFILE soft limit from %d to the hard limit %d", soft, hard)
            soft = hard
    wanted = backends + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "RLIMIT_NOFILE is %d, under the %d descriptors %d backends want: raise the hard limit (LimitNOFILE=, ulimit -Hn, the container's nofile)",
            soft,
            wanted,
            backends,
        )
    return soft, hard


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = exporter_config.load(args.config_file)
        web_config = load_web_config(args.web_config_file)
    except ConfigError as exc:
        print(f"llm-health: bad config: {exc}", file=sys.stderr)
        return 2
    # Imported once the config is good: a `redis:` section needs the `redis` extra.
    from ..exporter.app import Exporter
    from ..web import run_app

    host, port = args.web_listen_address
    exporter = Exporter(cfg, config_file=args.config_file)
    logging.getLogger("llm_health").info("listening on %s:%d with %d backends%s", host, port, len(cfg.watched()), _shard_note(cfg))
    run_app(exporter.app(web_config), host, port, ssl_context=web_config.ssl_context)
    return 0


def check_config(path: str) -> str:
    """What the file configures, or ConfigError. The kind is told by its top-level keys:
    `gate:` is the gate's, `restarter:` the restarter's, anything else the exporter's."""
    data = load_yaml(path)
    if isinstance(data, dict) and "gate" in data:
        gate = parse_gate_config(data, path)
        return f"gate config, {len(gate.routes)} routes"
    if isinstance(data, dict) and "restarter" in data:
        r = parse_restarter_config(data, path)
        return f"restarter config, {len(r.targets)} backends"
    cfg = exporter_config.parse(data, path)
    return f"{len(cfg.watched())} backends{_shard_note(cfg)}" + (", redis section valid" if cfg.redis is not None else "")


def _shard_note(cfg: exporter_config.Config) -> str:
    """` (shard 1/3 of 90 configured)` for a sharded replica, nothing otherwise."""
    return f" (shard {cfg.shard} of {len(cfg.backends)} configured)" if cfg.shard.total > 1 else ""


def cmd_config_check(args: argparse.Namespace) -> int:
    try:
        what = check_config(args.file)
    except ConfigError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"SUCCESS: {args.file}: {what}")
    return 0


def add(sub: Any) -> None:
    s = add_server(sub, "serve", "run the Prometheus exporter")
    s.set_defaults(func=cmd_serve)

    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    cc = cfg_sub.add_parser("check", help="validate a config file (exporter, gate or restarter, told by its top-level keys)")
    cc.add_argument("file")
    add_log_level(cc)
    cc.set_defaults(func=cmd_config_check)
