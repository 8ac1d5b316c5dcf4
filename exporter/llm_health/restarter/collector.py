"""The restarter's series, rendered from its counters and the budget at the current
time; no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ..collector_base import SnapshotCollector
from ..config.restarter import RestarterConfig
from ..core.restart_policy import REFUSALS

DRAIN_OUTCOMES = ("ok", "failed", "timeout", "error")


class Exhausted(Protocol):
    def exhausted(self, backend: str) -> bool: ...


class Counts(Protocol):
    """What the collector reads of the restarter."""

    @property
    def config(self) -> RestarterConfig: ...
    @property
    def state(self) -> Exhausted: ...
    @property
    def outcomes(self) -> Mapping[tuple[str, str], int]: ...
    @property
    def refusals(self) -> Mapping[str, int]: ...
    @property
    def recovery_seconds(self) -> Mapping[str, float]: ...
    @property
    def drains(self) -> Mapping[tuple[str, str], int]: ...
    @property
    def unread_alerts(self) -> int: ...
    @property
    def incident_counts(self) -> Mapping[str, int]: ...
    @property
    def capture_failures(self) -> Mapping[str, int]: ...


class RestarterCollector(SnapshotCollector):
    """Rendered from the restarter's counters and the budget at the current time; no I/O."""

    def __init__(self, restarter: Counts):
        self.r = restarter

    def families(self, describing: bool) -> list[Metric]:
        r = self.r
        restarts = CounterMetricFamily(
            "llm_restarter_restarts",
            "Restarts run after a re-verified hang, by outcome (recovered, not_recovered, failed, timeout, error, dry_run).",
            labels=["backend", "outcome"],
        )
        for (backend, outcome), n in sorted(r.outcomes.items()):
            restarts.add_metric([backend, outcome], n)
        refusals = CounterMetricFamily("llm_restarter_refusals", "Alerts or requests the restarter did not act on, by reason.", labels=["reason"])
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
                exhausted.add_metric([t.name], 1.0 if r.state.exhausted(t.name) else 0.0)
        drains = CounterMetricFamily(
            "llm_restarter_drains",
            "Drain commands run before a restart, by outcome (ok, failed, timeout, error: the restart went on in every case).",
            labels=["backend", "outcome"],
        )
        for t in r.config.targets:
            if t.drain_command:
                for outcome in DRAIN_OUTCOMES:
                    drains.add_metric([t.name, outcome], r.drains.get((t.name, outcome), 0))
        unread = CounterMetricFamily(
            "llm_restarter_unread_alerts",
            "Alerts of notifications of more than 1,000 alerts that were left unread: those the restarter does not act on, "
            "and any LLMBackendHung or VLLMEngineHung past the first 1,000 of them.",
        )
        unread.add_metric([], r.unread_alerts)
        incidents = CounterMetricFamily("llm_restarter_incidents", "Incident records written before a restart (restarter.incidents).", labels=["backend"])
        for backend, n in sorted(r.incident_counts.items()):
            incidents.add_metric([backend], n)
        failures = CounterMetricFamily(
            "llm_restarter_capture_failures",
            "What an incident's capture could not read, by reason (not_local, no_process, pid_lookup_failed, tool_missing, no_permission, traced, process_exited, timeout, budget_spent, failed).",
            labels=["reason"],
        )
        for reason, n in r.capture_failures.items():
            failures.add_metric([reason], n)
        return [restarts, refusals, recovery, exhausted, drains, unread, incidents, failures]
