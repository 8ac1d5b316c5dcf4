"""The fast path of prometheus_client's exposition: the backends' series as exposition text,
rendered when a backend's round ends.

The seam is `web.Render` (`Exposition.render` here). Its library counterpart is
prometheus_client's encoder over a registry holding the backends' collector
(`web.RegistryRender`, collectors.BackendsCollector), which also writes every format this
module declines (docs/architecture.md, "Fast paths and their library counterparts").

One source for both paths: `FAMILIES` (name, type, help, label names) and `samples(slot)`
(what a slot exports, family by family) feed the prometheus_client collector
(collectors.backend_families, used by /probe, the benchmark's comparison and any format
this module does not serve) and `Renderer.render`, which formats a slot's sample lines once
per round and keeps them as bytes, one piece per family. A scrape is then each family's
HELP and TYPE lines (made by prometheus_client's own encoder, once per format) followed by
every slot's piece for it, in the slots' order: a copy, not a render of 10,000 snapshots.

The lines are byte for byte what prometheus_client writes
(tests/unit/test_fast_exposition_parity.py compares them): labels sorted by name, values
escaped as it escapes them (backslash, newline, double quote) and numbers through its own
`floatToGoString`. The sample lines of
the Prometheus text format and of OpenMetrics are the same for these series (legacy
names, no timestamps, no exemplars); only the headers differ, and OpenMetrics ends with
`# EOF` (which the tail, rendered by the encoder itself, brings).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..core.states import State

STATEFUL = " Derived by a background round every interval (stateful: two rounds tell stalled from hung), not at scrape time."
ELABELS = ("backend", "model_name", "engine")


@dataclass(frozen=True)
class Family:
    name: str  # without `_total` for counters, as prometheus_client names families
    type: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...]

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.type == "counter" else self.name


FAMILIES: tuple[Family, ...] = (
    Family("llm_backend_up", "gauge", "1 if the backend's /metrics or /v1/models answered in its last round.", ("backend",)),
    Family("llm_backend_state", "gauge", "Health state of the backend (its worst engine), one-hot." + STATEFUL, ("backend", "state")),
    Family("llm_backend_engine_state", "gauge", "Health state per engine (data-parallel rank and model), one-hot." + STATEFUL, (*ELABELS, "state")),
    Family("llm_backend_requests_running", "gauge", "Requests running in the engine, as the engine reports.", ELABELS),
    Family("llm_backend_requests_waiting", "gauge", "Requests waiting in the engine, as the engine reports.", ELABELS),
    Family("llm_backend_engine_steps_per_second", "gauge", "Engine steps per second between the last two rounds." + STATEFUL, ELABELS),
    Family("llm_backend_generation_tokens_per_second", "gauge", "Generated tokens per second between the last two rounds." + STATEFUL, ELABELS),
    Family("llm_backend_seconds_since_progress", "gauge", "Seconds since the engine fingerprint last changed while work was in flight.", ELABELS),
    Family(
        "llm_backend_engine_progress_digest",
        "gauge",
        "A 48-bit digest of the engine's progress fingerprint (every progress series, the start time, the engine unit) in the last round: "
        "it changes whenever the engine makes progress or restarts (for an engine in a livelock, steps moving and no output: a digest of "
        "its output counters, which changes when a token or a finished request shows). LLMBackendHung carries the digests of its hung "
        "engines as evidence, so the restarter can confirm that nothing moved since.",
        ELABELS,
    ),
    Family("llm_backend_restarts", "counter", "Restarts seen: a new process start time or counters that went backwards.", ("backend",)),
    Family("llm_backend_probes", "counter", "1-token probes sent to idle engines, by result.", ("backend", "result")),
    Family("llm_backend_probe_duration_seconds", "gauge", "Duration of the last probe sent, kept until the next one.", ("backend",)),
    Family("llm_backend_metrics_fetch_duration_seconds", "gauge", "Duration of the last /metrics read.", ("backend",)),
    Family("llm_backend_info", "gauge", "Backend kind and the engine profile detected from its payload.", ("backend", "kind", "profile")),
    Family("llm_exporter_round_duration_seconds", "gauge", "Duration of the backend's last round.", ("backend",)),
    Family("llm_exporter_round_errors", "counter", "Rounds that could not read the backend, by what failed.", ("backend", "reason")),
    Family(
        "llm_exporter_readiness_not_ready",
        "counter",
        "Times the backend's readiness (/-/ready) turned not ready (hung, down, or back from a hang but not yet idle or busy), "
        "decided when a round ends; only backends that turned so at least once.",
        ("backend",),
    ),
    Family(
        "llm_backend_queue_age_seconds",
        "gauge",
        "Age of the oldest request waiting inside the backend's engine (the largest of its engine units), derived from the engine's "
        "counters every round: a lower bound, below the truth by less than one round for a first-come-first-served vLLM engine "
        "(docs/engines.md). Absent while unknown (a restart, a first read of a queue, an engine that cannot tell)." + STATEFUL,
        ("backend",),
    ),
    Family(
        "llm_backend_engine_queue_age_seconds",
        "gauge",
        "Age of the oldest request waiting in one engine unit (data-parallel rank), as llm_backend_queue_age_seconds; absent while unknown.",
        ELABELS,
    ),
    Family(
        "llm_backend_engine_refusals",
        "counter",
        "Requests the engine refused itself (its own queue cap: vLLM's --max-num-queued-reqs and --max-num-queued-tokens answer 503), "
        "by reason, counted since the exporter started from the engine's own counter (vllm:admission_rejections_total); only for an "
        "engine that counts them. A refusing engine is shedding load: busy, never hung for that.",
        ("backend", "reason"),
    ),
    Family(
        "llm_backend_shedding",
        "gauge",
        "1 if the engine refused requests itself since the previous round (llm_backend_engine_refusals_total moved), else 0; "
        "only for an engine that counts its refusals.",
        ("backend",),
    ),
    Family(
        "llm_backend_evidence_reads",
        "counter",
        "Reads of the engine's evidence endpoint (the profile's evidence_path, answered by its inference loop) by result (ok, timeout, error), "
        "made only when the engine was already suspected (its /metrics timed out, or nothing moved with work in flight), never "
        "while it moves: a timeout is hang evidence, said in the backend's reason. Only backends read so at least once.",
        ("backend", "endpoint", "result"),
    ),
)
(
    UP,
    STATE,
    ESTATE,
    RUNNING,
    WAITING,
    STEPS,
    TOKENS,
    SINCE,
    DIGEST,
    RESTARTS,
    PROBES,
    PROBE_S,
    FETCH_S,
    INFO,
    ROUND_S,
    ERRORS,
    NOT_READY,
    QUEUE_AGE,
    ENGINE_QUEUE_AGE,
    REFUSALS,
    SHEDDING,
    EVIDENCE,
) = range(len(FAMILIES))
STATES = tuple(State)
ONE_HOT = frozenset({STATE, ESTATE})  # one series per state: 1 for the one the sample names, 0 for the others


class SlotLike(Protocol):
    """What rendering reads of an exporter.slots.Slot (not imported: slots imports this)."""

    backend: Any
    monitor: Any
    verdict: Any
    errors: dict[str, int]
    readiness: Any


# family index, label values (in the family's order), value; for a ONE_HOT family the
# labels lack the last (`state`) and the value is the State that is 1.
Sample = tuple[int, tuple[str, ...], Any]


def samples(slot: SlotLike) -> Iterator[Sample]:
    """Everything `slot` exports, from its snapshot, family by family as FAMILIES lists
    them (within a family, in the order the lines are written; a ONE_HOT sample is its
    family's series for every state, in STATES order)."""
    name, v, m = slot.backend.name, slot.verdict, slot.monitor
    stats = m.stats
    current = v.state if v else State.UNKNOWN
    yield UP, (name,), 0.0 if current is State.DOWN or v is None else 1.0
    yield STATE, (name,), current
    engines = v.engines if v else ()
    for e in engines:
        yield ESTATE, (name, e.model_name, e.engine), e.state
    for e in engines:
        yield RUNNING, (name, e.model_name, e.engine), e.running
    for e in engines:
        yield WAITING, (name, e.model_name, e.engine), e.waiting
    for e in engines:
        if e.steps_per_second is not None:
            yield STEPS, (name, e.model_name, e.engine), e.steps_per_second
    for e in engines:
        if e.generation_tokens_per_second is not None:
            yield TOKENS, (name, e.model_name, e.engine), e.generation_tokens_per_second
    for e in engines:
        yield SINCE, (name, e.model_name, e.engine), e.seconds_since_progress
    for e in engines:
        if e.digest:
            yield DIGEST, (name, e.model_name, e.engine), float(e.digest)
    yield RESTARTS, (name,), m.memory.restarts if m.memory else 0
    for result in ("ok", "timeout", "error"):
        yield PROBES, (name, result), stats.probes.get(result, 0)
    if m.last_probe is not None:
        yield PROBE_S, (name,), m.last_probe.seconds
    if stats.metrics is not None:
        yield FETCH_S, (name,), stats.metrics.seconds
    yield INFO, (name, slot.backend.kind, stats.profile or ""), 1.0
    yield ROUND_S, (name,), stats.seconds
    for reason, count in sorted(slot.errors.items()):
        yield ERRORS, (name, reason), count
    if slot.readiness.not_ready_total:
        yield NOT_READY, (name,), slot.readiness.not_ready_total
    ages = m.queue_ages
    if v is not None and ages.backend is not None:
        yield QUEUE_AGE, (name,), ages.backend
    for (model_name, engine), age in ages.units.items() if v is not None else ():
        if age is not None:
            yield ENGINE_QUEUE_AGE, (name, model_name, engine), age
    for reason, count in sorted(m.refused_total.items()):
        yield REFUSALS, (name, reason), count
    if m.refused_total:
        yield SHEDDING, (name,), 1.0 if v is not None and v.shedding else 0.0
    for (path, result), count in sorted(m.evidence_reads.items()):
        yield EVIDENCE, (name, path, result), count


def escape(value: str) -> str:
    """A label value as prometheus_client escapes it in both text formats."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


# Per family: its sample name and the positions of its labels sorted by label name (the
# order prometheus_client writes them in).
def _sorted_positions(labels: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(labels)), key=labels.__getitem__))


_ORDER = tuple((f.sample_name, _sorted_positions(f.labels)) for f in FAMILIES)
_CACHE_MAX = 4096
# floatToGoString's text of the small whole numbers many samples are (counts, one-hot 1),
# made once; an int key finds its float (1 == 1.0, one hash). Any other value goes to it,
# zero too (0.0 and -0.0 are one key and two texts).
_WHOLE = {float(i): floatToGoString(i) for i in range(1, 1025)}


def expand(family: int, labels: tuple[str, ...], value: Any) -> Iterator[tuple[tuple[str, ...], float]]:
    """The series of one sample: (label values, value) each; one per state for ONE_HOT."""
    if family in ONE_HOT:
        for s in STATES:
            yield (*labels, s), 1.0 if s == value else 0.0
    else:
        yield labels, value


class Renderer:
    """Formats one slot's samples. Keeps the text of each series' `name{labels} ` and of
    each one-hot block it has written (bounded), so a round formats only the numbers."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, tuple[str, ...], Any], str] = {}

    def _line_start(self, family: int, labels: tuple[str, ...]) -> str:
        name, order = _ORDER[family]
        names = FAMILIES[family].labels
        return name + "{" + ",".join(f'{names[i]}="{escape(labels[i])}"' for i in order) + "} "

    def _made(self, key: tuple[int, tuple[str, ...], Any]) -> str:
        family, labels, value = key
        if family in ONE_HOT:
            made = "".join(self._line_start(family, lab) + floatToGoString(v) + "\n" for lab, v in expand(family, labels, value))
        else:
            made = self._line_start(family, labels)
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[key] = made
        return made

    def render(self, slot: SlotLike) -> tuple[bytes, ...]:
        """The slot's sample lines, one piece per family (b"" where it has none)."""
        parts: list[list[str]] = [[] for _ in FAMILIES]
        cache, made, one_hot, whole = self._cache, self._made, ONE_HOT, _WHOLE
        for family, labels, value in samples(slot):
            if family in one_hot:
                key = (family, labels, value)
                parts[family].append(cache.get(key) or made(key))
            else:
                key = (family, labels, None)
                parts[family].append((cache.get(key) or made(key)) + (whole.get(value) or floatToGoString(value)) + "\n")
        return tuple("".join(p).encode() if p else b"" for p in parts)


def metric(f: Family) -> Metric:
    """An empty prometheus_client family for `f` (collectors add the samples)."""
    return Metric(f.name, f.help, f.type)


class _Families(Collector):
    def __init__(self, families: Sequence[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _format(encoder: Callable[..., bytes]) -> tuple[Callable[..., bytes], str, str] | None:
    """(encoder function, escaping, version) of what choose_encoder returned, where this
    module writes the same bytes: the Prometheus text format and OpenMetrics, with
    escaping `underscores` or `allow-utf-8` (both leave these legacy names as they are);
    None otherwise."""
    func = getattr(encoder, "func", encoder)
    kw = getattr(encoder, "keywords", None) or {}
    if getattr(encoder, "args", ()):
        return None
    escaping = kw.get("escaping", openmetrics.UNDERSCORES)
    if func not in (exposition.generate_latest, openmetrics.generate_latest) or escaping not in (openmetrics.UNDERSCORES, openmetrics.ALLOWUTF8):
        return None
    return func, escaping, str(kw.get("version", ""))


class Exposition:
    """`/metrics` from the slots' rendered pieces and a registry of the rest (build info,
    the Redis view), which the encoder renders itself after them, as a registry holding
    the backends' collector first and then the rest would."""

    def __init__(self, slots: Callable[[], Iterable[Any]], rest: Collector):
        self.slots = slots
        self.rest = rest
        self._headers: dict[tuple[Callable[..., bytes], str, str], tuple[bytes, ...]] = {}

    def headers(self, encoder: Callable[..., bytes], key: tuple[Callable[..., bytes], str, str]) -> tuple[bytes, ...]:
        """Each family's HELP and TYPE lines, written by the encoder itself (once per format)."""
        found = self._headers.get(key)
        if found is None:
            eof = b"# EOF\n"
            out = []
            for f in FAMILIES:
                text = encoder(_Families([metric(f)]))
                out.append(text[: -len(eof)] if text.endswith(eof) else text)
            found = self._headers[key] = tuple(out)
        return found

    def render(self, encoder: Callable[..., bytes]) -> bytes | None:
        """The whole exposition in the encoder's format, or None where this module cannot
        write that format (the caller then uses the encoder on the full registry)."""
        key = _format(encoder)
        if key is None:
            return None
        headers = self.headers(encoder, key)
        pieces = [s.rendered for s in self.slots()]
        out: list[bytes] = []
        for i, header in enumerate(headers):
            out.append(header)
            out.extend(p[i] for p in pieces)
        out.append(encoder(self.rest))
        return b"".join(out)
