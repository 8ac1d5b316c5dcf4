"""The restarter's quick confirmation of a proven hang. Pure: no I/O.

An `LLMBackendHung` alert carries the progress digests of the engines the exporter
proved hung (`core.evidence`). The restarter reads the backend twice, `confirm_interval`
apart, and restarts only if both reads show every one of those engines exactly as the
exporter saw it when it proved the hang: same process, same counters, same gauges, still
with work in flight, not asleep. Any step, token, finished request, preemption, KV change,
new or lost request, or a restart in between changes a digest, and the alert is refused.

A livelocked engine (steps moving, no output: core.health) was proven by its output
digest (`core.evidence.output_digest`): the reads must show its output unchanged, same
process; its steps may move.

A busy engine cannot pass: its digest changes with every step (and its output digest with
every token). A slow engine, a long
prefill, a restarting or sleeping one never reached `hung` in the exporter (which waited
`hung_after_seconds` and two rounds, and asked the sleep endpoints), so its digest was
never in any evidence; and if one of them moves after the proof, the reads see it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engines import EngineReading, Reading
from .evidence import Evidence, output_digest, progress_digest


@dataclass(frozen=True)
class ConfirmRead:
    """One read of the backend: its parsed /metrics (None: no usable payload) and the
    sleep and pause endpoints' answers."""

    reading: Reading | None
    error: str | None = None
    sleeping: bool = False
    paused: bool = False


def digests(reading: Reading) -> dict[int, EngineReading]:
    """Each engine by its progress digest and by its output digest (a livelock's evidence)."""
    out = {progress_digest(reading.profile, reading.start_time, e): e for e in reading.engines.values()}
    out.update({output_digest(reading.profile, reading.start_time, e): e for e in reading.engines.values() if e.output})
    return out


def against_evidence(evidence: Evidence, read: ConfirmRead) -> str | None:
    """None when the read shows every hung engine of the evidence unchanged and still with
    work in flight; otherwise what differs."""
    if read.reading is None:
        return f"no usable /metrics ({read.error or 'no answer'})"
    if read.sleeping or read.paused:
        return "the engine reports it is " + ("asleep" if read.sleeping else "paused")
    seen = digests(read.reading)
    moved = evidence.digests - seen.keys()
    if moved:
        return (
            f"{len(moved)} of the {len(evidence.digests)} engine(s) the alert proved hung changed since "
            f"(progress, a new or finished request, or a restart): not hung"
        )
    for d in sorted(evidence.digests):
        e = seen[d]
        if not e.in_flight:
            return f"engine {e.engine or '-'} of {e.model_name or '-'} has nothing in flight"
    return None


def idle(read: ConfirmRead) -> bool:
    """Every engine's counts are known and nothing is in flight: the only state in which
    the restarter may send a probe."""
    r = read.reading
    return r is not None and bool(r.engines) and all(e.known and not e.in_flight for e in r.engines.values())
