"""exporter.fast_exposition (the fast path) against its library counterpart,
prometheus_client's encoder over a registry holding the backends' collector
(`web.RegistryRender`): the same `/metrics` body, byte for byte, through the seam
(`web.Render`) for every format the fast path writes (both text formats, both escapings
it serves, what Prometheus 2 and 3 ask for), with odd label values (quotes, backslashes,
newlines, UTF-8), odd numbers (NaN, infinities, large and small floats, integers, -0.0)
and the other collectors after the backends' (a histogram, a counter with its created
sample); the formats it does not write declined (None), for the library to write."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.parser import text_string_to_metric_families

from llm_health.core.health import EngineVerdict, Memory, Verdict
from llm_health.core.queue_age import QueueAges
from llm_health.core.readiness import Readiness
from llm_health.core.states import State
from llm_health.exporter.collectors import BackendsCollector, BuildInfoCollector
from llm_health.exporter.fast_exposition import FAMILIES, Exposition, Renderer, escape
from llm_health.probe.client import Fetched, ProbeResult
from llm_health.probe.monitor import RoundStats
from llm_health.web import RegistryRender, Render

ODD = ['with "quotes"', "back\\slash", "new\nline", 'all \\"\n of them\\n', "ünïcødé ☃", "", "trailing\\"]


@dataclass
class FakeBackend:
    name: str
    kind: str = "vllm"


@dataclass
class FakeMonitor:
    stats: RoundStats = field(default_factory=RoundStats)
    memory: Memory | None = None
    last_probe: ProbeResult | None = None
    queue_ages: QueueAges = field(default_factory=QueueAges)
    refused_total: dict[str, float] = field(default_factory=dict)
    evidence_reads: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass
class FakeSlot:
    backend: FakeBackend
    monitor: FakeMonitor = field(default_factory=FakeMonitor)
    verdict: Verdict | None = None
    errors: dict[str, int] = field(default_factory=dict)
    readiness: Readiness = field(default_factory=Readiness)
    renderer: Renderer = field(default_factory=Renderer)
    rendered: tuple[bytes, ...] = ()

    def render(self) -> None:
        self.rendered = self.renderer.render(self)


def engine(model: str, name: str, state: State, **kw: Any) -> EngineVerdict:
    return EngineVerdict(model, name, state, "why", kw.pop("running", 1), kw.pop("waiting", 0.5), **kw)


def fleet() -> list[FakeSlot]:
    never = FakeSlot(FakeBackend("never-read"))  # no round yet
    plain = FakeSlot(
        FakeBackend("b1"),
        FakeMonitor(RoundStats(metrics=Fetched(parts=("",), seconds=0.0123), profile="vllm-v1", seconds=0.25), Memory(restarts=3)),
        Verdict(State.BUSY, "busy", Memory(), (engine("m", "0", State.BUSY, steps_per_second=12.5, generation_tokens_per_second=300.0, digest=2**48 - 1),)),
        {"timeout": 2, "metrics": 1},
    )
    numbers = [math.nan, math.inf, -math.inf, 1e22, 1.5e-7, 123456789.0, 7, 0, -0.0, 2**53 + 1]
    odd_engines = tuple(
        engine(
            ODD[i % len(ODD)],
            ODD[(i + 3) % len(ODD)] + str(i // len(ODD)),
            list(State)[i % len(State)],
            running=numbers[i % len(numbers)],
            waiting=numbers[(i + 1) % len(numbers)],
            steps_per_second=None if i % 3 == 0 else numbers[(i + 2) % len(numbers)],
            generation_tokens_per_second=None if i % 4 == 1 else numbers[(i + 5) % len(numbers)],
            seconds_since_progress=numbers[(i + 7) % len(numbers)],
            digest=0 if i == 2 else 0xABCDEF012345 + i,
        )
        for i in range(10)
    )
    odd = FakeSlot(
        FakeBackend('odd "name"\\\nwith ☃', kind="vllm"),
        FakeMonitor(
            RoundStats(metrics=Fetched(error="x", seconds=math.inf), profile='pro"file\n', seconds=math.nan, probes={"ok": 1, "timeout": 0, "error": 5}),
            Memory(restarts=2**40),
            ProbeResult(True, 1e-9, "ok"),
        ),
        Verdict(State.HUNG, "hung", Memory(), odd_engines),
        {'re"ason\n': 1, "exception": 10**12},
    )
    down = FakeSlot(FakeBackend("down", kind="proxy"), verdict=Verdict(State.DOWN, "refused", Memory()), readiness=Readiness(False, "down", not_ready_total=3))
    plain.monitor.queue_ages.units = {("m", "0"): 12.5}  # the engine's queue age: known
    plain.monitor.refused_total = {"max_num_queued_reqs": 7.0, "max_num_queued_tokens": 0.0}  # an engine that counts its refusals
    plain.verdict = replace(plain.verdict, refused={"max_num_queued_reqs": 2.0})  # shedding this round
    odd.monitor.refused_total = {'odd "reason"\n☃': math.inf}
    odd.monitor.evidence_reads = {("/slots", "timeout"): 3, ('/"odd"\\\n', "ok"): 2**40}
    odd.monitor.queue_ages.units = {(e.model_name, e.engine): (None if i % 3 == 0 else numbers[i % len(numbers)]) for i, e in enumerate(odd_engines)}
    slots = [never, plain, odd, down]
    for s in slots:
        s.render()
    return slots


def registries(slots: list[FakeSlot]) -> tuple[CollectorRegistry, CollectorRegistry]:
    """(every collector, as the library renders them; all but the backends', as the fast
    path's tail), as exporter.app holds them; with a histogram and a counter among the rest."""
    full, rest = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    full.register(BackendsCollector(lambda: slots))  # type: ignore[arg-type,return-value]
    build = BuildInfoCollector()
    full.register(build)
    rest.register(build)
    other = CollectorRegistry()
    hist = Histogram("odd_seconds", 'A histogram: "quoted" \\ help\nwith a newline.', ["le_not", "path"], registry=other, buckets=(0.1, 1.0, math.inf))
    hist.labels('a "b"', "c\nd").observe(0.5)
    hist.labels("x", "").observe(math.inf)
    Counter("odd_events", "A counter, its created sample too.", registry=other).inc(2.5)
    full.register(other)  # type: ignore[arg-type]
    rest.register(other)  # type: ignore[arg-type]
    return full, rest


def pair(slots: list[FakeSlot]) -> tuple[Render, Render]:
    """(the fast path, its library counterpart) over `slots`: both a `web.Render`."""
    full, rest = registries(slots)
    return Exposition(lambda: slots, rest).render, RegistryRender(full)


ACCEPTS = [
    "",  # the text format 0.0.4
    "text/plain;version=0.0.4",
    "text/plain;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=1.0.0;escaping=underscores",
    "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    # what Prometheus 2 and 3 send by default: OpenMetrics first
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
]


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_rendered_exposition_is_prometheus_clients_byte_for_byte(accept):
    slots = fleet()
    fast, library = pair(slots)
    encoder, _ = choose_encoder(accept)
    ours = fast(encoder)
    assert ours is not None
    assert ours == library(encoder)
    assert ours == fast(encoder)  # the headers, once made, are kept


def test_it_parses_back_with_every_odd_label_value_and_number():
    slots = fleet()
    _, rest = registries(slots)
    text = Exposition(lambda: slots, rest).render(generate_latest)
    assert text is not None
    values = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    backends = {dict(labels).get("backend") for _, labels in values}
    assert 'odd "name"\\\nwith ☃' in backends
    assert {dict(labels).get("model_name") for _, labels in values} >= set(ODD)
    running = [v for (n, _), v in values.items() if n == "llm_backend_requests_running"]
    assert any(math.isnan(v) for v in running) and math.inf in running and -math.inf in running
    # one-hot: exactly one state per backend and per engine unit
    for backend in backends - {None}:
        hot = [lab for (n, lab), v in values.items() if n == "llm_backend_state" and dict(lab)["backend"] == backend and v == 1]
        assert len(hot) == 1


def test_a_round_rerenders_only_what_changed_and_the_prefixes_stay_bounded():
    slot = fleet()[1]
    first = slot.rendered
    slot.errors["timeout"] += 1
    slot.render()
    changed = [f.name for f, a, b in zip(FAMILIES, first, slot.rendered) if a != b]
    assert changed == ["llm_exporter_round_errors"]
    r = Renderer()
    for i in range(5000):
        r.render(FakeSlot(FakeBackend(f"b{i}")))
    assert len(r._cache) <= 4096


def test_formats_it_does_not_write_are_left_to_prometheus_client():
    fast, library = pair(fleet())
    for encoder in (partial(generate_latest, escaping=openmetrics.DOTS), partial(openmetrics.generate_latest, escaping=openmetrics.DOTS)):
        assert fast(encoder) is None
        assert library(encoder)  # the library writes it
    assert fast(lambda registry: b"") is None


def test_escape_is_prometheus_clients():
    for value in ODD:
        assert escape(value) == openmetrics._escape(value, openmetrics.ALLOWUTF8, None)  # type: ignore[arg-type]
