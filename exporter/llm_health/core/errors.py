"""The root of every exception llm-health raises on its own, and the core's branch of it.

httpx's shape: one root, a branch per room (`CoreError` here; `config.errors.ConfigError`,
`probe.fast_http.ProbeError`, `store.codes.StoreError`, `gate.headers.GateError`,
`cli.common.CliError`, `sim.launch.SimError`, `urls.BadTarget`). `except LLMHealthError`
catches what the package raises and nothing a library it calls raises unwrapped. A class
keeps the built-in base it had (ValueError, RuntimeError, redis-py's RedisError) beside
its branch, so a caller's older `except ValueError` still catches it.
tests/unit/test_errors.py holds every exception class of the package to this tree.
"""

from __future__ import annotations


class LLMHealthError(Exception):
    """The root: every exception llm-health raises on its own derives from it."""


class CoreError(LLMHealthError):
    """Input the pure core refuses: a payload, an annotation, a webhook, an allowlist entry."""
