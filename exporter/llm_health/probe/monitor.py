"""One backend's rounds: fetch, decide, and probe only when the engine is idle.

Shared by `llm-health check`, the exporter and the restarter, so all three reach the
same verdict from the same evidence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ..core import engines, kinds
from ..core.engines import Limits, OverLimits, UnknownEngine
from ..core.exposition import ParseError
from ..core.health import Memory, Observation, Settings, Verdict, after_probe, decide, same_fingerprint
from ..core.queue_age import QueueAges
from .client import BackendClient, Fetched, ProbeResult
from .pieces import read_fetched


@dataclass
class RoundStats:
    """What the last round cost and saw, for the exporter's own series."""

    metrics: Fetched | None = None
    probe: ProbeResult | None = None
    profile: str | None = None
    seconds: float = 0.0
    error: str | None = None  # the reason label of llm_exporter_round_errors_total: metrics, timeout, limits, models
    evidence: ProbeResult | None = None  # the profile's evidence endpoint, read this round (a suspected engine only)
    probes: dict[str, int] = field(default_factory=lambda: {"ok": 0, "timeout": 0, "error": 0})


class BackendMonitor:
    def __init__(self, client: BackendClient, kind: str = kinds.ENGINE, settings: Settings | None = None, limits: Limits | None = None):
        self.client = client
        self.kind = kinds.normalize(kind)
        self.settings = settings or Settings()
        self.limits = limits or Limits()
        self.memory: Memory | None = None
        self.model: str | None = None
        self.verdict: Verdict | None = None
        self.stats = RoundStats()
        self.rounds = 0
        self.probes_sent = 0
        # The engine's own refusals seen since this monitor started, by reason (the sum of
        # every round's `Verdict.refused`; a reason is listed once the engine's counter is
        # read, at 0 until it moves): what llm_backend_engine_refusals_total exports.
        self.refused_total: dict[str, float] = {}
        # Reads of the profile's evidence endpoint (`Profile.evidence_path`), by path and result
        # (ok, timeout, error): llm_backend_evidence_reads_total.
        self.evidence_reads: dict[tuple[str, str], int] = {}
        self.last_probe: ProbeResult | None = None  # kept across rounds: probes are minutes apart
        # The engine's queue age (core.queue_age), advanced by every round's reading.
        self.queue_ages = QueueAges()

    def _stalling(self, reading: engines.Reading) -> bool:
        """Some engine has work in flight and the same fingerprint as last round."""
        if not self.memory:
            return False
        for key, e in reading.engines.items():
            old = self.memory.engines.get(key)
            if e.in_flight and old is not None and same_fingerprint(old.fingerprint, e.fingerprint):
                return True
        return False

    async def _evidence(self, profile: engines.Profile, stats: RoundStats) -> ProbeResult | None:
        """Read the profile's evidence endpoint (`Profile.evidence_path`) of an engine already
        suspected (its /metrics timed out, or nothing moved with work in flight); None for
        a profile without one. Never called for an engine that moved."""
        if profile.evidence_path is None:
            return None
        result = await self.client.evidence(profile.evidence_path)
        key = (profile.evidence_path, result.result)
        self.evidence_reads[key] = self.evidence_reads.get(key, 0) + 1
        stats.evidence = result
        return result

    async def round(self, now: float | None = None) -> Verdict:
        start = time.monotonic()
        now = start if now is None else now
        stats = RoundStats(probes=self.stats.probes)
        if self.kind == "proxy":
            ok, _model, err = await self.client.models()
            obs = Observation(now=now, models_ok=ok, models_error=err)
            verdict = decide(self.memory, obs, self.settings, kind="proxy")
            stats.error = None if ok else "models"
        else:
            verdict = await self._engine_round(now, start, stats)
        stats.seconds = time.monotonic() - start
        for reason in verdict.memory.refusals or ():
            self.refused_total[reason] = self.refused_total.get(reason, 0.0) + verdict.refused.get(reason, 0.0)
        self.memory, self.verdict, self.stats = verdict.memory, verdict, stats
        self.rounds += 1
        return verdict

    async def _engine_round(self, now: float, start: float, stats: RoundStats) -> Verdict:
        fetched = await self.client.metrics()
        read_at = now + (time.monotonic() - start)  # the counters are no older than this
        read_wall = time.time()  # the same instant on the doors' clock (core.queue_age.door_age)
        stats.metrics = fetched
        reading = None
        error = fetched.error
        if fetched.parts is not None:
            try:
                reading = await read_fetched(fetched.parts, fetched.start_header, self.limits)
                stats.profile = reading.profile
            except OverLimits as exc:
                error, stats.error = f"/metrics over limits: {exc}", "limits"
            except (ParseError, UnknownEngine) as exc:
                error = f"/metrics unusable: {exc}"
        obs = Observation(now=now, reading=reading, metrics_error=error, metrics_timed_out=fetched.timed_out, metrics_refused=fetched.refused)
        if reading is None:
            known = engines.BY_NAME.get(self.memory.profile or "") if self.memory is not None else None
            if fetched.timed_out and known is not None and known.metrics_on_loop:
                # The engine serves /metrics from its inference loop's queue; its health
                # endpoint is answered beside it (/v1/models would wait on the same loop). The
                # profile is the memory's, the same that `decide` judges the timeout by.
                ok, model, merr = await self.client.health(known.health_path)
            else:
                ok, model, merr = await self.client.models()
            self.model = model or self.model
            # A refused connection is the backend down (or restarting); so is one closed
            # before a byte of the answer when the follow-up answered nothing either (a
            # server killed with the read in flight, as a restart does); and a 503 is its
            # own word that it cannot serve yet (a server loading its model after a restart
            # may answer /metrics and /health so): none is a failed round.
            evidence = await self._evidence(known, stats) if fetched.timed_out and known is not None else None
            gone = fetched.refused or (fetched.closed and not ok)
            if stats.error is None and not gone and not fetched.unavailable:
                stats.error = "timeout" if fetched.timed_out else "metrics"
            obs = Observation(
                now=now,
                metrics_error=error,
                metrics_timed_out=fetched.timed_out,
                metrics_refused=fetched.refused,
                models_ok=ok,
                models_error=merr,
                evidence=evidence.detail if evidence else None,
                evidence_timed_out=bool(evidence and evidence.timed_out),
            )
        elif self._stalling(reading):
            profile = engines.BY_NAME[reading.profile]
            # Before calling it stalled, ask whether the engine sleeps or is paused on purpose.
            sleeping = await self.client.flag(profile.sleep_path) if profile.sleep_path else False
            paused = await self.client.flag(profile.pause_path) if profile.pause_path else False
            evidence = await self._evidence(profile, stats)
            obs = Observation(
                now=now,
                reading=reading,
                sleeping=sleeping,
                paused=paused,
                evidence=evidence.detail if evidence else None,
                evidence_timed_out=bool(evidence and evidence.timed_out),
            )
        verdict = decide(self.memory, obs, self.settings, kind=self.kind)
        self.queue_ages.update(reading, read_at, restarted=verdict.restarted, wall=read_wall)
        if verdict.probe_wanted:
            models_error = None
            if self.model is None:
                _, self.model, models_error = await self.client.models()
            if self.model is None:
                # Nothing to address a probe to: no evidence either way, and nothing sent.
                result = ProbeResult(None, 0.0, f"cannot probe: /v1/models {models_error or 'listed no model'}")
            else:
                result = await self.client.probe(self.model)
                self.probes_sent += 1
                stats.probe = self.last_probe = result
                stats.probes[result.result] = stats.probes.get(result.result, 0) + 1
            if result.ok is None:
                memory = replace(verdict.memory, last_probe_at=now)
                verdict = replace(verdict, reason=f"{verdict.reason}; {result.detail}", memory=memory, probe_wanted=False)
            else:
                verdict = after_probe(verdict, result.ok, now, self.settings, result.detail)
        return verdict
