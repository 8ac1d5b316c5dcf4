"""Evidence that travels with an alert: a digest of each engine's progress fingerprint.

When the exporter proves an engine `hung` it has already watched it make no progress for
`hung_after_seconds`. It exports a digest of what it saw (`progress_digest`: the engine
profile, the process start time, the engine unit, every fingerprint series and the sleep
flag) as `llm_backend_engine_progress_digest`, and the `LLMBackendHung` alert carries the
digests of its hung engines in its `evidence` annotation. The restarter then need not
wait another `hung_after_seconds`: if a fresh read gives the same digest, nothing moved
since the proof (counters only rise within one process, and the start time is in the
digest), so the no-progress time is the exporter's plus everything since.

An engine proven hung in a livelock (its steps move, its output does not: core.health)
changes its progress digest every step; its evidence is instead `output_digest`, of the
same material with the output counters in place of the fingerprint, so that a fresh read
with the same digest shows that nothing came out since the proof.

The digest is 48 bits so that it is exact as a float64 sample value and prints exactly
with `printf "%.0f"` in a Prometheus template. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .engines import EngineReading
from .errors import CoreError

DIGEST_BITS = 48
MAX_DIGESTS = 256  # engine units of one backend (the engines' own Limits.max_engines)
MAX_EVIDENCE_CHARS = 8192


def progress_digest(profile: str, start_time: float | None, e: EngineReading) -> int:
    """A 48-bit digest of everything whose change would be progress, or a restart."""
    material = repr((profile, start_time, e.model_name, e.engine, e.fingerprint, e.sleeping))
    return _digest(material)


def output_digest(profile: str, start_time: float | None, e: EngineReading) -> int:
    """A 48-bit digest of everything whose change would be output (a token, a finished
    request), or a restart: a livelocked engine's evidence."""
    return _digest(repr(("output", profile, start_time, e.model_name, e.engine, e.output, e.sleeping)))


def _digest(material: str) -> int:
    return int.from_bytes(hashlib.blake2b(material.encode(), digest_size=DIGEST_BITS // 8).digest(), "big")


@dataclass(frozen=True)
class Evidence:
    """The digests of the engines an alert says are hung. Empty when the backend is hung
    with nothing in flight (an idle engine that failed its probes)."""

    digests: frozenset[int]


class BadEvidence(CoreError, ValueError):
    """An `evidence` annotation that is not a list of digests."""


_TOKEN = re.compile(r"[0-9]{1,15}")


def parse_evidence(text: str) -> Evidence:
    """Parse `evidence`: decimal digests separated by blanks or commas, `none` for no
    engine in flight. Raises BadEvidence naming what is wrong."""
    if len(text) > MAX_EVIDENCE_CHARS:
        raise BadEvidence(f"evidence annotation of {len(text)} characters, more than {MAX_EVIDENCE_CHARS}")
    tokens = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    if tokens == ["none"]:
        return Evidence(frozenset())
    if not tokens:
        raise BadEvidence("evidence annotation is empty")
    if len(tokens) > MAX_DIGESTS:
        raise BadEvidence(f"{len(tokens)} digests in the evidence annotation, more than {MAX_DIGESTS}")
    digests = set()
    for t in tokens:
        if not _TOKEN.fullmatch(t) or int(t) >= 1 << DIGEST_BITS:
            raise BadEvidence(f"evidence annotation: {t[:40]!r} is not a {DIGEST_BITS}-bit decimal digest")
        digests.add(int(t))
    return Evidence(frozenset(digests))
