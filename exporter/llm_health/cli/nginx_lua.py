"""`llm-health nginx-lua`: the files an nginx with its Lua module needs to decide by itself
(gate/nginx_lua.py): the door's module and its plan, compiled from the gate's
configuration file, written to a directory on nginx's `lua_package_path`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from ..config.errors import ConfigError
from ..config.gate import parse_gate_config
from ..config.load import load_yaml


def cmd(args: argparse.Namespace) -> int:
    from ..gate.nginx_lua import MODULE, PLAN, PlanError, module_source, plan, render

    try:
        cfg = parse_gate_config(load_yaml(args.config_file), args.config_file)
        text = render(cfg)
        secret = plan(cfg)["redis"]["password"] is not None
    except (ConfigError, PlanError) as exc:
        print(f"llm-health: bad config: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MODULE).write_text(module_source())
        # The plan holds gate.redis' password where it has one: nginx's master (root) reads it.
        fd = os.open(out / PLAN, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
        os.fchmod(fd, 0o600 if secret else 0o644)  # a plan written before without a password keeps no wider mode
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError as exc:
        print(f"llm-health: cannot write {out}: {exc}", file=sys.stderr)
        return 2
    print(f'wrote {out / MODULE} and {out / PLAN} ({len(cfg.routes)} routes); nginx: lua_package_path "{out}/?.lua;;"')
    return 0


def add(sub: Any) -> None:
    d = sub.add_parser("nginx-lua", help="the nginx Lua door: its module and its plan from the gate's configuration file")
    d.add_argument("--config.file", dest="config_file", required=True, help="the gate's configuration file (routes, admission, redis)")
    d.add_argument("--out", required=True, help="the directory to write llm_health.lua and llm_health_plan.lua to (nginx's lua_package_path)")
    d.set_defaults(func=cmd)
