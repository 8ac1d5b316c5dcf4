"""The demo's terminal view (one section per part of the product) and its closing summary.

Every figure is read from the run: the exporter's own snapshots and its `/metrics` (the
`llm_gpu_*` and `llm_admission_*` series Prometheus would scrape), the pool's and the
route's counts, Prometheus' alerts and the restarter's actions, and the simulated
servers' record of what reached them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from ..exporter.app import Exporter
from .stalls import NOTED_S, StallWatch

HUNG_ALERTS = ("LLMBackendHung", "VLLMEngineHung")

if TYPE_CHECKING:
    from .alerting import AlertLoop
    from .demo_routes import RetryTraffic
    from .gpu_pool import GpuPool
    from .servers import SimServer

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_series(text: str) -> Series:
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(series: Series, name: str, **labels: str) -> float | None:
    return series.get((name, tuple(sorted(labels.items()))))


def _num(v: float | None, fmt: str, scale: float = 1.0) -> str:
    return format(v * scale, fmt) if v is not None else "-"


def engines_table(exporter: Exporter) -> str:
    lines = [f"{'backend':<14} {'state':<13} {'run':>4} {'wait':>4} {'steps/s':>8} {'tok/s':>7}  reason"]
    for slot in exporter.slots.values():
        st = slot.status()
        lines.append(
            f"{st['backend']:<14} {st['state']:<13} {_num(st['running'], '4.0f'):>4} {_num(st['waiting'], '4.0f'):>4} "
            f"{_num(st['steps_per_second'], '8.1f'):>8} {_num(st['generation_tokens_per_second'], '7.1f'):>7}  {st['reason'][:90]}"
        )
    return "\n".join(lines)


@dataclass
class Parts:
    exporter: Exporter
    exporter_url: str
    pool: GpuPool | None
    route: RetryTraffic | None
    alerts: AlertLoop | None
    skipped: dict[str, str]  # part -> why it did not run and how to get it
    t0_wall: float = 0.0  # the run's start, for the times shown
    t0_mono: float = 0.0
    stalls: StallWatch | None = None  # the event loop's stalls, which can explain a lost lease or a late request


def pool_section(parts: Parts, series: Series) -> list[str]:
    if parts.pool is None:
        return [f"  skipped: {parts.skipped.get('pool', '')}"]
    p, f = parts.pool.pool.name, parts.pool.figures
    g = lambda name, **kw: _get(series, name, pool=p, **kw)  # noqa: E731
    lines = [
        f"  exporter: llm_gpu_pool_size {_num(g('llm_gpu_pool_size'), '.0f')}  leases_held {_num(g('llm_gpu_leases_held'), '.0f')}  "
        f"free {_num(g('llm_gpu_free'), '.0f')}  waiters {_num(g('llm_gpu_waiters'), '.0f')}  "
        f"lease_ttl_min {_num(g('llm_gpu_lease_ttl_min_seconds'), '.1f')} s  "
        f"releases del {_num(g('llm_gpu_lease_releases_total', reason='del'), '.0f')} expired {_num(g('llm_gpu_lease_releases_total', reason='expired'), '.0f')}",
        "  holders: " + (", ".join(f"{gpu} {job}" for gpu, job in sorted(f.holders.items())) or "none") + f"; waiting: {len(f.waiting)}",
        "  claims: " + (", ".join(f"{via} {n}" for via, n in sorted(f.claims.items())) or "none") + f"; renewals {f.renewals}; releases {f.releases}",
    ]
    lines += [f"  . {e}" for e in f.log[-3:]]
    return lines


def route_section(parts: Parts, series: Series) -> list[str]:
    if parts.route is None:
        return [f"  skipped: {parts.skipped.get('route', '')}"]
    r, f = parts.route.route, parts.route.figures
    g = lambda name: _get(series, name, route=r)  # noqa: E731
    lines = [
        f"  exporter: queue_depth {_num(g('llm_admission_queue_depth'), '.0f')}  queue_age_ms {_num(g('llm_admission_queue_age_seconds'), '.0f', 1000)}  "
        f"deadline_slack_ms {_num(g('llm_admission_deadline_slack_seconds'), '.0f', 1000)}  past_deadline {_num(g('llm_admission_past_deadline'), '.0f')}",
        f"  gate: last admitted queue_age_ms {_num(f.admitted_age_ms, '.0f')} deadline_slack_ms {_num(f.admitted_slack_ms, '.0f')}; "
        f"last refused deadline_slack_ms {_num(f.refused_slack_ms, '.0f')}",
        f"  clients: fresh requests {f.fresh_sent} (admitted {f.fresh_admitted}), retries {f.retries_sent}: "
        f"late retries refused {f.late_retries_refused}, late retries admitted {f.late_retries_admitted}; worker calls {f.worker_calls}",
        f"  batch scheduler: {f.room_enqueued} requests queued in Redis, {f.room_served} served",
    ]
    if f.engine_sent:
        age = _get(series, "llm_backend_queue_age_seconds", backend="overloaded")
        shown = "unknown" if age is None else f"{age * 1000:.0f}"
        lines.append(
            f"  route engine (queue inside backend `overloaded`): engine queue_age_ms {shown}; fresh requests {f.engine_sent}: "
            f"refused on the engine's queue age {f.engine_refused_old}, admitted {f.engine_admitted}"
        )
    lines += [f"  . {e}" for e in f.last[-2:]]
    return lines


def alerts_section(parts: Parts) -> list[str]:
    if parts.alerts is None:
        return [f"  skipped: {parts.skipped.get('alerts', '')}"]
    f = parts.alerts.figures
    hung = sorted(f"{a} {b}" for a, b in f.firing_now if a in HUNG_ALERTS)
    others = Counter(a for a, _ in f.firing_now if a not in HUNG_ALERTS)
    lines = ["  firing: " + (", ".join(hung) or "no hung alert") + ("; also " + ", ".join(f"{a} x{n}" for a, n in sorted(others.items())) if others else "")]
    for a in f.actions:
        steps = [f"{a['alertname']} fired t={_since(parts, f.firing.get((a['alertname'], a['backend'])), mono=True)}"]
        steps.append(f"received t={_since(parts, a.get('received_at'))}")
        if a.get("verified_at"):
            steps.append(f"hang confirmed t={_since(parts, a['verified_at'])}")
        if a.get("command_started_at"):
            steps.append(f"restart command t={_since(parts, a['command_started_at'])}")
        if a.get("recovered_at"):
            steps.append(f"back ({a.get('recovery_state')}) t={_since(parts, a['recovered_at'])}")
        lines.append(f"  {a['backend']}: " + " -> ".join(steps) + f"  [{a['phase']}{', ' + a['outcome'] if a['outcome'] else ''}]")
    if f.refused:
        lines.append(f"  restarter refused: {len(f.refused)} (" + ", ".join(sorted({str(r.get("reason")) for r in f.refused})) + ")")
    if f.paged:
        lines.append(f"  pager and ticket receivers got {len(f.paged)} notifications (last: {f.paged[-1]})")
    if f.error:
        lines.append(f"  (Prometheus: {f.error})")
    return lines


def _since(parts: Parts, at: float | None, mono: bool = False) -> str:
    """A time of the run as seconds since the view's start (wall clock unless `mono`)."""
    if at is None:
        return "?"
    return f"{at - (parts.t0_mono if mono else parts.t0_wall):.1f}s"


def frame(parts: Parts, series: Series, elapsed: float) -> str:
    sections = [
        f"--- t={elapsed:5.1f}s ---",
        f"== engines (exporter {parts.exporter_url}/metrics and /status) ==",
        engines_table(parts.exporter),
        "== GPU pool (leases in Redis) ==",
        *pool_section(parts, series),
        "== admission route (llm-health gate) ==",
        *route_section(parts, series),
        "== alerts and restarts (Prometheus, Alertmanager, llm-health restarter) ==",
        *alerts_section(parts),
    ]
    return "\n".join(sections)


# The parts of the demo, in the order of its view; `Parts.skipped` names them by key.
PART_NAMES = {"engines": "engines", "pool": "GPU pool", "route": "admission route", "alerts": "alerts and restarts"}


@dataclass
class Proof:
    line: str
    ok: bool
    ran: bool = True  # False: the part did not run (the line says why)
    part: str = "engines"  # a key of PART_NAMES


def proofs(parts: Parts, servers: dict[str, SimServer], hung_at_start: set[str]) -> list[Proof]:
    """What the run proved, each from its own counts."""
    busy = sum(len(s.completions_while_busy()) for s in servers.values())
    out = [Proof(f"requests sent to busy servers: {busy}", busy == 0)]
    for part in ("pool", "route"):
        if part in parts.skipped:
            out.append(Proof(f"{PART_NAMES[part]}: not run ({parts.skipped[part]})", True, ran=False, part=part))
    if parts.alerts is not None:
        effects = parts.alerts.effects
        false = sum(1 for e in effects.values() for r in e.restarts if not r.was_hung)
        per = {name: sum(1 for r in e.restarts if r.was_hung) for name, e in effects.items()}
        restarted = sorted(n for n, k in per.items() if k)
        # Back: the restarter saw it recover (its action done, `recovered`) and the exporter sees it healthy.
        recovered = {a["backend"] for a in parts.alerts.figures.actions if a["outcome"] == "recovered"}
        back = [n for n in restarted if n in recovered and parts.exporter.slots[n].status()["state"] in ("idle", "busy", "restarted")]
        out.append(Proof(f"false restarts: {false}", false == 0, part="alerts"))
        out.append(
            Proof(
                f"hung engines restarted: {len(restarted)} of {len(hung_at_start)} hung ({', '.join(restarted) or 'none'}; "
                f"restarts each: {', '.join(str(per[n]) for n in restarted) or '-'}; back and healthy: {len(back)})",
                set(restarted) == hung_at_start and all(per[n] == 1 for n in restarted) and len(back) == len(restarted),
                part="alerts",
            )
        )
    else:
        out.append(Proof(f"false restarts, hung engines restarted: not run ({parts.skipped.get('alerts', '')})", True, ran=False, part="alerts"))
    if parts.route is not None:
        rf = parts.route.figures
        out.append(
            Proof(
                f"late retries refused: {rf.late_retries_refused} (late retries admitted: {rf.late_retries_admitted})",
                rf.late_retries_admitted == 0 and rf.late_retries_refused > 0,
                part="route",
            )
        )
        ages = f"queue_age_ms {min(rf.ages_ms):.0f}-{max(rf.ages_ms):.0f} at admission" if rf.ages_ms else "no queue age seen"
        # A first attempt refused when a stall of the demo's own loop (a second or more) came
        # within its deadline before the refusal was late because of the machine, not the gate.
        stalled = [w for w in rf.refused_windows if parts.stalls is not None and parts.stalls.stalled_between(*w)]
        excused = f"; refused after an event-loop stall: {len(stalled)}" if stalled else ""
        out.append(
            Proof(
                f"fresh requests admitted: {rf.fresh_admitted} of {rf.fresh_sent} ({ages}{excused})",
                rf.fresh_admitted > 0 and rf.fresh_admitted + len(stalled) == rf.fresh_sent,
                part="route",
            )
        )
    if parts.route is not None and parts.route.figures.engine_sent:
        rf = parts.route.figures
        ages = (
            f", engine queue_age_ms {min(rf.engine_refused_ages_ms):.0f}-{max(rf.engine_refused_ages_ms):.0f} at refusal" if rf.engine_refused_ages_ms else ""
        )
        other = f"; other answers: {', '.join(f'{k} {v}' for k, v in sorted(rf.engine_other.items()))}" if rf.engine_other else ""
        out.append(
            Proof(
                f"fresh requests refused on the engine's queue age: {rf.engine_refused_old} (reject_age_beats_slack{ages}); "
                f"admitted again after it drained: {rf.engine_admitted_after_drain}{other}",
                rf.engine_refused_old > 0 and rf.engine_admitted_after_drain > 0 and all(a >= 1500 for a in rf.engine_refused_ages_ms),
                part="route",
            )
        )
    if parts.pool is not None:
        pf = parts.pool.figures
        # Said only when it explains something: a lease given up, or a stall of a second or more.
        longest = parts.stalls.longest_s if parts.stalls is not None else 0.0
        notes = [f"leases given up by a late heartbeat: {pf.lost}"] if pf.lost else []
        if pf.lost or longest >= NOTED_S:
            notes.append(f"longest event-loop stall {longest * 1000:.0f} ms")
        gave_up = f" ({'; '.join(notes)})" if notes else ""
        first = f": {'; '.join(pf.doubles)}" if pf.doubles else ""
        out.append(Proof(f"double lease holders: {pf.double_holders}{gave_up}{first}", pf.double_holders == 0, part="pool"))
        taken = f"taken by {pf.expired_taken_by} {pf.expired_taken_after_s:.1f} s after the crash" if pf.expired_taken_after_s is not None else "not yet taken"
        woken = pf.claims["del"] + pf.claims["expired"]
        out.append(
            Proof(
                f"crashed job's lease ({pf.crashed or 'no crash yet'}): {taken}; waiters woken by events: {woken}",
                pf.expired_taken_after_s is not None,
                part="pool",
            )
        )
    return out


def verdict(items: list[Proof]) -> str:
    """PASS only for a run in which every part ran; a PASS of fewer parts names them
    and the parts that did not run (`PASS (engines only; not run: ...)`), never a bare PASS."""
    if not all(p.ok for p in items):
        return "FAIL: see the lines marked NO"
    ran = [PART_NAMES[k] for k in PART_NAMES if any(p.part == k and p.ran for p in items)]
    not_run = [PART_NAMES[k] for k in PART_NAMES if any(p.part == k and not p.ran for p in items)]
    if not not_run:
        return "PASS"
    return f"PASS ({', '.join(ran[:-1]) + ' and ' + ran[-1] if len(ran) > 1 else ran[0]} only; not run: {', '.join(not_run)})"


def summary(items: list[Proof]) -> str:
    lines = ["", "what this run proved:"]
    lines += [f"  {'-- ' if not p.ran else 'ok ' if p.ok else 'NO '} {p.line}" for p in items]
    lines.append("verdict: " + verdict(items))
    return "\n".join(lines)
