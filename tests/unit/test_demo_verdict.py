"""The demo's verdict on its admission route: a first attempt refused counts against
`fresh requests admitted` unless a stall of the demo's own event loop (sim.stalls) came in
the span that could have made it late; and the proof never holds with nothing admitted."""

from __future__ import annotations

from types import SimpleNamespace

from llm_health.sim.demo_routes import RouteFigures
from llm_health.sim.demo_view import Parts, Proof, proofs, summary, verdict
from llm_health.sim.stalls import StallWatch


def _fresh_line(refused_windows: list[tuple[float, float]], stalls: list[tuple[float, float]], admitted: int = 2):
    watch = StallWatch()
    watch.noted.extend(stalls)
    figures = SimpleNamespace(
        fresh_sent=admitted + len(refused_windows),
        fresh_admitted=admitted,
        refused_windows=refused_windows,
        ages_ms=[3.0, 250.0],
        late_retries_refused=1,
        late_retries_admitted=0,
        engine_sent=0,
    )
    parts = Parts(exporter=None, exporter_url="", pool=None, route=SimpleNamespace(figures=figures), alerts=None, skipped={}, stalls=watch)
    return next(p for p in proofs(parts, {}, set()) if p.line.startswith("fresh requests admitted"))


def _engine_line(refused: int, after_drain: int, ages: list[float]):
    figures = RouteFigures(
        fresh_sent=1,
        fresh_admitted=1,
        late_retries_refused=1,
        engine_sent=refused + after_drain,
        engine_refused_old=refused,
        engine_refused_ages_ms=ages,
        engine_admitted=after_drain,
        engine_admitted_after_drain=after_drain,
    )
    parts = Parts(exporter=None, exporter_url="", pool=None, route=SimpleNamespace(figures=figures), alerts=None, skipped={}, stalls=StallWatch())
    return next(p for p in proofs(parts, {}, set()) if p.line.startswith("fresh requests refused on the engine's queue age"))


def test_the_engine_route_holds_only_refused_while_old_and_admitted_after_the_drain():
    ok = _engine_line(5, 2, [1600.0, 4000.0])
    assert ok.ok and "engine queue_age_ms 1600-4000 at refusal" in ok.line and ok.line.endswith("admitted again after it drained: 2")
    assert not _engine_line(0, 3, []).ok  # never refused: the engine's queue age was never read
    assert not _engine_line(4, 0, [2000.0]).ok  # never admitted again: refused for good
    assert not _engine_line(2, 1, [900.0, 2000.0]).ok  # refused on an age under the 1.5 s deadline


def test_every_first_attempt_admitted_holds():
    p = _fresh_line([], [])
    assert p.ok and p.line == "fresh requests admitted: 2 of 2 (queue_age_ms 3-250 at admission)"


def test_a_refusal_with_no_stall_fails():
    assert not _fresh_line([(10.0, 12.0)], []).ok


def test_a_refusal_after_a_stall_in_its_span_is_excused_and_said():
    p = _fresh_line([(10.0, 12.0)], [(11.0, 11.6)])
    assert p.ok and p.line == "fresh requests admitted: 2 of 3 (queue_age_ms 3-250 at admission; refused after an event-loop stall: 1)"


def test_a_stall_outside_the_span_excuses_nothing():
    assert not _fresh_line([(10.0, 12.0)], [(12.5, 13.6), (7.0, 9.9)]).ok
    assert not _fresh_line([(10.0, 12.0), (20.0, 22.0)], [(11.0, 11.6)]).ok  # one excused, one not


def test_nothing_admitted_never_holds_even_when_every_refusal_is_excused():
    assert not _fresh_line([(10.0, 12.0)], [(11.0, 11.6)], admitted=0).ok


# The verdict counts only what ran: a run that left a part out never says a bare PASS.


def _ran(*parts: str) -> list[Proof]:
    return [Proof("requests sent to busy servers: 0", True), *(Proof(f"{p} line", True, part=p) for p in parts)]


def test_every_part_ran_is_a_bare_pass():
    assert verdict(_ran("pool", "route", "alerts")) == "PASS"


def test_a_part_not_run_is_named_beside_the_pass():
    items = [*_ran("pool", "route"), Proof("false restarts, hung engines restarted: not run (why)", True, ran=False, part="alerts")]
    assert verdict(items) == "PASS (engines, GPU pool and admission route only; not run: alerts and restarts)"
    assert summary(items).splitlines()[-1] == "verdict: " + verdict(items)


def test_engines_alone_is_said():
    parts = Parts(
        exporter=None, exporter_url="", pool=None, route=None, alerts=None, skipped={"pool": "no redis", "route": "no redis", "alerts": "no prometheus"}
    )
    items = proofs(parts, {}, set())
    assert [p.line for p in items if not p.ran] == [
        "GPU pool: not run (no redis)",
        "admission route: not run (no redis)",
        "false restarts, hung engines restarted: not run (no prometheus)",
    ]
    assert verdict(items) == "PASS (engines only; not run: GPU pool, admission route, alerts and restarts)"


def test_a_failure_is_a_fail_whatever_ran():
    assert verdict([Proof("requests sent to busy servers: 1", False), Proof("x: not run", True, ran=False, part="alerts")]) == "FAIL: see the lines marked NO"
