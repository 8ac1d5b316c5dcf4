"""bench_goodput's shared parts: the seeded schedule, what one logical request ended as, the
figures per policy and load, the goal lines and the plot. No I/O but the plot's file."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench._goal import goal_line, printed
from bench._stats import percentile

DEADLINE_MIX = (3, 10, 30)  # a third each, in units of the unloaded service time S
# The doors' configuration, as docs/admission.md advises under overload: expected_service_ms
# = S, and reject_if_queue_age_ms_gte = this many S (a queue no older than it keeps the engine
# busy; an older one only holds requests whose answers come late).
AGE_CAP_SERVICES = 5
SDK_MAX_RETRIES = 2  # the openai SDK's default
TOKENS = 16  # completion tokens a request asks for (ignore_eos: every answer has them all)
GOAL_CAPACITY = 0.90  # at 2x and 4x: the door's goodput at least 90% of capacity
GOAL_OVER_CAP = 1.2  # and at least 1.2x the best queue cap's,
# or, where 1.2x the cap's is above it, this share of C: no policy passes C (the physical
# limit), and a window's edges (answers still running when it ends) keep even a saturated
# engine with no deadline to miss about 1% under it; a cap at 0.82 C or more leaves 1.2x no
# room. The simulated fleet's cap of 2 makes 0.98-0.99 C (a refusal there costs nothing).
GOAL_NEAR_CAPACITY = 0.98
GOAL_WASTED = 0.05  # wasted engine tokens at most 5% of those generated
GOAL_UNDERLOAD = 0.02  # at 0.8x within 2% of direct's goodput
# The real run interleaves: each policy's window at a load is ROUNDS blocks, and a round runs
# every policy's block and a closed loop that measures C, in turn (reversed in every other
# round), so a swing of the engine's speed falls alike on every policy and on C. One window
# per policy, minutes apart, could not tell a policy from a swing: the throttled engine's own
# speed moves by a fifth from one half-minute to the next on this machine, and at a9434db the
# doors' windows ran on an engine making 3.83-4.57 answers' worth/s where the cap of 8's made
# 5.29-5.57 (bench/notes/bench_goodput.md).
ROUNDS = 2
ROUND_MS = 1000  # the exporter's round in the real run: the "one round" for the age checks
DOORS = ("gate", "nginx+decide")


@dataclass(frozen=True)
class Arrival:
    id: str
    at: float  # seconds from the window's start
    deadline_s: float  # relative: the request is on time if answered by at + deadline_s


def schedule(seed: int, rate: float, seconds: float, service_s: float, prefix: str) -> list[Arrival]:
    """Poisson arrivals at `rate` per second over `seconds`, each with a deadline drawn from
    DEADLINE_MIX x `service_s`; the same seed gives the same schedule to every policy."""
    rng = random.Random(f"{seed}:{rate:.6f}")
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(Arrival(f"{prefix}-{len(out)}", t, rng.choice(DEADLINE_MIX) * service_s))


@dataclass
class Outcome:
    """One logical request, as its caller and the engine side saw it."""

    arrival: Arrival
    ok: bool = False
    done_at: float | None = None  # when the answer arrived (window seconds)
    tokens: int = 0  # completion tokens in the answer's usage
    attempts: int = 0  # copies the client sent
    codes: list[str] = field(default_factory=list)  # per attempt: the status, "timeout" or "error"
    failed: str | None = None  # a failure that is neither a refusal nor a timeout
    copies: int = 0  # copies that reached the engine side
    copies_late: int = 0  # of them, arrived after the deadline

    @property
    def on_time(self) -> bool:
        return self.ok and self.done_at is not None and self.done_at <= self.arrival.at + self.arrival.deadline_s

    @property
    def latency_s(self) -> float:
        return (self.done_at or 0.0) - self.arrival.at


@dataclass(frozen=True)
class AgeRefusal:
    """A door's `reject_age_beats_slack` beside the client-side truth: the oldest copy truly
    waiting at the engine at the instant the door decided (the request's deadline less the
    slack the door reported: both are the door's clock, so the instant is exact to its
    millisecond, where the instant the client read the refusal lags it under load)."""

    door_ms: float  # the age the door acted on (its x-queue-age-ms)
    slack_ms: float  # the deadline slack it weighed it against (x-deadline-slack-ms)
    truth_ms: float  # the oldest copy truly waiting then
    fresh: bool  # the caller's first attempt (X-Stainless-Retry-Count 0), not an SDK retry


@dataclass
class Result:
    policy: str
    load: float
    seconds: float
    capacity: float  # answers/s
    outcomes: list[Outcome]
    generated: float  # engine tokens generated in the window
    ages: list[AgeRefusal] = field(default_factory=list)  # a door's age refusals
    parts: tuple[float, ...] = ()  # the goodput of each block the window was merged from (merge)

    def on_time(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.on_time and o.done_at is not None and o.done_at <= self.seconds]

    @property
    def goodput(self) -> float:
        return len(self.on_time()) / self.seconds

    @property
    def fraction(self) -> float:
        return self.goodput / self.capacity

    @property
    def worth(self) -> float:
        """The engine's output in answers' worth a second: its generated tokens / TOKENS."""
        return self.generated / TOKENS / self.seconds

    @property
    def wasted(self) -> float:
        """Share of the engine's generated tokens not in an on-time answer."""
        useful = sum(o.tokens for o in self.on_time())
        return max(0.0, self.generated - useful) / self.generated if self.generated else 0.0

    @property
    def failed(self) -> int:
        return sum(1 for o in self.outcomes if o.failed)

    @property
    def copies(self) -> int:
        return sum(o.copies for o in self.outcomes)

    @property
    def copies_late(self) -> int:
        return sum(o.copies_late for o in self.outcomes)

    def refusals(self) -> Counter[str]:
        return Counter(c for o in self.outcomes for c in o.codes if c != "200")

    def quantile(self, q: float) -> float:
        lat = sorted(o.latency_s for o in self.on_time())
        return percentile(lat, q * 100) if lat else math.nan


def merge(blocks: list[Result]) -> Result:
    """One policy's window at one load from its blocks (ROUNDS), end to end: each block's
    times moved on by the seconds of the blocks before it, an answer after its own block's
    end (a race with the block's cancel) counted as none, as in the block itself."""
    first = blocks[0]
    outcomes: list[Outcome] = []
    offset = 0.0
    for b in blocks:
        if (b.policy, b.load) != (first.policy, first.load):
            raise ValueError(f"merge: {b.policy} at {b.load:g}x among {first.policy} at {first.load:g}x")
        for o in b.outcomes:
            a = o.arrival
            inside = o.done_at is not None and o.done_at <= b.seconds
            outcomes.append(
                Outcome(
                    Arrival(a.id, a.at + offset, a.deadline_s),
                    o.ok,
                    o.done_at + offset if inside and o.done_at is not None else None,
                    o.tokens,
                    o.attempts,
                    list(o.codes),
                    o.failed,
                    o.copies,
                    o.copies_late,
                )
            )
        offset += b.seconds
    return Result(
        first.policy,
        first.load,
        offset,
        first.capacity,
        outcomes,
        sum(b.generated for b in blocks),
        ages=[a for b in blocks for a in b.ages],
        parts=tuple(b.goodput for b in blocks),
    )


def table(results: list[Result]) -> list[str]:
    head = "| policy | load | sent | on time | goodput/s | of C | engine answers' worth/s | wasted tokens | engine copies/req | copies after deadline | refusals (per attempt) | p50 s | p99 s | failed |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        refusals = ", ".join(f"{k}: {v}" for k, v in sorted(r.refusals().items())) or "-"
        n = len(r.outcomes)
        lines.append(
            f"| {r.policy} | {r.load:g}x | {n} | {len(r.on_time())} | {r.goodput:.3f} | {r.fraction:.2f} | {r.worth:.3f} | {r.wasted:.1%} | "
            f"{r.copies / max(n, 1):.2f} | {r.copies_late} | {refusals} | {r.quantile(0.5):.2f} | {r.quantile(0.99):.2f} | {r.failed} |"
        )
    return lines


def failed_lines(results: list[Result]) -> list[str]:
    """A FAILED line per policy and load with failed requests (its figures judge nothing)."""
    out = []
    for r in results:
        if r.failed:
            first = next(o.failed for o in r.outcomes if o.failed)
            out.append(f"FAILED: {r.policy} at {r.load:g}x: {r.failed} failed requests (first: {first})")
    return out


def age_checks(results: list[Result], service_ms: float, cap_ms: float, round_ms: float = ROUND_MS) -> list[str]:
    """Per door and load, the issue's check of the age each `reject_age_beats_slack` acted on:
    its distance from the client-side truth at the door's decision (within one round, the
    exporter's ``round_ms``), and the fresh requests (first attempts) it refused where the
    truth, even a round older, would not have been refused by the same clause of the rule:
    the age plus the expected service (``service_ms``) against the slack, or the age against
    the route's cap (``cap_ms``). Beside them, the issue's words taken alone: fresh requests
    refused while the oldest truly waiting was younger than the slack less a round (the
    service and the cap aside: those the rule refuses on purpose)."""

    def on_the_slack(a: AgeRefusal) -> bool:  # else the age cap refused it
        return a.door_ms + service_ms >= a.slack_ms

    def a_round_older_refuses(a: AgeRefusal) -> bool:  # the truth a round older meets the clause that refused `a`
        older = a.truth_ms + round_ms
        return older + service_ms >= a.slack_ms if on_the_slack(a) else older >= cap_ms

    lines = []
    for r in results:
        if not r.ages:
            continue
        diffs = sorted(a.door_ms - a.truth_ms for a in r.ages)
        off = sum(1 for d in diffs if abs(d) > round_ms)
        fresh = [a for a in r.ages if a.fresh]
        on_slack = sum(1 for a in fresh if on_the_slack(a))
        wrong = sum(1 for a in fresh if not a_round_older_refuses(a))
        words = [a for a in fresh if a.truth_ms < a.slack_ms - round_ms]
        words_cap = sum(1 for a in words if not on_the_slack(a) and a_round_older_refuses(a))
        words_service = sum(1 for a in words if on_the_slack(a) and a_round_older_refuses(a))
        lines.append(
            f"{r.policy} at {r.load:g}x: {len(r.ages)} reject_age_beats_slack ({len(fresh)} fresh, {len(r.ages) - len(fresh)} retries); "
            f"door age - client truth at the decision: median {percentile(diffs, 50) / 1000:+.2f} s, min {diffs[0] / 1000:+.2f} s, "
            f"max {diffs[-1] / 1000:+.2f} s, {off} more than a round ({round_ms / 1000:g} s) off; "
            f"fresh requests refused that the truth a round older would not have refused: {wrong} "
            f"(of {on_slack} on the slack with the expected service {service_ms:.0f} ms, {len(fresh) - on_slack} on the age cap {cap_ms:.0f} ms); "
            f"fresh requests refused while the oldest truly waiting was younger than the slack less a round: {len(words)} "
            f"({words_cap} of them over the age cap and {words_service} within the expected service of the slack, in truth)"
        )
    return lines


def yardstick(results: list[Result], doors: tuple[str, ...] = DOORS) -> list[str]:
    """C against the engine's own output in the windows. C is the closed loops run between
    the windows at each load (their mean judges that load); a window whose engine generated
    more than its C shows the engine faster then than C says, so the doors' goodput is
    printed against the largest output of any window too: a stricter reading, not a goal."""
    if not results:
        return []
    worth = {r.policy + f" at {r.load:g}x": r.worth for r in results}
    low, high = min(worth, key=lambda k: worth[k]), max(worth, key=lambda k: worth[k])
    top = worth[high]
    above = sum(1 for r in results if r.worth > r.capacity)
    cs = sorted({r.capacity for r in results})
    c = f"C {cs[0]:.3f}" if len(cs) == 1 else f"C {cs[0]:.3f} to {cs[-1]:.3f}"
    doors_at = [f"{r.policy} at {r.load:g}x {r.goodput / top:.2f}" for r in results if r.policy in doors and r.load > 1]
    return [
        f"the engine's own output in the windows: {worth[low]:.3f} ({low}) to {top:.3f} ({high}) answers' worth/s, against {c}"
        + (f": above its load's C in {above} windows, so C understated the engine then" if above else ""),
        f"the doors' goodput against the largest output of any window ({top:.3f}/s), a stricter reading than the goals': "
        + (", ".join(doors_at) or "none above 1x"),
    ]


def best_cap(results: list[Result], load: float) -> Result | None:
    caps = [r for r in results if r.policy.startswith("vllm cap") and r.load == load]
    return max(caps, key=lambda r: r.goodput) if caps else None


def goals(results: list[Result], prefix: str = "", doors: tuple[str, ...] = DOORS) -> list[str]:
    """The issue's "Done when", per door, judged on the figures as printed; each goal line is
    preceded by the comparison line its figures come from."""
    by = {(r.policy, r.load): r for r in results}
    lines = []
    for door in doors:
        mine = [r for r in results if r.policy == door]
        if not mine:
            continue
        for load in (2.0, 4.0):
            d, direct, cap = by.get((door, load)), by.get(("direct", load)), best_cap(results, load)
            if d is None or direct is None or cap is None:
                continue
            frac, over = printed(d.fraction), printed(d.goodput / cap.goodput if cap.goodput else math.inf)
            vs_direct = printed(d.goodput / direct.goodput if direct.goodput else math.inf)
            w = printed(d.wasted * 100, 1)
            lines.append(
                f"{prefix}{door} at {load:g}x: {frac:.2f} C; best cap {cap.policy} {printed(cap.fraction):.2f} C, {door}/cap {over:.2f}x; "
                f"direct {printed(direct.fraction):.2f} C, {door}/direct {vs_direct:.2f}x; wasted {w:.1f}%, direct {direct.wasted:.1%}; {d.failed} failed"
            )
            lines.append(
                goal_line(
                    f"{prefix}{door} at {load:g}x capacity: goodput >= {GOAL_CAPACITY:.0%} of C and >= {GOAL_OVER_CAP:g}x the best vLLM queue cap's "
                    f"(or >= {GOAL_NEAR_CAPACITY:.0%} of C where that is above it: C is the limit)",
                    f"{frac:.2f} C, {over:.2f}x {cap.policy} ({printed(cap.fraction):.2f} C); direct {printed(direct.fraction):.2f} C, "
                    f"{door}/direct {vs_direct:.2f}x; {d.failed} failed",
                    d.failed == 0 and frac >= GOAL_CAPACITY and (over >= GOAL_OVER_CAP or frac >= GOAL_NEAR_CAPACITY),
                )
            )
            lines.append(
                goal_line(
                    f"{prefix}{door} at {load:g}x: wasted engine tokens <= {GOAL_WASTED:.0%} of those generated",
                    f"{w:.1f}% (direct {direct.wasted:.1%}); {d.failed} failed",
                    d.failed == 0 and w <= GOAL_WASTED * 100,
                )
            )
        late, failed = sum(r.copies_late for r in mine), sum(r.failed for r in mine)
        direct_late = sum(r.copies_late for r in results if r.policy == "direct")
        lines.append(f"{prefix}{door}: {late} copies after a deadline at the engine over every load, direct {direct_late}; {failed} failed")
        lines.append(
            goal_line(
                f"{prefix}{door}: 0 copies reach the engine after their deadline, every load",
                f"{late} (direct {direct_late}); {failed} failed",
                failed == 0 and late == 0,
            )
        )
        under, base = by.get((door, 0.8)), by.get(("direct", 0.8))
        if under is not None and base is not None:
            g, dg = under.goodput, base.goodput
            gap = printed((dg - g) / dg * 100 if dg else math.inf, 1)
            side = f"{gap:.1f}% below" if gap >= 0 else f"{-gap:.1f}% above"

            def each(r: Result) -> str:
                return f" (blocks {' and '.join(f'{p:.3f}' for p in r.parts)})" if len(r.parts) > 1 else ""

            lines.append(f"{prefix}{door} at 0.8x: {g:.4f}/s{each(under)}, direct {dg:.4f}/s{each(base)}: {side} direct")
            lines.append(
                goal_line(
                    f"{prefix}{door} at 0.8x: goodput within {GOAL_UNDERLOAD:.0%} of direct's",
                    f"{g:.4f}/s against {dg:.4f}/s, {side}; {under.failed} failed",
                    under.failed == 0 and gap <= GOAL_UNDERLOAD * 100,
                )
            )
    return lines


COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")


def svg(results: list[Result], title: str) -> str:
    """Goodput (fraction of capacity) against offered load, one line per policy: a small
    hand-written SVG (no plotting library needed)."""
    w, h, left, right, top, bottom = 640, 380, 60, 170, 30, 45
    loads = sorted({r.load for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    ymax = max(1.0, *(r.fraction for r in results)) * 1.1
    xmin, xmax = min(loads), max(loads)

    def x(v: float) -> float:
        return left + (w - left - right) * ((v - xmin) / (xmax - xmin) if xmax > xmin else 0.5)

    def y(v: float) -> float:
        return h - bottom - (h - top - bottom) * v / ymax

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="14">{title}</text>',
        f'<line x1="{left}" y1="{y(0)}" x2="{w - right}" y2="{y(0)}" stroke="black"/>',
        f'<line x1="{left}" y1="{y(0)}" x2="{left}" y2="{top}" stroke="black"/>',
        f'<line x1="{left}" y1="{y(1):.1f}" x2="{w - right}" y2="{y(1):.1f}" stroke="#999" stroke-dasharray="4 3"/>',
        f'<text x="{w - right + 4}" y="{y(1) + 4:.1f}" fill="#666">capacity C</text>',
        f'<text x="{(left + w - right) / 2}" y="{h - 8}" text-anchor="middle">offered load (x capacity)</text>',
        f'<text x="14" y="{(top + h - bottom) / 2}" text-anchor="middle" transform="rotate(-90 14 {(top + h - bottom) / 2})">goodput (x capacity)</text>',
    ]
    for v in loads:
        out.append(f'<text x="{x(v):.1f}" y="{h - bottom + 16}" text-anchor="middle">{v:g}x</text>')
    for i in range(int(ymax / 0.25) + 1):
        v = i * 0.25
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for i, p in enumerate(policies):
        c = COLOURS[i % len(COLOURS)]
        pts = sorted({load: sum(fs) / len(fs) for load, fs in _fractions(results, p).items()}.items())
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{" ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in pts)}"/>')
        out += [f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{c}"/>' for a, b in pts]
        ly = top + 16 * i
        out.append(f'<line x1="{w - right + 8}" y1="{ly + 20}" x2="{w - right + 28}" y2="{ly + 20}" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{w - right + 32}" y="{ly + 24}">{p}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _fractions(results: list[Result], policy: str) -> dict[float, list[float]]:
    """A policy's fraction of C per load, every window (the plot draws their mean)."""
    out: dict[float, list[float]] = {}
    for r in results:
        if r.policy == policy:
            out.setdefault(r.load, []).append(r.fraction)
    return out


def write_svg(path: Path, results: list[Result], title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg(results, title), encoding="utf-8")
