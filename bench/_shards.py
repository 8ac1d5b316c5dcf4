"""What 100,000 backends take in shards, projected by bench_scale from the cost of a backend
round it measured in the same run: generated backend names split by the exporter's own shard
function (core.shard.hashmod, Prometheus' `hashmod` of the name), and each shard's share of
one core at 10 s rounds taken as its backend count times that cost. The largest shard is the
one that must fit; a hash split is not an even one, so it holds more than the mean.

The projection is linear in backends: a shard's fixed costs (its event loop, its scrape) are
charged per backend as in the measured run, on the machine the run measured.

Printed: the largest and smallest shard and the largest's share of one core for 10, 16, 20
and 32 shards, and the fewest shards whose largest is under one core and under SHARD_HEADROOM
of one, beside what a round at the one-core cost (`goal_round_ms`, 1 ms: 10,000 backends in
one core at 10 s rounds) needs with the same split. A projection, labelled so: it judges no
goal (bench/_unjudged.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from bench._goal import printed
from bench._unjudged import projected_line
from llm_health.core.shard import hashmod

FLEET = 100_000
COUNTS = (10, 16, 20, 32)
SHARD_HEADROOM = 70.0  # percent of one core the largest shard is to stay under
ROUND_S = 10.0  # the round the shares are for
MAX_SHARDS = 1000  # the search's end: past it, a projection from one run's round cost says little


def fleet_hashes(count: int) -> list[int]:
    """hashmod(name, 2**64) of each name, as bench_scale's own fleet names them (b0, b1, ...):
    the whole 64-bit hash, so that `h % shards` is hashmod(name, shards) without hashing the
    fleet again for every shard count. MD5 spreads any set of distinct names alike."""
    return [hashmod(f"b{i}", 2**64) for i in range(count)]


@dataclass(frozen=True)
class Split:
    shards: int
    largest: int  # backends in the largest shard
    smallest: int
    percent: float  # the largest shard's share of one core at 10 s rounds, as printed (1 decimal)


def split(fleet: list[int], shards: int, round_ms: float) -> Split:
    sizes = Counter(h % shards for h in fleet)
    smallest = min(sizes.values()) if len(sizes) == shards else 0
    largest = max(sizes.values())
    return Split(shards, largest, smallest, printed(100 * largest * round_ms / 1000 / ROUND_S, 1))


def fewest(fleet: list[int], round_ms: float, under_percent: float) -> Split | None:
    """The smallest shard count whose largest shard's share (as printed) is under
    `under_percent` of one core, or None when none up to MAX_SHARDS is. The search starts
    where an even split would fit: with fewer shards the mean shard is already over."""
    total_percent = 100 * len(fleet) * round_ms / 1000 / ROUND_S
    for shards in range(max(1, math.ceil(total_percent / under_percent)), MAX_SHARDS + 1):
        if (s := split(fleet, shards, round_ms)).percent < under_percent:
            return s
    return None


def _fewest(s: Split | None) -> str:
    return f"{s.shards} ({s.largest:,} backends, {s.percent:.1f}%)" if s else f"none up to {MAX_SHARDS}"


def report(backends: int, per_round_ms: float, goal_round_ms: float) -> tuple[list[str], str]:
    """The table for FLEET backends from a round's CPU ms measured at `backends` (taken as
    printed, 3 decimals, so the table can be recomputed from the line that states it), and
    the projected line."""
    round_ms = printed(per_round_ms, 3)
    fleet = fleet_hashes(FLEET)
    core = fewest(fleet, round_ms, 100.0)
    headroom = fewest(fleet, round_ms, SHARD_HEADROOM)
    at_goal = fewest(fleet, goal_round_ms, SHARD_HEADROOM)
    if at_goal is None:
        raise ValueError(f"no shard count up to {MAX_SHARDS} fits {FLEET} backends at {goal_round_ms} ms a round")
    lines = [
        f"shards for {FLEET} backends at 10 s rounds, projected: names b0..b{FLEET - 1} split by core.shard.hashmod "
        f"(Prometheus' hashmod), a shard's CPU its backends x the {round_ms:.3f} ms a backend round cost here at {backends} backends",
        "  shards   largest  smallest  the largest's share of one core",
    ]
    for count in sorted({*COUNTS, *(s.shards for s in (core, headroom) if s)}):
        s = split(fleet, count, round_ms)
        lines.append(f"  {s.shards:6d}  {s.largest:8,}  {s.smallest:8,}  {s.percent:.1f}%")
    lines.append(
        f"fewest shards with the largest under one core: {_fewest(core)}; under {SHARD_HEADROOM:g}% of one core: {_fewest(headroom)}; "
        f"under {SHARD_HEADROOM:g}% at the {goal_round_ms:.3f} ms a round the one-core goal allows: {_fewest(at_goal)}"
    )
    what = (
        f"{FLEET} backends at 10 s rounds split by hashmod, from a round's cost at {backends} backends: the fewest shards with the largest "
        f"under {SHARD_HEADROOM:g}% of one core (at the one-core round of {goal_round_ms:g} ms: {at_goal.shards})"
    )
    if headroom is None:
        return lines, projected_line(what, f"no shard count up to {MAX_SHARDS}")
    return lines, projected_line(what, f"{headroom.shards} shards, the largest {headroom.largest:,} backends at {headroom.percent:.1f}% of one core")
