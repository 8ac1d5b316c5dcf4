"""`llm-health restarter`: the Alertmanager webhook receiver that restarts only what is
proven hung (docs/restarts.md)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from ..config.errors import ConfigError
from ..config.restarter import TOKEN_ENV, load_config, read_token
from ..config.web import load_web_config
from .common import add_server

log = logging.getLogger("llm_health.restarter")


def cmd(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config_file)
        token = read_token(args.token_file, args.token_env)
        web_config = load_web_config(args.web_config_file)
    except ConfigError as exc:
        print(f"llm-health restarter: {exc}", file=sys.stderr)
        return 2
    from ..restarter.app import Restarter
    from ..web import run_app

    restarter = Restarter(cfg, token, dry_run=args.dry_run, token_env=args.token_env, config_file=args.config_file)
    host, port = args.web_listen_address
    log.info(
        "restarter listening on %s:%d for %d backends%s; webhook path /alerts",
        host,
        port,
        len(cfg.targets),
        " (DRY RUN: restart commands are only reported)" if args.dry_run else "",
    )
    run_app(restarter.app(web_config), host, port, ssl_context=web_config.ssl_context)
    return 0


def add(sub: Any) -> None:
    r = add_server(
        sub,
        "restarter",
        "Alertmanager webhook receiver: re-verifies LLMBackendHung/VLLMEngineHung, restarts within a budget",
        "restarter YAML (docs/restarts.md)",
    )
    r.add_argument("--web.token-file", dest="token_file", help="file holding the bearer token Alertmanager sends (credentials_file)")
    r.add_argument("--web.token-env", dest="token_env", default=TOKEN_ENV, help="environment variable holding the token when no file is given")
    r.add_argument("--dry-run", action="store_true", help="verify and report what would be restarted; run no restart command")
    r.set_defaults(func=cmd)
