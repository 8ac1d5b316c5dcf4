"""`llm-health check URL`: one verdict for a watchdog, cron or systemd.

Its flags are kebab-case, like the Unix tools a watchdog script calls; the servers
(`serve`, `gate`, `restarter`) take Prometheus-style dotted flags. Exit codes: 0 healthy,
1 hung (restart warranted, and nothing else), 2 down, 3 undetermined, 4 cannot run (a
bad flag, an unreadable API key file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from ..core import kinds
from ..core.health import Settings
from ..core.states import ExitCode
from ..probe.check import run_check
from ..urls import BadTarget, parse_target
from .common import CliError, Parser, add_log_level, positive_int, positive_seconds

API_KEY_ENV = "LLM_HEALTH_API_KEY"


class CannotRun(CliError):
    """The check could not run: its exit code is 4, never a verdict."""


def api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key = f.read().strip()
        except OSError as exc:
            raise CannotRun(f"--api-key-file {args.api_key_file}: {exc.strerror}") from None
        if not key:
            raise CannotRun(f"--api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get(args.api_key_env) or None


def cmd(args: argparse.Namespace) -> int:
    try:
        key = api_key(args)
        url = parse_target(args.url, what="url")
    except (CannotRun, BadTarget) as exc:
        print(f"llm-health check: cannot run: {exc}", file=sys.stderr)
        return ExitCode.CANNOT_RUN
    result = asyncio.run(
        run_check(
            url,
            kind=kinds.normalize(args.kind),
            interval=args.interval,
            rounds=args.rounds,
            hung_after=args.hung_after,
            no_output_after=args.no_output_after,
            probe_timeout=args.probe_timeout,
            metrics_timeout=args.metrics_timeout,
            api_key=key,
        )
    )
    print(render(result, args.json))
    return int(result["exit_code"])


def render(result: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(result, default=lambda o: None)
    extra = ""
    if result["running"] is not None:
        extra = f" running={result['running']:g} waiting={result['waiting']:g}"
    if result["steps_per_second"] is not None:
        extra += f" steps/s={result['steps_per_second']:.1f}"
    return f"{result['state']}: {result['reason']} ({result['url']}{extra}, probes sent {result['probes_sent']})"


def add(sub: Any) -> None:
    c: Parser = sub.add_parser("check", help="one verdict for a watchdog: exit 0 healthy, 1 hung, 2 down, 3 undetermined, 4 cannot run")
    c.usage_error_code = ExitCode.CANNOT_RUN
    c.add_argument("url", help="the server's base URL (a trailing /v1 is accepted)")
    c.add_argument(
        "--kind",
        choices=list(kinds.ACCEPTED),
        default=kinds.ENGINE,
        help="engine: any engine with /metrics (detected; vllm is its old spelling); proxy: checked through /v1/models only",
    )
    c.add_argument("--interval", type=positive_seconds, default=10.0, help="seconds between reads (default 10)")
    c.add_argument("--rounds", type=positive_int, default=None, help="most reads to take (default: enough for --hung-after)")
    c.add_argument("--hung-after", type=positive_seconds, default=20.0, help="least seconds without progress before hung (default 20)")
    c.add_argument(
        "--no-output-after",
        type=positive_seconds,
        default=None,
        help="watch for a livelock: requests running with steps moving and no token or finished request for this long is hung "
        f"(e.g. {Settings.no_output_after_seconds:g}, the exporter's default; longer than any honest prefill takes); such an engine "
        "is then watched this long and a round before the check answers. Without it a busy read ends the check",
    )
    c.add_argument("--probe-timeout", type=positive_seconds, default=5.0, help="timeout of the 1-token probe sent to an idle engine (default 5)")
    c.add_argument("--metrics-timeout", type=positive_seconds, default=30.0, help="timeout of a /metrics read; slow is load, not death (default 30)")
    c.add_argument("--api-key-file", help="file holding the backend's API key")
    c.add_argument("--api-key-env", default=API_KEY_ENV, help=f"environment variable holding the API key (default {API_KEY_ENV})")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    add_log_level(c)
    c.set_defaults(func=cmd)
