"""One accepted alert and what became of it; the restart itself and the wait for the
backend to come back.

Once the restart is decided, in this order: drain (restarter.drain), restart, recovery."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ..config.restarter import RestarterConfig, Target
from ..core.health import Settings, Verdict
from ..core.states import State
from ..probe.client import BackendClient
from ..probe.monitor import BackendMonitor
from .drain import drain, result_record
from .runner import OutputFiles, run_command

log = logging.getLogger("llm_health.restarter")


@dataclass
class Action:
    """One accepted alert and what became of it, for /status. Times are wall clock (Unix s)."""

    id: int
    backend: str
    alertname: str
    fingerprint: str
    starts_at: str
    received_at: float
    labels: dict[str, str]
    dry_run: bool = False
    phase: str = "queued"  # queued, holding, verifying, draining, restarting, recovering, done
    evidence: str | None = None  # where the evidence came from: this alert, or handed over by another
    verification: dict[str, Any] | None = None
    refusal: str | None = None
    outcome: str | None = None
    detail: str = ""
    command: list[str] = field(default_factory=list)
    command_result: dict[str, Any] | None = None
    drain_command: list[str] = field(default_factory=list)
    drain_result: dict[str, Any] | None = None  # the drain command's, as command_result
    drain_started_at: float | None = None
    recovery_seconds: float | None = None
    recovery_state: str | None = None
    restart_seen: bool | None = None
    verified_at: float | None = None
    command_started_at: float | None = None
    command_ended_at: float | None = None
    recovered_at: float | None = None
    finished_at: float | None = None
    evidence_annotation: str | None = None  # the evidence confirmed (this alert's, or handed over)
    incident: str | None = None  # the incident record's id (restarter.incidents), once written
    capture_seconds: float | None = None
    reads: list[dict[str, Any]] = field(default_factory=list, repr=False)  # the confirming reads, for the record

    def status(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "reads"}
        if self.incident:
            out["incident_url"] = f"/incidents/{self.incident}"
        return out


def client_for(session: aiohttp.ClientSession, target: Target, config: RestarterConfig) -> BackendClient:
    """A client for the backend with the `verify` timeouts: the confirming reads and the recovery wait."""
    v = config.verify
    return BackendClient(
        session,
        target.url,
        api_key=target.api_key,
        probe_timeout=v.probe_timeout,
        metrics_timeout=v.metrics_timeout,
        models_timeout=min(10.0, v.metrics_timeout),
    )


def monitor_for(session: aiohttp.ClientSession, target: Target, config: RestarterConfig) -> BackendMonitor:
    # As in `check`, each idle round may probe: the recovery wait is short and ends at idle.
    v = config.verify
    settings = Settings(hung_after_seconds=v.hung_after_seconds, probe_interval=0.0, no_output_after_seconds=v.no_output_after_seconds)
    return BackendMonitor(client_for(session, target, config), kind=target.kind, settings=settings)


Capture = Callable[[Verdict], Awaitable[None]]


async def restart_and_recover(
    action: Action, target: Target, config: RestarterConfig, env: dict[str, str], outputs: OutputFiles, capture: Capture | None = None
) -> None:
    """Drain the backend, keep the evidence, run the restart command, then read the backend
    every `recovery_interval` until it is idle or busy again (or `recovery_timeout`). Fills
    in the action. `capture`: the incident record's evidence, read after the baseline and
    before the restart (bounded by its own budget; it never raises)."""
    # 1. Drain: the target's drain_command, bounded by drain_timeout; the restart goes on whatever it did.
    if target.drain_command:
        action.phase = "draining"
        action.drain_command = list(target.drain_command)
        action.drain_started_at = time.time()
        action.drain_result = await drain(target, action.id, config, env, outputs)
    async with aiohttp.ClientSession() as session:
        monitor = monitor_for(session, target, config)
        # A baseline of the old process, so its successor shows as `restarted`.
        baseline = await monitor.round()
        # 2. Evidence: the stacks and the record, before the restart destroys them ----------
        if capture is not None:
            action.phase = "capturing"
            await capture(baseline)
        # ------------------------------------------------------------------------------------
        action.phase = "restarting"
        log.warning("%s: restarting: %s (timeout %gs)", target.name, list(target.restart), target.restart_timeout)
        started = time.monotonic()
        action.command_started_at = time.time()
        output_file = outputs.new(target.name, action.id)
        result = await run_command(target.restart, target.restart_timeout, output_file, config.kill_grace, config.max_output_bytes, env)
        action.command_ended_at = time.time()
        action.command_result = result_record(result)
        if result.outcome != "ok":
            action.outcome = result.outcome
            action.detail = f"restart command {result.detail}"
            log.error("%s: restart command %s; output tail: %s", target.name, result.detail, result.output[-2000:])
            return
        action.phase = "recovering"
        interval = config.recovery_interval
        deadline = started + config.recovery_timeout
        seen = False
        state, reason = None, ""
        while True:
            verdict = await monitor.round()
            state, reason = verdict.state, verdict.reason
            seen = seen or state in (State.RESTARTED, State.DOWN)
            if state in (State.IDLE, State.BUSY):
                action.recovery_seconds = round(time.monotonic() - started, 3)
                action.recovered_at = time.time()
                break
            if time.monotonic() + interval > deadline:
                break
            await asyncio.sleep(interval)
        action.recovery_state, action.restart_seen = state, seen
        if action.recovery_seconds is not None:
            action.outcome = "recovered"
            action.detail = f"back {state} {action.recovery_seconds:.1f}s after the restart began" + (
                "" if seen else " (no new process seen: the engine moved again)"
            )
            log.info("%s: %s", target.name, action.detail)
        else:
            action.outcome = "not_recovered"
            action.detail = f"not back after {config.recovery_timeout:g}s: last {state} ({reason})"
            log.error("%s: %s", target.name, action.detail)
