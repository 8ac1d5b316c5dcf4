"""`llm-health restarter`: the restart authority, an Alertmanager webhook receiver.

```
Alertmanager ──POST /alerts (webhook v4, Bearer token)──▶ validate ──▶ admit (Policy: pure) ──▶ 202
                                                                         │ background task
         re-verify: `llm-health check`'s own code (cli.run_check) ◀──────┘
              │ still `hung`?  no: refuse `not_hung`
              ▼
         claim the budget (Policy: window, cooldown, backoff) ── spent: refuse, budget_exhausted 1
              ▼
         restart argv (no shell; own process group; killed at its timeout; output kept)
              ▼
         wait for the backend: `restarted`, then `idle` or `busy` (BackendMonitor rounds)
```

Acts only on `LLMBackendHung` (matched on its `backend` label) and `VLLMEngineHung`
(matched on `instance`). Alertmanager delivers at least once and times webhooks out, so
the request is answered as soon as the body is validated and de-duplicated; the work
runs in the background and its progress is on `/status`.

The decision core (`Policy`, `budget_verdict`, `parse_webhook`, `fingerprint`) is pure:
no I/O, time passed in. The I/O around it (`Restarter`: HTTP, the check, the subprocess)
is thin. Routes: `POST /alerts` and `GET /status` (bearer token), `/metrics`,
`/-/healthy`, a landing page.

Series (a per-app registry, rendered from counters with no I/O at scrape time):
`llm_restarter_restarts_total{backend,outcome}` (outcome: recovered, not_recovered,
failed, timeout, error, dry_run), `llm_restarter_refusals_total{reason}`,
`llm_restarter_recovery_seconds{backend}` (last), `llm_restarter_budget_exhausted{backend}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .errors import ConfigError

log = logging.getLogger("llm_health.restarter")

ACTED_ON = ("LLMBackendHung", "VLLMEngineHung")
REFUSALS = ("not_hung", "budget_spent", "cooldown", "duplicate", "unauthorised", "unknown_backend", "malformed", "proxy", "resolved")
OUTCOMES = ("recovered", "not_recovered", "failed", "timeout", "error", "dry_run")
TOKEN_ENV = "LLM_HEALTH_RESTARTER_TOKEN"
WEBHOOK_VERSION = "4"
KEY_TTL = 24 * 3600.0  # how long an acted-on (fingerprint, startsAt) is remembered
MAX_KEYS = 10000
MAX_BODY = 1024 * 1024
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# --- configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """At most `max_restarts` per backend within `window`; after the k-th restart in the
    window the next one waits `cooldown * backoff**(k-1)` from the end of the last."""

    max_restarts: int = 3
    window: float = 3600.0
    cooldown: float = 300.0
    backoff: float = 2.0


@dataclass(frozen=True)
class Verify:
    """The re-verification: `llm-health check` with these settings."""

    interval: float = 10.0
    hung_after_seconds: float = 20.0
    probe_timeout: float = 5.0
    metrics_timeout: float = 30.0
    rounds: int | None = None  # None: enough for hung_after_seconds, as `check` does


@dataclass(frozen=True)
class Target:
    """One backend the restarter may act on."""

    name: str
    url: str
    instance: str = ""
    kind: str = "vllm"
    restart: tuple[str, ...] = ()
    restart_timeout: float = 120.0
    api_key: str | None = field(default=None, repr=False)  # never printed


@dataclass(frozen=True)
class RestarterConfig:
    targets: tuple[Target, ...]
    budget: Budget = Budget()
    verify: Verify = Verify()
    recovery_timeout: float = 600.0
    recovery_interval: float | None = None  # None: verify.interval
    kill_grace: float = 5.0  # SIGTERM to SIGKILL when a restart command passes its timeout
    max_output_bytes: int = 16384  # the tail of a restart command's output kept
    history: int = 100  # recent actions and refusals shown on /status
    source: str = "<config>"


_RESTARTER_KEYS = ("budget", "verify", "recovery_timeout", "recovery_interval", "kill_grace", "max_output_bytes", "history")
_BACKEND_KEYS = ("name", "url", "instance", "kind", "restart", "restart_timeout", "api_key_env", "api_key_file")


def _mapping(value, where, key) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(where, key, f"expected a mapping, got {type(value).__name__}")
    return value


def _no_unknown(section: dict, allowed, where, prefix) -> None:
    bad = sorted(set(section) - set(allowed))
    if bad:
        raise ConfigError(where, f"{prefix}{bad[0]}", f"unknown key (expected one of {', '.join(allowed)})")


def _positive_int(value, where, key) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(where, key, f"expected a positive integer, got {value!r}")
    return value


def _argv(value, where, key) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ConfigError(where, key, f"expected a list (an argv, run without a shell), e.g. [systemctl, restart, vllm@gpu0], got the string {value!r}")
    if not isinstance(value, list) or not value:
        raise ConfigError(where, key, "expected a non-empty list (an argv), e.g. [systemctl, restart, vllm@gpu0]")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, str | int | float) or str(item) == "":
            raise ConfigError(where, f"{key}[{i}]", f"expected a non-empty string, got {item!r}")
        out.append(str(item))
    return tuple(out)


def default_instance(url: str) -> str:
    """host:port of a URL, as Prometheus writes the `instance` label of a scraped target."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


def parse_config(data, where: str = "<config>") -> RestarterConfig:
    # The exporter's duration and read_api_key: one spelling of both.
    from . import config as exporter_config

    duration = exporter_config.duration
    data = _mapping(data, where, "(top level)")
    _no_unknown(data, ("restarter", "backends"), where, "")
    section = _mapping(data.get("restarter"), where, "restarter")
    _no_unknown(section, _RESTARTER_KEYS, where, "restarter.")

    raw_budget = _mapping(section.get("budget"), where, "restarter.budget")
    _no_unknown(raw_budget, ("max_restarts", "window", "cooldown", "backoff"), where, "restarter.budget.")
    b = Budget()
    max_restarts = _positive_int(raw_budget.get("max_restarts", b.max_restarts), where, "restarter.budget.max_restarts")
    window = duration(raw_budget.get("window", b.window), where, "restarter.budget.window")
    cooldown = duration(raw_budget.get("cooldown", b.cooldown), where, "restarter.budget.cooldown")
    backoff = raw_budget.get("backoff", b.backoff)
    if isinstance(backoff, bool) or not isinstance(backoff, int | float) or not 1 <= backoff < math.inf:
        raise ConfigError(where, "restarter.budget.backoff", f"expected a number >= 1 (the cooldown's growth per restart), got {backoff!r}")
    budget = Budget(max_restarts, window, cooldown, float(backoff))

    raw_verify = _mapping(section.get("verify"), where, "restarter.verify")
    _no_unknown(raw_verify, ("interval", "hung_after_seconds", "probe_timeout", "metrics_timeout", "rounds"), where, "restarter.verify.")
    v = Verify()
    verify = Verify(
        interval=duration(raw_verify.get("interval", v.interval), where, "restarter.verify.interval"),
        hung_after_seconds=duration(raw_verify.get("hung_after_seconds", v.hung_after_seconds), where, "restarter.verify.hung_after_seconds"),
        probe_timeout=duration(raw_verify.get("probe_timeout", v.probe_timeout), where, "restarter.verify.probe_timeout"),
        metrics_timeout=duration(raw_verify.get("metrics_timeout", v.metrics_timeout), where, "restarter.verify.metrics_timeout"),
        rounds=_positive_int(raw_verify["rounds"], where, "restarter.verify.rounds") if raw_verify.get("rounds") is not None else None,
    )
    if verify.rounds is not None and verify.rounds < 3:
        raise ConfigError(where, "restarter.verify.rounds", f"at least 3 (a first reading, then two rounds without progress), got {verify.rounds}")

    defaults = RestarterConfig(targets=())
    recovery_timeout = duration(section.get("recovery_timeout", defaults.recovery_timeout), where, "restarter.recovery_timeout")
    recovery_interval = (
        duration(section["recovery_interval"], where, "restarter.recovery_interval") if section.get("recovery_interval") is not None else None
    )
    kill_grace = duration(section.get("kill_grace", defaults.kill_grace), where, "restarter.kill_grace")
    max_output = _positive_int(section.get("max_output_bytes", defaults.max_output_bytes), where, "restarter.max_output_bytes")
    history = _positive_int(section.get("history", defaults.history), where, "restarter.history")

    raw = data.get("backends")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(where, "backends", "expected a non-empty list of backends (name, url, restart)")
    targets: list[Target] = []
    names: set[str] = set()
    instances: dict[str, str] = {}
    for i, entry in enumerate(raw):
        prefix = f"backends[{i}]."
        if not isinstance(entry, dict):
            raise ConfigError(where, f"backends[{i}]", "expected a mapping with name, url and restart")
        _no_unknown(entry, _BACKEND_KEYS, where, prefix)
        for key in ("name", "url"):
            if not entry.get(key):
                raise ConfigError(where, f"{prefix}{key}", "missing")
        name, url = str(entry["name"]), str(entry["url"]).strip()
        if name in names:
            raise ConfigError(where, f"{prefix}name", f"duplicate backend name {name!r}")
        names.add(name)
        if not url.startswith(("http://", "https://")) or not urlsplit(url).hostname:
            raise ConfigError(where, f"{prefix}url", f"{url!r} is not an http(s) URL")
        kind = entry.get("kind", "vllm")
        if kind not in ("vllm", "proxy"):
            raise ConfigError(where, f"{prefix}kind", f"{kind!r}: expected one of vllm, proxy")
        instance = str(entry.get("instance") or default_instance(url))
        if instance in instances:
            raise ConfigError(where, f"{prefix}instance", f"{instance!r} is also backend {instances[instance]!r}: a VLLMEngineHung alert could not tell them apart")
        instances[instance] = name
        if kind == "proxy":
            if "restart" in entry:
                raise ConfigError(where, f"{prefix}restart", "a proxy is never restarted (restart its backends): remove this key")
            restart: tuple[str, ...] = ()
        else:
            if "restart" not in entry:
                raise ConfigError(where, f"{prefix}restart", "missing: the argv that restarts this backend, e.g. [systemctl, restart, vllm@gpu0]")
            restart = _argv(entry["restart"], where, f"{prefix}restart")
        restart_timeout = duration(entry.get("restart_timeout", 120.0), where, f"{prefix}restart_timeout")
        api_key = exporter_config.read_api_key(entry, where, prefix)
        targets.append(Target(name, url, instance, kind, restart, restart_timeout, api_key))
    return RestarterConfig(
        targets=tuple(targets),
        budget=budget,
        verify=verify,
        recovery_timeout=recovery_timeout,
        recovery_interval=recovery_interval,
        kill_grace=kill_grace,
        max_output_bytes=max_output,
        history=history,
        source=where,
    )


def load_config(path: str | os.PathLike) -> RestarterConfig:
    from .config import load_yaml

    return parse_config(load_yaml(path), str(path))


# --- the webhook body (pure) ------------------------------------------------------------


class Malformed(ValueError):
    """The body is not an Alertmanager webhook (version 4) we can act on."""


def fingerprint(labels: dict[str, str]) -> str:
    """Alertmanager's fingerprint of a label set (FNV-1a 64 over sorted name, 0xff, value,
    0xff), for bodies from versions that did not send one: the same key either way."""
    h = 14695981039346656037
    for name in sorted(labels):
        for part in (name.encode(), b"\xff", labels[name].encode(), b"\xff"):
            for byte in part:
                h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


@dataclass(frozen=True)
class Alert:
    alertname: str
    status: str  # firing or resolved
    labels: dict[str, str]
    starts_at: str
    fingerprint: str

    @property
    def key(self) -> tuple[str, str]:
        """Idempotency key: one alert instance (a re-fired alert has a new startsAt)."""
        return (self.fingerprint, self.starts_at)


@dataclass(frozen=True)
class Webhook:
    receiver: str
    status: str
    alerts: tuple[Alert, ...]
    truncated_alerts: int = 0


def parse_webhook(body: bytes | str) -> Webhook:
    """Validate a webhook body completely before anything acts on any of it."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Malformed(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise Malformed(f"expected a JSON object, got {type(data).__name__}")
    version = data.get("version")
    if version != WEBHOOK_VERSION:
        raise Malformed(f"webhook version {version!r}: expected {WEBHOOK_VERSION!r}")
    group_status = data.get("status")
    if group_status not in ("firing", "resolved"):
        raise Malformed(f"status {group_status!r}: expected firing or resolved")
    raw = data.get("alerts")
    if not isinstance(raw, list) or not raw:
        raise Malformed("alerts: expected a non-empty list")
    alerts = []
    for i, a in enumerate(raw):
        if not isinstance(a, dict):
            raise Malformed(f"alerts[{i}]: expected an object")
        labels = a.get("labels")
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise Malformed(f"alerts[{i}].labels: expected an object of strings")
        if not labels.get("alertname"):
            raise Malformed(f"alerts[{i}].labels.alertname: missing")
        starts_at = a.get("startsAt")
        if not isinstance(starts_at, str) or not starts_at:
            raise Malformed(f"alerts[{i}].startsAt: missing")
        status = a.get("status", group_status)  # older bodies carry only the group's status
        if status not in ("firing", "resolved"):
            raise Malformed(f"alerts[{i}].status {status!r}: expected firing or resolved")
        fp = a.get("fingerprint")
        if fp is not None and (not isinstance(fp, str) or not fp):
            raise Malformed(f"alerts[{i}].fingerprint: expected a non-empty string")
        alerts.append(Alert(labels["alertname"], status, dict(labels), starts_at, fp or fingerprint(labels)))
    truncated = data.get("truncatedAlerts", 0)
    return Webhook(str(data.get("receiver", "")), group_status, tuple(alerts), truncated if isinstance(truncated, int) else 0)


# --- the decision core (pure) -----------------------------------------------------------


@dataclass
class RestartRecord:
    started: float
    ended: float | None = None


def budget_verdict(budget: Budget, restarts: Sequence[RestartRecord], now: float) -> tuple[str | None, float]:
    """(None, 0) if a restart may run now, else (`budget_spent` or `cooldown`, seconds to wait).

    Restarts count against the budget from when they started; the cooldown runs from when
    the last one ended (a restart that takes 10 minutes to reload weights does not use up
    its own cooldown) and grows by `backoff` with each restart still in the window."""
    recent = [r for r in restarts if now - r.started < budget.window]
    if len(recent) >= budget.max_restarts:
        return "budget_spent", min(r.started for r in recent) + budget.window - now
    if recent:
        last = max(recent, key=lambda r: r.started)
        gap = budget.cooldown * budget.backoff ** (len(recent) - 1)
        wait = (last.ended if last.ended is not None else last.started) + gap - now
        if wait > 0:
            return "cooldown", wait
    return None, 0.0


@dataclass(frozen=True)
class Admission:
    alert: Alert
    decision: str  # "accepted", "ignored" (not an alert this receiver acts on), or a refusal reason
    backend: str | None = None
    detail: str = ""


class Policy:
    """Which alerts to act on, idempotency, and the restart budget. Pure: time is passed in.

    * only firing `LLMBackendHung` (by `backend`) and `VLLMEngineHung` (by `instance`) for a
      configured backend of kind vllm are accepted;
    * one action per backend at a time: any alert for a backend being acted on is a
      duplicate (two engines of one server, or both alerts for the same hang);
    * a (fingerprint, startsAt) that led to a restart (or a dry-run one) is a duplicate for
      `KEY_TTL`; one that was refused (not hung, cooldown, budget) is judged again when
      Alertmanager repeats it;
    * `claim` spends the budget (`budget_verdict`); refused for `budget_spent`, the backend
      is `exhausted` until the window has room again.
    """

    def __init__(self, targets: Sequence[Target], budget: Budget, key_ttl: float = KEY_TTL, max_keys: int = MAX_KEYS):
        self.targets = {t.name: t for t in targets}
        self.by_instance = {t.instance: t for t in targets}
        self.budget = budget
        self.key_ttl = key_ttl
        self.max_keys = max_keys
        self.done: OrderedDict[tuple[str, str], float] = OrderedDict()  # key -> when acted on
        self.in_flight: dict[str, tuple[str, str]] = {}  # backend -> key being acted on
        self.restarts: dict[str, list[RestartRecord]] = {t.name: [] for t in targets}
        self._exhausted: set[str] = set()

    def target_for(self, alert: Alert) -> Target | None:
        if alert.alertname == "LLMBackendHung":
            return self.targets.get(alert.labels.get("backend", ""))
        if alert.alertname == "VLLMEngineHung":
            return self.by_instance.get(alert.labels.get("instance", ""))
        return None

    def _prune(self, now: float) -> None:
        while self.done and (len(self.done) > self.max_keys or now - next(iter(self.done.values())) > self.key_ttl):
            self.done.popitem(last=False)

    def admit(self, alert: Alert, now: float) -> Admission:
        self._prune(now)
        if alert.alertname not in ACTED_ON:
            return Admission(alert, "ignored", None, f"{alert.alertname} is not an alert the restarter acts on")
        if alert.status != "firing":
            return Admission(alert, "resolved", None, "resolved alerts are not acted on")
        target = self.target_for(alert)
        if target is None:
            label = "backend" if alert.alertname == "LLMBackendHung" else "instance"
            return Admission(alert, "unknown_backend", None, f"no configured backend with {label}={alert.labels.get(label, '')!r}")
        if target.kind == "proxy":
            return Admission(alert, "proxy", target.name, "a proxy is never restarted: its backends are checked and restarted directly")
        if alert.key in self.done:
            return Admission(alert, "duplicate", target.name, "this alert (fingerprint, startsAt) was already acted on")
        if target.name in self.in_flight:
            same = self.in_flight[target.name] == alert.key
            why = "this alert is being acted on" if same else "another alert for this backend is being acted on"
            return Admission(alert, "duplicate", target.name, why)
        self.in_flight[target.name] = alert.key
        return Admission(alert, "accepted", target.name)

    def verdict(self, backend: str, now: float) -> tuple[str | None, float]:
        return budget_verdict(self.budget, self.restarts[backend], now)

    def claim(self, backend: str, now: float) -> tuple[str | None, float]:
        """Spend one restart of the budget if it allows one now; else the refusal."""
        refusal, wait = self.verdict(backend, now)
        if refusal == "budget_spent":
            self._exhausted.add(backend)
        if refusal:
            return refusal, wait
        self._exhausted.discard(backend)
        self.restarts[backend].append(RestartRecord(now))
        # Records older than the window never count again.
        self.restarts[backend] = [r for r in self.restarts[backend] if now - r.started < self.budget.window]
        return None, 0.0

    def finish(self, backend: str, key: tuple[str, str], restarted: bool, now: float) -> None:
        """The action for `key` ended; `restarted`: a restart ran (or would have, dry run)."""
        if self.in_flight.get(backend) == key:
            del self.in_flight[backend]
        if restarted:
            self.done[key] = now
            self.done.move_to_end(key)
            records = self.restarts[backend]
            if records and records[-1].ended is None:
                records[-1].ended = now

    def exhausted(self, backend: str, now: float) -> bool:
        """A verified hang was refused for budget and the window still has no room."""
        return backend in self._exhausted and self.verdict(backend, now)[0] == "budget_spent"

    def restarts_in_window(self, backend: str, now: float) -> int:
        return sum(1 for r in self.restarts[backend] if now - r.started < self.budget.window)


# --- running a restart command ----------------------------------------------------------


@dataclass
class CommandResult:
    outcome: str  # ok, failed, timeout, error
    exit_code: int | None
    pid: int | None
    output: str
    output_bytes: int  # all the command wrote; `output` is its tail
    truncated: bool
    seconds: float
    detail: str = ""


class _Tail:
    def __init__(self, limit: int):
        self.limit = limit
        self.buf = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def run_command(
    argv: Sequence[str], timeout: float, kill_grace: float = 5.0, max_output_bytes: int = 16384, env: dict[str, str] | None = None
) -> CommandResult:
    """Run argv without a shell in its own process group; past `timeout`, SIGTERM the
    group, then SIGKILL it after `kill_grace`. stdout and stderr together, the tail kept."""
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True, env=env
        )
    except OSError as exc:
        return CommandResult("error", None, None, "", 0, False, time.monotonic() - start, f"cannot start {argv[0]!r}: {exc.strerror or exc}")
    tail = _Tail(max_output_bytes)

    async def pump() -> None:
        while chunk := await proc.stdout.read(65536):
            tail.add(chunk)

    reader = asyncio.create_task(pump())
    timed_out = False
    how = "SIGTERM"
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
            _killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), kill_grace)
            except TimeoutError:
                how = f"SIGTERM, then SIGKILL after {kill_grace:g}s"
            # Whatever is left of the group (the leader, or children that ignored SIGTERM).
            _killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    except asyncio.CancelledError:
        _killpg(proc.pid, signal.SIGKILL)
        reader.cancel()
        raise
    # A child that outlived the command may still hold the pipe: take what came, then stop.
    try:
        await asyncio.wait_for(reader, 1.0)
    except TimeoutError:
        pass
    seconds = time.monotonic() - start
    output = tail.buf.decode("utf-8", errors="replace")
    truncated = tail.total > len(tail.buf)
    if timed_out:
        return CommandResult("timeout", proc.returncode, proc.pid, output, tail.total, truncated, seconds, f"killed after {timeout:g}s ({how} to process group {proc.pid})")
    if proc.returncode != 0:
        return CommandResult("failed", proc.returncode, proc.pid, output, tail.total, truncated, seconds, f"exited {proc.returncode}")
    return CommandResult("ok", 0, proc.pid, output, tail.total, truncated, seconds, "exited 0")


# --- the receiver (I/O) -----------------------------------------------------------------


@dataclass
class Action:
    """One accepted alert and what became of it, for /status."""

    id: int
    backend: str
    alertname: str
    fingerprint: str
    starts_at: str
    received_at: float  # wall clock
    labels: dict[str, str]
    dry_run: bool = False
    phase: str = "queued"  # queued, verifying, restarting, recovering, done
    verification: dict | None = None
    refusal: str | None = None
    outcome: str | None = None
    detail: str = ""
    command: list[str] = field(default_factory=list)
    command_result: dict | None = None
    recovery_seconds: float | None = None
    recovery_state: str | None = None
    restart_seen: bool | None = None
    finished_at: float | None = None

    def status(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


Verifier = Callable[[Target], Awaitable[dict]]


class Restarter:
    def __init__(
        self,
        config: RestarterConfig,
        token: str,
        *,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
        verifier: Verifier | None = None,
        child_env: dict[str, str] | None = None,
        token_env: str = TOKEN_ENV,
    ):
        if not token:
            raise ValueError("the restarter needs a bearer token")
        self.config = config
        self.dry_run = dry_run
        self.clock = clock
        self.policy = Policy(config.targets, config.budget)
        self.verifier = verifier or self._check
        self._token_digest = hashlib.sha256(token.encode()).digest()
        env = dict(os.environ if child_env is None else child_env)
        env.pop(token_env, None)  # the token is never handed to a restart command
        self.child_env = env
        self.refusals = {r: 0 for r in REFUSALS}
        self.outcomes: dict[tuple[str, str], int] = {(t.name, o): 0 for t in config.targets if t.kind != "proxy" for o in OUTCOMES}
        self.recovery_seconds: dict[str, float] = {}
        self.actions: deque[Action] = deque(maxlen=config.history)
        self.refused: deque[dict] = deque(maxlen=config.history)
        self.tasks: set[asyncio.Task] = set()
        self._next_id = 1
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    # --- verification and recovery: the same code as `llm-health check` ------------------
    async def _check(self, target: Target) -> dict:
        from .cli import run_check

        v = self.config.verify
        return await run_check(
            target.url,
            kind=target.kind,
            interval=v.interval,
            rounds=v.rounds,
            hung_after=v.hung_after_seconds,
            probe_timeout=v.probe_timeout,
            metrics_timeout=v.metrics_timeout,
            api_key=target.api_key,
        )

    def _monitor(self, session, target: Target):
        from .client import BackendClient
        from .health import Settings
        from .monitor import BackendMonitor

        v = self.config.verify
        client = BackendClient(
            session, target.url, api_key=target.api_key, probe_timeout=v.probe_timeout, metrics_timeout=v.metrics_timeout, models_timeout=min(10.0, v.metrics_timeout)
        )
        # As in `check`, each idle round may probe: the recovery wait is short and ends at idle.
        return BackendMonitor(client, kind=target.kind, settings=Settings(hung_after_seconds=v.hung_after_seconds, probe_interval=0.0))

    # --- the background action ----------------------------------------------------------
    def _refuse(self, reason: str, detail: str = "", **about) -> None:
        self.refusals[reason] += 1
        if reason not in ("unauthorised", "malformed"):
            self.refused.appendleft({"reason": reason, "detail": detail, "at": time.time(), **about})

    async def _act(self, action: Action, target: Target, key: tuple[str, str]) -> None:
        restarted = False
        try:
            action.phase = "verifying"
            try:
                result = await self.verifier(target)
            except Exception as exc:  # noqa: BLE001 - no verdict is not a hung verdict
                log.exception("%s: re-verification failed", target.name)
                result = {"state": "unknown", "reason": f"re-verification failed: {type(exc).__name__}: {exc}"}
            action.verification = {
                k: result.get(k) for k in ("state", "reason", "running", "waiting", "rounds", "probes_sent", "steps_per_second", "generation_tokens_per_second")
            }
            if result.get("state") != "hung":
                action.refusal = "not_hung"
                action.detail = f"re-verified {result.get('state')}: {result.get('reason')}"
                self._refuse("not_hung", action.detail, backend=target.name, action=action.id)
                log.info("%s: %s not acted on: %s", target.name, action.alertname, action.detail)
                return
            refusal, wait = self.policy.claim(target.name, self.clock())
            if refusal:
                action.refusal = refusal
                done = self.policy.restarts_in_window(target.name, self.clock())
                if refusal == "budget_spent":
                    action.detail = (
                        f"hung, but {done} restarts in the last {self.config.budget.window:g}s spent the budget "
                        f"({self.config.budget.max_restarts}); not restarting (llm_restarter_budget_exhausted 1), room again in {wait:.0f}s"
                    )
                    log.warning("%s: %s", target.name, action.detail)
                else:
                    action.detail = f"hung, but in cooldown after the last restart: {wait:.0f}s left"
                    log.info("%s: %s", target.name, action.detail)
                self._refuse(refusal, action.detail, backend=target.name, action=action.id)
                return
            restarted = True
            action.command = list(target.restart)
            if self.dry_run:
                action.outcome = "dry_run"
                action.detail = (
                    f"dry run: would run {list(target.restart)} (no shell, timeout {target.restart_timeout:g}s), "
                    f"then wait up to {self.config.recovery_timeout:g}s for the backend to come back"
                )
                log.info("%s: %s", target.name, action.detail)
                return
            await self._restart(action, target)
        except asyncio.CancelledError:
            action.outcome = action.outcome or ("error" if restarted else None)
            action.detail = action.detail or "cancelled (the restarter is stopping)"
            raise
        except Exception as exc:  # noqa: BLE001 - reported on /status and in the counter
            log.exception("%s: action failed", target.name)
            action.detail = f"{type(exc).__name__}: {exc}"
            if restarted:
                action.outcome = "error"
            else:
                action.refusal = "not_hung"
                self._refuse("not_hung", action.detail, backend=target.name, action=action.id)
        finally:
            if action.outcome:
                self.outcomes[(target.name, action.outcome)] = self.outcomes.get((target.name, action.outcome), 0) + 1
            self.policy.finish(target.name, key, restarted, self.clock())
            action.phase = "done"
            action.finished_at = time.time()

    async def _restart(self, action: Action, target: Target) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            monitor = self._monitor(session, target)
            # A baseline of the old process, so its successor shows as `restarted`.
            await monitor.round()
            action.phase = "restarting"
            log.warning("%s: restarting: %s (timeout %gs)", target.name, list(target.restart), target.restart_timeout)
            started = time.monotonic()
            env = {**self.child_env, "LLM_HEALTH_BACKEND": target.name, "LLM_HEALTH_BACKEND_URL": target.url}
            result = await run_command(target.restart, target.restart_timeout, self.config.kill_grace, self.config.max_output_bytes, env)
            action.command_result = {
                "outcome": result.outcome,
                "exit_code": result.exit_code,
                "pid": result.pid,
                "seconds": round(result.seconds, 3),
                "output": result.output,
                "output_bytes": result.output_bytes,
                "output_truncated": result.truncated,
                "detail": result.detail,
            }
            if result.outcome != "ok":
                action.outcome = result.outcome
                action.detail = f"restart command {result.detail}"
                log.error("%s: restart command %s; output tail: %s", target.name, result.detail, result.output[-2000:])
                return
            action.phase = "recovering"
            interval = self.config.recovery_interval or self.config.verify.interval
            deadline = time.monotonic() + self.config.recovery_timeout
            seen = False
            state, reason = None, ""
            while True:
                verdict = await monitor.round()
                state, reason = verdict.state, verdict.reason
                seen = seen or state in ("restarted", "down")
                if state in ("idle", "busy"):
                    action.recovery_seconds = time.monotonic() - started
                    break
                if time.monotonic() + interval > deadline:
                    break
                await asyncio.sleep(interval)
            action.recovery_state, action.restart_seen = state, seen
            if action.recovery_seconds is not None:
                action.outcome = "recovered"
                self.recovery_seconds[target.name] = action.recovery_seconds
                action.detail = f"back {state} {action.recovery_seconds:.1f}s after the restart began" + ("" if seen else " (no new process seen: the engine moved again)")
                log.info("%s: %s", target.name, action.detail)
            else:
                action.outcome = "not_recovered"
                action.detail = f"not back after {self.config.recovery_timeout:g}s: last {state} ({reason})"
                log.error("%s: %s", target.name, action.detail)

    # --- HTTP -----------------------------------------------------------------------------
    def authorised(self, request) -> bool:
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        # Digests of equal length: the comparison leaks neither the token nor its length.
        offered = hashlib.sha256(credentials.strip().encode()).digest()
        return hmac.compare_digest(offered, self._token_digest) and scheme.lower() == "bearer"

    def _unauthorised(self, request):
        from aiohttp import web

        self._refuse("unauthorised")
        log.warning("refused %s %s from %s: missing or wrong bearer token", request.method, request.path, request.remote)
        return web.json_response({"error": "unauthorised"}, status=401, headers={"WWW-Authenticate": 'Bearer realm="llm-health restarter"'})

    async def handle_alerts(self, request):
        from aiohttp import web

        if not self.authorised(request):
            return self._unauthorised(request)
        try:
            webhook = parse_webhook(await request.read())
        except Malformed as exc:
            self._refuse("malformed")
            log.warning("refused a webhook body: %s", exc)
            return web.json_response({"error": f"malformed webhook: {exc}"}, status=400)
        if webhook.truncated_alerts:
            log.warning("Alertmanager truncated %d alerts from this notification (max_alerts)", webhook.truncated_alerts)
        now = self.clock()
        answers = []
        accepted = 0
        for alert in webhook.alerts:
            adm = self.policy.admit(alert, now)
            answer = {"alertname": alert.alertname, "fingerprint": alert.fingerprint, "startsAt": alert.starts_at, "backend": adm.backend, "decision": adm.decision}
            if adm.detail:
                answer["detail"] = adm.detail
            if adm.decision == "accepted":
                accepted += 1
                target = self.policy.targets[adm.backend]
                action = Action(self._next_id, target.name, alert.alertname, alert.fingerprint, alert.starts_at, time.time(), alert.labels, dry_run=self.dry_run)
                self._next_id += 1
                self.actions.appendleft(action)
                answer["action"] = action.id
                log.info("%s: %s (fingerprint %s, startsAt %s) accepted as action %d; re-verifying", target.name, alert.alertname, alert.fingerprint, alert.starts_at, action.id)
                task = asyncio.create_task(self._act(action, target, alert.key), name=f"restarter-{target.name}-{action.id}")
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif adm.decision == "ignored":
                log.info("ignored %s: %s", alert.alertname, adm.detail)
            else:
                self._refuse(adm.decision, adm.detail, backend=adm.backend, alertname=alert.alertname, fingerprint=alert.fingerprint, startsAt=alert.starts_at)
                log.info("%s (fingerprint %s) refused: %s: %s", alert.alertname, alert.fingerprint, adm.decision, adm.detail)
            answers.append(answer)
        # 2xx is success to Alertmanager; 202 says the work goes on in the background.
        return web.json_response({"accepted": accepted, "alerts": answers, "dry_run": self.dry_run}, status=202 if accepted else 200)

    def status(self) -> dict:
        now = self.clock()
        backends = []
        for t in self.config.targets:
            entry = {"backend": t.name, "url": t.url, "instance": t.instance, "kind": t.kind}
            if t.kind != "proxy":
                refusal, wait = self.policy.verdict(t.name, now)
                entry.update(
                    restart=list(t.restart),
                    restart_timeout=t.restart_timeout,
                    restarts_in_window=self.policy.restarts_in_window(t.name, now),
                    next_restart_allowed_in=round(wait, 3),
                    budget=refusal or "ok",
                    budget_exhausted=self.policy.exhausted(t.name, now),
                    in_progress=next((a.id for a in self.actions if a.backend == t.name and a.phase != "done"), None),
                    last_recovery_seconds=self.recovery_seconds.get(t.name),
                )
            backends.append(entry)
        b = self.config.budget
        return {
            "dry_run": self.dry_run,
            "budget": {"max_restarts": b.max_restarts, "window": b.window, "cooldown": b.cooldown, "backoff": b.backoff},
            "backends": backends,
            "actions": [a.status() for a in self.actions],
            "refused": list(self.refused),
            "refusals": dict(self.refusals),
        }

    async def handle_status(self, request):
        from aiohttp import web

        if not self.authorised(request):
            return self._unauthorised(request)
        return web.json_response(self.status(), dumps=lambda o: json.dumps(o, default=str))

    async def handle_metrics(self, request):
        from aiohttp import web
        from prometheus_client import generate_latest

        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE})

    async def handle_healthy(self, request):
        from aiohttp import web

        return web.Response(text="OK\n")

    async def handle_index(self, request):
        from aiohttp import web

        return web.Response(
            text="llm-health restarter: POST /alerts (Alertmanager webhook v4, bearer token), GET /status (bearer token), /metrics, /-/healthy\n"
        )

    async def stop(self) -> None:
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/", self.handle_index)
        app.router.add_post("/alerts", self.handle_alerts)
        app.router.add_get("/status", self.handle_status)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/-/healthy", self.handle_healthy)

        async def on_cleanup(_app):
            await self.stop()

        app.on_cleanup.append(on_cleanup)
        return app


class _Collector:
    """Rendered from the restarter's counters and the budget at the current time; no I/O."""

    def __init__(self, restarter: Restarter):
        self.r = restarter

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r = self.r
        now = r.clock()
        restarts = CounterMetricFamily(
            "llm_restarter_restarts",
            "Restarts run after a re-verified hang, by outcome (recovered, not_recovered, failed, timeout, error, dry_run).",
            labels=["backend", "outcome"],
        )
        for (backend, outcome), n in sorted(r.outcomes.items()):
            restarts.add_metric([backend, outcome], n)
        refusals = CounterMetricFamily(
            "llm_restarter_refusals", "Alerts or requests the restarter did not act on, by reason.", labels=["reason"]
        )
        for reason in REFUSALS:
            refusals.add_metric([reason], r.refusals[reason])
        recovery = GaugeMetricFamily(
            "llm_restarter_recovery_seconds", "Seconds from the start of the last restart until the backend was idle or busy again.", labels=["backend"]
        )
        for backend, seconds in sorted(r.recovery_seconds.items()):
            recovery.add_metric([backend], seconds)
        exhausted = GaugeMetricFamily(
            "llm_restarter_budget_exhausted",
            "1 while a re-verified hang was refused because the backend's restart budget is spent (the restarter stopped restarting it).",
            labels=["backend"],
        )
        for t in r.config.targets:
            if t.kind != "proxy":
                exhausted.add_metric([t.name], 1.0 if r.policy.exhausted(t.name, now) else 0.0)
        return [restarts, refusals, recovery, exhausted]


# --- the command ------------------------------------------------------------------------


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


def serve(config_file: str, listen: tuple[str, int], token_file: str | None = None, token_env: str = TOKEN_ENV, dry_run: bool = False) -> int:

    try:
        cfg = load_config(config_file)
        token = read_token(token_file, token_env)
    except ConfigError as exc:
        print(f"llm-health restarter: {exc}", file=sys.stderr)
        return 2
    restarter = Restarter(cfg, token, dry_run=dry_run, token_env=token_env)
    host, port = listen
    log.info(
        "restarter listening on %s:%d for %d backends%s; webhook path /alerts",
        host, port, len(cfg.targets), " (DRY RUN: restart commands are only reported)" if dry_run else "",
    )
    from .cli import run_app

    run_app(restarter.app(), host, port)
    return 0
