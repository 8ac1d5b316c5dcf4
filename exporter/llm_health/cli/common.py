"""What the subcommands share: the parser class, flag types, logging."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any, NoReturn

from ..core.errors import LLMHealthError

LOG_LEVELS = ("debug", "info", "warning", "error")


class CliError(LLMHealthError):
    """The command-line room's branch of the error tree (core.errors)."""


class Parser(argparse.ArgumentParser):
    """argparse with a settable exit code for usage errors: `check` exits 4 ("cannot
    run") on a bad flag, because its 1 means "hung" and its 2 "down"."""

    usage_error_code = 2

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(self.usage_error_code, f"{self.prog}: error: {message}\n")


def listen_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"--web.listen-address must be HOST:PORT, got {address!r}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def positive_seconds(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not f > 0 or math.isinf(f):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return f


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value!r}")
    return n


def add_web_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--web.config.file",
        dest="web_config_file",
        help="TLS and basic auth, in the exporter-toolkit format (tls_server_config, basic_auth_users)",
    )


# Each server's own default port, all on 127.0.0.1 (README.md, "Commands").
DEFAULT_PORTS = {"serve": 9118, "gate": 9119, "restarter": 9120, "decide": 9122}


def add_server(sub: Any, name: str, help: str, config_help: str | None = None) -> argparse.ArgumentParser:
    """A server command's parser: its configuration file, its listen address (127.0.0.1 and
    its DEFAULT_PORTS port unless told), TLS and basic auth, its log level."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help)
    p.add_argument("--config.file", dest="config_file", required=True, help=config_help)
    p.add_argument("--web.listen-address", dest="web_listen_address", type=listen_address, default=listen_address(f"127.0.0.1:{DEFAULT_PORTS[name]}"))
    add_web_config(p)
    add_log_level(p)
    return p


def add_log_level(p: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """`--log.level`, before or after the subcommand (the subcommand's copy sets nothing
    unless given, so it never hides the top-level one)."""
    p.add_argument("--log.level", dest="log_level", default=default, choices=LOG_LEVELS, help="log verbosity (default info)")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
