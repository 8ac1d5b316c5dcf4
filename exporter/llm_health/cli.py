"""The `llm-health` command.

    llm-health check URL [--kind vllm|proxy] [--json] ...   one verdict, for watchdogs
    llm-health serve --config.file FILE                      the Prometheus exporter
    llm-health config check FILE                              validate a config
    llm-health demo                                           a simulated fleet, live
    llm-health restarter --config.file FILE                  the Alertmanager webhook receiver (docs/restarts.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time

from . import __version__
from .errors import ConfigError

API_KEY_ENV = "LLM_HEALTH_API_KEY"


def _listen(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise argparse.ArgumentTypeError(f"--web.listen-address must be HOST:PORT, got {address!r}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def run_app(app, host: str, port: int, **kw) -> None:
    """aiohttp's run_app on uvloop where it is installed (about a third less CPU per request)."""
    from aiohttp import web

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        loop = None
    else:
        loop = uvloop.new_event_loop()
    web.run_app(app, host=host, port=port, access_log=None, print=None, loop=loop, **kw)


def _positive(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not f > 0 or math.isinf(f):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return f


def _api_key(args) -> str | None:
    if getattr(args, "api_key_file", None):
        try:
            key = open(args.api_key_file).read().strip()
        except OSError as exc:
            raise SystemExit(f"llm-health: --api-key-file {args.api_key_file}: {exc.strerror}") from None
        return key or None
    return os.environ.get(args.api_key_env) or None


# --- check ------------------------------------------------------------------------------


def _final(state: str) -> bool:
    """States that end a check: nothing more to learn from another round."""
    return state in ("idle", "busy", "sleeping", "paused", "hung", "down", "restarted", "up", "no_metrics")


async def run_check(
    url: str,
    kind: str = "vllm",
    interval: float = 10.0,
    rounds: int | None = None,
    hung_after: float = 20.0,
    probe_timeout: float = 5.0,
    metrics_timeout: float = 30.0,
    api_key: str | None = None,
) -> dict:
    import aiohttp

    from .client import BackendClient
    from .health import Settings, exit_code
    from .monitor import BackendMonitor

    if rounds is None:
        # First reading, then two rounds without progress spanning at least hung_after.
        rounds = max(3, math.ceil(hung_after / interval) + 1)
    # In a check every idle round may probe: the check itself is the rate limit.
    settings = Settings(hung_after_seconds=hung_after, probe_interval=0.0)
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        client = BackendClient(
            session, url, api_key=api_key, probe_timeout=probe_timeout, metrics_timeout=metrics_timeout, models_timeout=min(10.0, metrics_timeout)
        )
        monitor = BackendMonitor(client, kind=kind, settings=settings)
        verdict = None
        for i in range(rounds):
            if i:
                await asyncio.sleep(interval)
            verdict = await monitor.round()
            if _final(verdict.state):
                break
    state = verdict.state
    return {
        "url": client.url,
        "kind": kind,
        "state": state,
        "reason": verdict.reason,
        "exit_code": exit_code(state),
        "running": verdict.running if verdict.engines else None,
        "waiting": verdict.waiting if verdict.engines else None,
        "steps_per_second": verdict.total("steps_per_second"),
        "generation_tokens_per_second": verdict.total("generation_tokens_per_second"),
        "probe_sent": monitor.probes_sent > 0,
        "probes_sent": monitor.probes_sent,
        "rounds": monitor.rounds,
        "seconds": round(time.monotonic() - started, 3),
        "profile": monitor.stats.profile,
        "engines": [
            {"model_name": e.model_name, "engine": e.engine, "state": e.state, "running": e.running, "waiting": e.waiting, "reason": e.reason}
            for e in verdict.engines
        ],
    }


def cmd_check(args) -> int:
    result = asyncio.run(
        run_check(
            args.url,
            kind=args.kind,
            interval=args.interval,
            rounds=args.rounds,
            hung_after=args.hung_after,
            probe_timeout=args.probe_timeout,
            metrics_timeout=args.metrics_timeout,
            api_key=_api_key(args),
        )
    )
    if args.json:
        print(json.dumps(result, default=lambda o: None))
    else:
        extra = ""
        if result["running"] is not None:
            extra = f" running={result['running']:g} waiting={result['waiting']:g}"
        if result["steps_per_second"] is not None:
            extra += f" steps/s={result['steps_per_second']:.1f}"
        print(f"{result['state']}: {result['reason']} ({result['url']}{extra}, probes sent {result['probes_sent']})")
    return result["exit_code"]


# --- serve, config check --------------------------------------------------------------


def cmd_serve(args) -> int:

    from . import config as config_mod
    from .exporter import Exporter

    try:
        cfg = config_mod.load(args.config_file)
        if cfg.redis is not None:
            from .redis_view import parse_redis_config

            parse_redis_config(cfg.redis, cfg.source)
    except ConfigError as exc:
        print(f"llm-health: bad config: {exc}", file=sys.stderr)
        return 2
    host, port = args.web_listen_address
    exporter = Exporter(cfg)
    logging.getLogger("llm_health").info("listening on %s:%d with %d backends", host, port, len(cfg.backends))
    run_app(exporter.app(), host, port)
    return 0


def cmd_config_check(args) -> int:
    from . import config as config_mod

    try:
        cfg = config_mod.load(args.file)
        if cfg.redis is not None:
            from .redis_view import parse_redis_config

            parse_redis_config(cfg.redis, cfg.source)
    except ConfigError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(f"SUCCESS: {args.file}: {len(cfg.backends)} backends" + (", redis section valid" if cfg.redis is not None else ""))
    return 0


def cmd_gate(args) -> int:

    from .config import load_yaml
    from .gate import Gate, parse_gate_config, tune_gc

    try:
        cfg = parse_gate_config(load_yaml(args.config_file), args.config_file)
    except ConfigError as exc:
        print(f"llm-health: bad config: {exc}", file=sys.stderr)
        return 2
    host, port = args.web_listen_address
    gate = Gate(cfg)
    tune_gc()
    run_app(gate.app(), host, port, handler_cancellation=True)  # a client that disconnects cancels its upstream request
    return 0


def cmd_drill(args) -> int:
    from .drills import cmd_drill as run

    return run(args)


def cmd_demo(args) -> int:
    from .demo import run_demo

    return asyncio.run(run_demo(duration=args.duration, listen=args.web_listen_address, interval=args.interval))


def cmd_restarter(args) -> int:
    from . import restarter

    return restarter.serve(args.config_file, args.web_listen_address, token_file=args.token_file, token_env=args.token_env, dry_run=args.dry_run)


# --- parser ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-health", description="Tell busy from hung LLM inference servers from the engine's own counters.")
    p.add_argument("--version", action="version", version=f"llm-health {__version__}")
    p.add_argument("--log.level", dest="log_level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="one verdict for a watchdog: exit 0 healthy, 1 hung, 2 down, 3 undetermined")
    c.add_argument("url", help="the server's base URL (a trailing /v1 is accepted)")
    c.add_argument("--kind", choices=["vllm", "proxy"], default="vllm", help="proxy: checked through /v1/models only")
    c.add_argument("--interval", type=_positive, default=10.0, help="seconds between reads (default 10)")
    c.add_argument("--rounds", type=int, default=None, help="most reads to take (default: enough for --hung-after)")
    c.add_argument("--hung-after", type=_positive, default=20.0, help="least seconds without progress before hung (default 20)")
    c.add_argument("--probe-timeout", type=_positive, default=5.0, help="timeout of the 1-token probe sent to an idle engine (default 5)")
    c.add_argument("--metrics-timeout", type=_positive, default=30.0, help="timeout of a /metrics read; slow is load, not death (default 30)")
    c.add_argument("--api-key-file", help="file holding the backend's API key")
    c.add_argument("--api-key-env", default=API_KEY_ENV, help=f"environment variable holding the API key (default {API_KEY_ENV})")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_check)

    s = sub.add_parser("serve", help="run the Prometheus exporter")
    s.add_argument("--config.file", dest="config_file", required=True)
    s.add_argument("--web.listen-address", dest="web_listen_address", type=_listen, default=_listen("127.0.0.1:9118"))
    s.set_defaults(func=cmd_serve)

    cfg = sub.add_parser("config", help="configuration tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    cc = cfg_sub.add_parser("check", help="validate a config file")
    cc.add_argument("file")
    cc.set_defaults(func=cmd_config_check)

    g = sub.add_parser("gate", help="the age-first admission gate: a reverse proxy in front of OpenAI-compatible backends")
    g.add_argument("--config.file", dest="config_file", required=True)
    g.add_argument("--web.listen-address", dest="web_listen_address", type=_listen, default=_listen("127.0.0.1:9119"))
    g.set_defaults(func=cmd_gate)

    dr = sub.add_parser("drill", help="the field reports' drills: retry (report 3), watchdog (report 1)")
    dr.add_argument("drill", choices=["retry", "watchdog"])
    dr.add_argument("--redis", help="Redis URL for the retry drill (default: a temporary redis-server)")
    dr.add_argument("--time-scale", type=_positive, default=1.0, help="retry drill: multiply the report's times (0.1 runs 10x faster)")
    dr.set_defaults(func=cmd_drill)

    d = sub.add_parser("demo", help="a simulated fleet on loopback, the exporter on it, a live state table")
    d.add_argument("--duration", type=float, default=60.0, help="seconds to run (0: until interrupted)")
    d.add_argument("--interval", type=_positive, default=2.0, help="exporter round interval")
    d.add_argument("--web.listen-address", dest="web_listen_address", type=_listen, default=_listen("127.0.0.1:9118"))
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("restarter", help="Alertmanager webhook receiver: re-verifies LLMBackendHung/VLLMEngineHung, restarts within a budget")
    r.add_argument("--config.file", dest="config_file", required=True, help="restarter YAML (docs/restarts.md)")
    r.add_argument("--web.listen-address", dest="web_listen_address", type=_listen, default=_listen("127.0.0.1:9120"))
    r.add_argument("--web.token-file", dest="token_file", help="file holding the bearer token Alertmanager sends (credentials_file)")
    r.add_argument("--web.token-env", dest="token_env", default="LLM_HEALTH_RESTARTER_TOKEN", help="environment variable holding the token when no file is given")
    r.add_argument("--dry-run", action="store_true", help="verify and report what would be restarted; run no restart command")
    r.set_defaults(func=cmd_restarter)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
