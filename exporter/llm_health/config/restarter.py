"""The restarter's YAML configuration (`llm-health restarter`), parsed once into typed
values; and its bearer token.

```yaml
restarter:
  budget: {max_restarts: 3, window: 1h, cooldown: 5m, backoff: 2}
  verify: {interval: 10s, hung_after_seconds: 60, no_output_after_seconds: 120}   # the full check, when there is no evidence
  confirm_interval: 1s        # between the two reads that confirm an alert's evidence
  raw_alert_hold: 45s         # a VLLMEngineHung waits this long for the exporter's LLMBackendHung
  output_dir: /var/lib/llm-health/restarter   # restart commands' output files
  incidents: {dir: /var/lib/llm-health/incidents, keep: 50}   # config.capture
redis:                        # optional: budget, cooldown, de-duplication shared and kept
  url: redis://127.0.0.1:6379/0
backends:
  - name: gpu0                       # the `backend` label of LLMBackendHung
    url: http://10.0.0.5:8000
    instance: 10.0.0.5:8000          # the `instance` label of VLLMEngineHung (default: host:port of url)
    restart: [systemctl, restart, vllm@gpu0]     # an argv, run without a shell
    restart_timeout: 2m
    drain_command: [/usr/local/bin/lb-drain, gpu0]  # optional: run before the restart, same rules
    drain_timeout: 5s
    capture: {pid_file: /run/vllm/gpu0.pid, budget: 10s}   # stacks before the restart (config.capture)
```
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..core import kinds, timing
from ..core.health import Settings
from ..core.restart_policy import Budget
from .capture import Capture, Incidents, parse_capture, parse_incidents
from .errors import ConfigError
from .fields import Section
from .load import load_yaml
from .redis import redis_url

log = logging.getLogger("llm_health.restarter")

TOKEN_ENV = "LLM_HEALTH_RESTARTER_TOKEN"
DRAIN_TIMEOUT = 5.0  # seconds: a drain holds a proven hang's restart no longer than this (and 1 s to kill it)
MAX_DRAIN_TIMEOUT = 60.0


@dataclass(frozen=True)
class Verify:
    """The re-verification: `llm-health check` with these settings."""

    interval: float = timing.INTERVAL_S
    hung_after_seconds: float = timing.HUNG_AFTER_S
    no_output_after_seconds: float = Settings.no_output_after_seconds
    probe_timeout: float = timing.PROBE_TIMEOUT_S
    metrics_timeout: float = timing.METRICS_TIMEOUT_S
    rounds: int | None = None  # None: enough for hung_after_seconds, as `check` does

    def rounds_settings(self) -> dict[str, Any]:
        """`probe.check.check_with`'s round settings (its own argument names)."""
        return {"interval": self.interval, "rounds": self.rounds, "hung_after": self.hung_after_seconds, "no_output_after": self.no_output_after_seconds}


@dataclass(frozen=True)
class Target:
    """One backend the restarter may act on."""

    name: str
    url: str
    instance: str = ""
    kind: str = kinds.ENGINE
    restart: tuple[str, ...] = ()
    restart_timeout: float = 120.0
    api_key: str | None = field(default=None, repr=False)  # never printed
    drain_command: tuple[str, ...] = ()  # run once a restart is decided, before it (restarter.drain)
    drain_timeout: float = DRAIN_TIMEOUT
    capture: Capture = field(default_factory=Capture)  # the evidence read before a restart


@dataclass(frozen=True)
class SharedState:
    """`redis:`: where replicas of the restarter share (and a restarted one finds again)
    budgets, cooldowns, alerts acted on and the one action per backend."""

    url: str = field(default="redis://127.0.0.1:6379/0", repr=False)  # may hold a password
    key_prefix: str = "llm-health:restarter:"
    lease_ttl: float = 30.0  # the per-backend action lease, renewed while the action runs
    timeout: float = 5.0


@dataclass(frozen=True)
class RestarterConfig:
    targets: tuple[Target, ...]
    budget: Budget = field(default_factory=Budget)
    verify: Verify = field(default_factory=Verify)
    confirm_interval: float = 1.0
    raw_alert_hold: float = 45.0  # 0: act on VLLMEngineHung at once (no exporter layer)
    recovery_timeout: float = 600.0
    recovery_interval: float = 1.0
    kill_grace: float = 5.0  # SIGTERM to SIGKILL when a restart command passes its timeout
    max_output_bytes: int = 16384  # the tail of a restart command's output kept
    output_dir: str | None = None  # None: a private directory under the system's temp dir
    max_output_file_bytes: int = 16 * 1024 * 1024
    history: int = 100  # recent actions and refusals shown on /status
    redis: SharedState | None = None
    incidents: Incidents = field(default_factory=Incidents)
    source: str = "<config>"


def default_instance(url: str) -> str:
    """host:port of a URL, as Prometheus writes the `instance` label of a scraped target."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


def parse_config(data: object, where: str = "<config>") -> RestarterConfig:
    top = Section(data, where)
    section = top.section("restarter")

    b = section.section("budget")
    d = Budget()
    budget = Budget(
        max_restarts=b.integer("max_restarts", d.max_restarts),
        window=b.duration("window", d.window, maximum=30 * 86400.0),
        cooldown=b.duration("cooldown", d.cooldown, maximum=30 * 86400.0),
        backoff=b.number("backoff", d.backoff, minimum=1, maximum=100),
    )
    b.done()

    v = section.section("verify")
    dv = Verify()
    verify = Verify(
        interval=v.duration("interval", dv.interval),
        hung_after_seconds=v.duration("hung_after_seconds", dv.hung_after_seconds),
        no_output_after_seconds=v.duration("no_output_after_seconds", dv.no_output_after_seconds),
        probe_timeout=v.duration("probe_timeout", dv.probe_timeout),
        metrics_timeout=v.duration("metrics_timeout", dv.metrics_timeout),
        rounds=v.integer("rounds", None, minimum=3, maximum=10_000),
    )
    v.done()

    defaults = RestarterConfig(targets=())
    confirm_interval = section.duration("confirm_interval", defaults.confirm_interval, minimum=0.05, maximum=60.0)
    raw_alert_hold = section.duration("raw_alert_hold", defaults.raw_alert_hold, maximum=3600.0, zero=True)
    recovery_timeout = section.duration("recovery_timeout", defaults.recovery_timeout)
    recovery_interval = section.duration("recovery_interval", defaults.recovery_interval, minimum=0.05)
    kill_grace = section.duration("kill_grace", defaults.kill_grace)
    max_output = section.integer("max_output_bytes", defaults.max_output_bytes, maximum=16 * 1024 * 1024)
    output_dir = section.string("output_dir", None)
    max_output_file = section.integer("max_output_file_bytes", defaults.max_output_file_bytes, minimum=max_output, maximum=1 << 40)
    history = section.integer("history", defaults.history, maximum=100_000)
    incidents = parse_incidents(section)
    section.done()

    shared = None
    if "redis" in top:
        r = top.section("redis")
        ds = SharedState()
        shared = SharedState(
            url=redis_url(r, "url", ds.url),
            key_prefix=r.string("key_prefix", ds.key_prefix),
            lease_ttl=r.duration("lease_ttl", ds.lease_ttl, minimum=1.0, maximum=3600.0),
            timeout=r.duration("timeout", ds.timeout, minimum=0.1, maximum=600.0),
        )
        r.done()

    if not isinstance(top.raw("backends"), list) or not top.raw("backends"):
        raise top.error("backends", "expected a non-empty list of backends (name, url, restart)")
    targets: list[Target] = []
    names: set[str] = set()
    instances: dict[str, str] = {}
    for entry in top.items("backends"):
        name = entry.string("name")
        url = entry.url("url")
        if name in names:
            raise entry.error("name", f"duplicate backend name {name!r}")
        names.add(name)
        kind = kinds.normalize(entry.choice("kind", kinds.ACCEPTED, kinds.ENGINE))
        instance = entry.string("instance", None) or default_instance(url)
        if instance in instances:
            raise entry.error("instance", f"{instance!r} is also backend {instances[instance]!r}: a VLLMEngineHung alert could not tell them apart")
        instances[instance] = name
        restart: tuple[str, ...] = ()
        drain: tuple[str, ...] = ()
        if kind == "proxy":
            for key in ("restart", "drain_command", "drain_timeout"):
                if key in entry:
                    raise entry.error(key, "a proxy is never restarted (restart its backends): remove this key")
        else:
            if "restart" not in entry:
                raise entry.error("restart", "missing: the argv that restarts this backend, e.g. [systemctl, restart, vllm@gpu0]")
            restart = entry.argv("restart")
            if "drain_command" in entry:
                drain = entry.argv("drain_command")
            elif "drain_timeout" in entry:
                raise entry.error("drain_timeout", "set, but there is no drain_command to time: add one or remove this key")
        restart_timeout = entry.duration("restart_timeout", 120.0)
        drain_timeout = entry.duration("drain_timeout", DRAIN_TIMEOUT, maximum=MAX_DRAIN_TIMEOUT) if drain else DRAIN_TIMEOUT
        api_key = entry.secret("api_key")
        capture = parse_capture(entry) if kind != "proxy" else Capture(enabled=False)
        entry.done()
        targets.append(Target(name, url, instance, kind, restart, restart_timeout, api_key, drain, drain_timeout, capture=capture))
    top.done()
    return RestarterConfig(
        targets=tuple(targets),
        budget=budget,
        verify=verify,
        confirm_interval=confirm_interval,
        raw_alert_hold=raw_alert_hold,
        recovery_timeout=recovery_timeout,
        recovery_interval=recovery_interval,
        kill_grace=kill_grace,
        max_output_bytes=max_output,
        output_dir=output_dir,
        max_output_file_bytes=max_output_file,
        history=history,
        redis=shared,
        incidents=incidents,
        source=where,
    )


def load_config(path: str | os.PathLike[str]) -> RestarterConfig:
    return parse_config(load_yaml(path), str(path))


def read_token(token_file: str | None, token_env: str = TOKEN_ENV) -> str:
    """The bearer token from a file or an environment variable; never echoed."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(token_file, "(token file)", f"cannot read: {exc.strerror}") from None
        if not token:
            raise ConfigError(token_file, "(token file)", "is empty")
        with contextlib.suppress(OSError):
            if Path(token_file).stat().st_mode & 0o007:
                log.warning("token file %s is readable by every user: chmod o-rwx it", token_file)
        return token
    token = (os.environ.get(token_env) or "").strip()
    if not token:
        raise ConfigError("(environment)", token_env, "not set or empty: give --web.token-file FILE or set this variable")
    return token
