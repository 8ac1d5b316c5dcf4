"""The `llm-health` command: the parser, and one module per subcommand.

llm-health check URL [--kind engine|proxy] [--json] ...   one verdict, for watchdogs
llm-health serve --config.file FILE                      the Prometheus exporter
llm-health config check FILE                              validate a config
llm-health gate --config.file FILE                       the age-first admission gate
llm-health decide --config.file FILE                     its decision for nginx auth_request / Envoy ext_authz
llm-health nginx-lua --config.file FILE --out DIR        the nginx Lua door's module and plan
llm-health restarter --config.file FILE                  the Alertmanager webhook receiver
llm-health incident show ID --dir DIR                    an incident record the restarter kept
llm-health drill retry|watchdog                          the drills
llm-health demo                                           a simulated fleet, live
"""

from __future__ import annotations

import sys

from .. import __version__
from ..core.states import ExitCode
from . import check, decide, demo, drill, gate, incident, nginx_lua, restarter, serve
from .common import Parser, add_log_level, setup_logging


def parser() -> Parser:
    p = Parser(prog="llm-health", description="Tell busy from hung LLM inference servers from the engine's own counters.")
    p.add_argument("--version", action="version", version=f"llm-health {__version__}")
    add_log_level(p, default="info")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in (check, serve, gate, decide, nginx_lua, drill, demo, restarter, incident):
        module.add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        # A flag no subcommand knows: `check`'s usage errors exit 4, never a verdict.
        p.usage_error_code = ExitCode.CANNOT_RUN if args.command == "check" else 2
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    setup_logging(args.log_level)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
