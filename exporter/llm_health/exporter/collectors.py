"""The exporter's series, rendered from the backends' snapshots with no I/O."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from .. import __version__
from ..collector import SnapshotCollector
from ..core.states import State
from .slots import Slot

STATEFUL = " Derived by a background round every interval (stateful: two rounds tell stalled from hung), not at scrape time."


def backend_families(slots: Iterable[Slot]) -> list[Metric]:
    """Metric families for these slots, from their snapshots (no I/O)."""
    up = GaugeMetricFamily("llm_backend_up", "1 if the backend's /metrics or /v1/models answered in its last round.", labels=["backend"])
    state = GaugeMetricFamily("llm_backend_state", "Health state of the backend (its worst engine), one-hot." + STATEFUL, labels=["backend", "state"])
    estate = GaugeMetricFamily(
        "llm_backend_engine_state",
        "Health state per engine (data-parallel rank and model), one-hot." + STATEFUL,
        labels=["backend", "model_name", "engine", "state"],
    )
    elabels = ["backend", "model_name", "engine"]
    running = GaugeMetricFamily("llm_backend_requests_running", "Requests running in the engine, as the engine reports.", labels=elabels)
    waiting = GaugeMetricFamily("llm_backend_requests_waiting", "Requests waiting in the engine, as the engine reports.", labels=elabels)
    steps = GaugeMetricFamily("llm_backend_engine_steps_per_second", "Engine steps per second between the last two rounds." + STATEFUL, labels=elabels)
    tokens = GaugeMetricFamily(
        "llm_backend_generation_tokens_per_second", "Generated tokens per second between the last two rounds." + STATEFUL, labels=elabels
    )
    since = GaugeMetricFamily(
        "llm_backend_seconds_since_progress", "Seconds since the engine fingerprint last changed while work was in flight.", labels=elabels
    )
    digest = GaugeMetricFamily(
        "llm_backend_engine_progress_digest",
        "A 48-bit digest of the engine's progress fingerprint (every progress series, the start time, the engine unit) in the last round: "
        "it changes whenever the engine makes progress or restarts. LLMBackendHung carries the digests of its hung engines as evidence, "
        "so the restarter can confirm that nothing moved since.",
        labels=elabels,
    )
    restarts = CounterMetricFamily("llm_backend_restarts", "Restarts seen: a new process start time or counters that went backwards.", labels=["backend"])
    probes = CounterMetricFamily("llm_backend_probes", "1-token probes sent to idle engines, by result.", labels=["backend", "result"])
    probe_s = GaugeMetricFamily("llm_backend_probe_duration_seconds", "Duration of the last probe sent, kept until the next one.", labels=["backend"])
    fetch_s = GaugeMetricFamily("llm_backend_metrics_fetch_duration_seconds", "Duration of the last /metrics read.", labels=["backend"])
    info = GaugeMetricFamily("llm_backend_info", "Backend kind and the engine profile detected from its payload.", labels=["backend", "kind", "profile"])
    round_s = GaugeMetricFamily("llm_exporter_round_duration_seconds", "Duration of the backend's last round.", labels=["backend"])
    errors = CounterMetricFamily("llm_exporter_round_errors", "Rounds that could not read the backend, by what failed.", labels=["backend", "reason"])
    for slot in slots:
        name, v, m = slot.backend.name, slot.verdict, slot.monitor
        stats = m.stats
        current = v.state if v else State.UNKNOWN
        up.add_metric([name], 0.0 if current is State.DOWN or v is None else 1.0)
        for s in State:
            state.add_metric([name, s], 1.0 if s == current else 0.0)
        for e in v.engines if v else ():
            lab = [name, e.model_name, e.engine]
            for s in State:
                estate.add_metric([*lab, s], 1.0 if s == e.state else 0.0)
            running.add_metric(lab, e.running)
            waiting.add_metric(lab, e.waiting)
            if e.steps_per_second is not None:
                steps.add_metric(lab, e.steps_per_second)
            if e.generation_tokens_per_second is not None:
                tokens.add_metric(lab, e.generation_tokens_per_second)
            since.add_metric(lab, e.seconds_since_progress)
            if e.digest:
                digest.add_metric(lab, float(e.digest))
        restarts.add_metric([name], m.memory.restarts if m.memory else 0)
        for result in ("ok", "timeout", "error"):
            probes.add_metric([name, result], stats.probes.get(result, 0))
        if m.last_probe is not None:
            probe_s.add_metric([name], m.last_probe.seconds)
        if stats.metrics is not None:
            fetch_s.add_metric([name], stats.metrics.seconds)
        info.add_metric([name, slot.backend.kind, stats.profile or ""], 1.0)
        round_s.add_metric([name], stats.seconds)
        for reason, count in sorted(slot.errors.items()):
            errors.add_metric([name, reason], count)
    return [up, state, estate, running, waiting, steps, tokens, since, digest, restarts, probes, probe_s, fetch_s, info, round_s, errors]


class BackendsCollector(SnapshotCollector):
    """The series of every backend the callable returns (configured ones, or one /probe target)."""

    def __init__(self, slots: Callable[[], Iterable[Slot]]):
        self.slots = slots

    def families(self, describing: bool) -> Iterator[Metric]:
        yield from backend_families(() if describing else self.slots())


class BuildInfoCollector(SnapshotCollector):
    def families(self, describing: bool) -> Iterator[Metric]:
        build = GaugeMetricFamily("llm_exporter_build_info", "llm-health version.", labels=["version"])
        build.add_metric([__version__], 1.0)
        yield build
