"""bench_leases' hand-off, measured the same way on every Redis deployment, side by side.

`Handoffs` is the one hand-off measurement of bench_leases (one holder, one waiter blocked
in `LeaseClient.wait_for_gpu` on one GPU; release call start -> the waiter's successful
claim returned, and -> the waiting call returned), with its two clients kept open so it
can be run a few hand-offs at a time. `deployment_handoffs` starts the deployments (the
test topologies of tests/fixtures, real processes on loopback) one at a time, as a user
runs one (with all three alive, 14 server processes share the 2 cores and their timers
and gossip, not the deployment, set the tail), and runs each one's rows in interleaved
rounds, so a noisy machine slows the rows compared (WAIT 0 and 1) alike:

- one server, wait_replicas=0 (the default): a bare redis-server, the deployment as
  most run it;
- one server + 1 replica (a second redis-server, `replicaof` it), wait_replicas=0 and 1:
  WAIT needs a replica to answer it, so the WAIT row has one, and the row without WAIT on
  the same two servers isolates what WAIT itself costs;
- Sentinel (a primary, 2 replicas, 3 sentinels) and Cluster (3 primaries, 1 replica
  each), wait_replicas=0 and 1 (Cluster's default; Sentinel's default is every replica).

Only the waiter's claim is inside the timed window (the release is never confirmed by
WAIT), so with WAIT a hand-off holds one replication round trip more: the claim script,
then WAIT until one replica acknowledged it, on the same connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.fixtures.redis_server import RedisServer, RedisServerMissing
from tests.fixtures.redis_topology import ClusterTopology, SentinelTopology, command, linked, poll

from bench._goal import goal_line
from llm_health.store.deployment import NotReplicated
from llm_health.store.leases import LeaseClient
from llm_health.store.records import Pool

LONG = 3600.0
# The hand-off goal is a ratio of the run's own calibration figure (bench/_machine.py):
# p99 at most 0.4x it, 5 ms on a 12 ms machine, 12 ms on a 30 ms one.
GOAL_HANDOFF_CALIBRATION_RATIO = 0.4


def handoff_limit_ms(calibration: float) -> float:
    """The p99 hand-off goal of a run whose calibration read `calibration` ms (as printed)."""
    return round(GOAL_HANDOFF_CALIBRATION_RATIO * round(calibration, 1), 2)


DEPLOYMENTS = ("single", "sentinel", "cluster")


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


class Handoffs:
    """Hand-offs on one GPU between two clients of ``url``; ``run(n)`` appends n of them:
    ``to_claim`` (release call start -> the waiter's successful claim returned) and
    ``to_return`` (-> wait_for_gpu returned), in ms; ``via`` counts how each was won.

    The release comes 0-2 ms after the waiter is blocked: its first claim missed and no
    claim or topology refresh of it is in flight, nothing queued for it. On one server and
    Sentinel that is as soon as the first claim missed. The feed lingers between waits
    (``feed_linger_s``), so it is made once per row; where it is made again (a broken
    connection, a topology change on Cluster) it queues RESUBSCRIBED (the waiter
    re-checks every GPU) and the release waits for that (``settled`` counts these), so
    it is not won by the re-check."""

    def __init__(self, url: str):
        self.holder = LeaseClient.from_url(url)
        self.waiter = LeaseClient.from_url(url)
        self.pool = Pool("bench", ["g0"])
        self.to_claim: list[float] = []
        self.to_return: list[float] = []
        self.via: dict[str, int] = {}
        self.settled = 0  # hand-offs whose release waited for the waiter to be blocked (see run)
        self.holder_not_replicated = 0  # the holder's claims WAIT did not confirm (undone, sent again)
        self._claimed_at: list[float] = []
        self._in_flight = 0
        plain_claim = self.waiter.claim_any

        async def timed_claim(*args: Any, **kwargs: Any) -> Any:
            lease = await plain_claim(*args, **kwargs)
            if lease is not None:
                self._claimed_at.append(time.perf_counter())
            return lease

        self.waiter.claim_any = timed_claim  # type: ignore[method-assign]
        # Counted from the call on: every claim of wait_for_gpu, and the topology refresh its
        # Cluster feed makes when it is re-made.
        self._count(self.waiter, "_claim_cancel_safe")
        self._count(self.waiter.deployment, "refresh_topology")

    def _count(self, obj: Any, name: str) -> None:
        plain = getattr(obj, name)

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self._in_flight += 1
            try:
                return await plain(*args, **kwargs)
            finally:
                self._in_flight -= 1

        setattr(obj, name, counted)

    def _busy(self) -> bool:
        """The waiter is not blocked yet: a claim or topology refresh of it in flight, or
        something queued for it."""
        return self._in_flight > 0 or any(not q.empty() for q in self.waiter._feed.waiters)

    async def run(self, n: int) -> None:
        for _ in range(n):
            held = None
            while held is None:  # a claim no replica confirmed in time is undone: again (counted)
                try:
                    held = await self.holder.claim("g0", "holder")
                except NotReplicated:
                    self.holder_not_replicated += 1
            assert held is not None
            blocked = asyncio.Event()

            async def wait(blocked: asyncio.Event = blocked) -> tuple[Any, float]:
                async def on_miss() -> None:
                    blocked.set()

                lease = await self.waiter.wait_for_gpu(self.pool, "waiter", 10, fallback_interval_s=LONG, after_first_miss=on_miss)
                return lease, time.perf_counter()

            task = asyncio.create_task(wait())
            await blocked.wait()
            if self._busy():  # a re-made feed queued RESUBSCRIBED, and the waiter re-checks first
                self.settled += 1
                while self._busy():
                    await asyncio.sleep(0.0005)
            await asyncio.sleep(random.uniform(0, 0.002))
            self._claimed_at.clear()
            t0 = time.perf_counter()
            await self.holder.release(held)
            lease, t1 = await task
            assert lease is not None, "the waiter timed out"
            self.via[lease.via] = self.via.get(lease.via, 0) + 1
            self.to_claim.append((self._claimed_at[0] - t0) * 1000)
            self.to_return.append((t1 - t0) * 1000)
            await self.waiter.release(lease)

    @property
    def not_replicated(self) -> int:  # the waiter's claims that WAIT did not confirm (undone, retried)
        return self.waiter.not_replicated

    async def aclose(self) -> None:
        await self.holder.aclose()
        await self.waiter.aclose()


@dataclass
class Row:
    deployment: str  # as printed: "one server", "Sentinel", "Cluster"
    setup: str  # the servers
    wait: int  # wait_replicas
    url: str
    handoffs: Handoffs | None = None
    not_run: str = ""  # why it was not measured
    extra: dict[str, Any] = field(default_factory=dict)


def with_wait(url: str, wait: int | None) -> str:
    return url if wait is None else f"{url}{'&' if '?' in url else '?'}wait_replicas={wait}"


def _replicated_pair(stack: contextlib.ExitStack) -> RedisServer:
    """A redis-server with one replica (a second one, ``replicaof`` it), linked."""
    primary = stack.enter_context(RedisServer(extra_args=("--repl-diskless-sync-delay", "0")))
    replica = stack.enter_context(RedisServer(extra_args=("--replicaof", "127.0.0.1", str(primary.port))))
    poll(lambda: linked(replica.port, primary.port), 30.0, f"replica {replica.port} linked to {primary.port}")
    # Linked is not yet acknowledging: until a WAIT 1 is answered by it, a claim with WAIT
    # would be refused (NotReplicated, seen once at a row's first hand-off).
    poll(lambda: int(command(primary.port, "WAIT", 1, 200)) == 1 or None, 30.0, f"replica {replica.port} answering WAIT")
    return primary


def start_rows(stack: contextlib.ExitStack, single_url: str, which: tuple[str, ...], log: Callable[[str], None]) -> list[Row]:
    """Every row's servers, started (and stopped by ``stack``); a deployment whose programs are
    missing comes back as rows with ``not_run`` set."""
    rows: list[Row] = []
    for kind in which:
        started = time.monotonic()
        try:
            if kind == "single":
                primary = _replicated_pair(stack)
                rows += [
                    Row("one server", "1 redis-server, no replica", 0, with_wait(single_url, 0)),
                    Row("one server", "1 redis-server + 1 replica", 0, with_wait(primary.url, 0)),
                    Row("one server", "1 redis-server + 1 replica", 1, with_wait(primary.url, 1)),
                ]
            elif kind == "sentinel":
                topo = stack.enter_context(SentinelTopology())
                setup = "1 primary, 2 replicas, 3 sentinels"
                rows += [Row("Sentinel", setup, 0, with_wait(topo.url, 0)), Row("Sentinel", setup, 1, with_wait(topo.url, 1))]
            else:
                cluster = stack.enter_context(ClusterTopology())
                setup = "3 primaries, 1 replica each"
                rows += [Row("Cluster", setup, 0, with_wait(cluster.url, 0)), Row("Cluster", setup, 1, with_wait(cluster.url, 1))]
        except RedisServerMissing as e:
            name = {"single": "one server", "sentinel": "Sentinel", "cluster": "Cluster"}[kind]
            rows += [Row(name, "", w, "", not_run=str(e)) for w in (0, 1)]
            log(f"{name}: not run: {e}")
            continue
        log(f"{kind}: started in {time.monotonic() - started:.1f} s")
    return rows


async def measure_interleaved(rows: list[Row], n: int, rounds: int) -> None:
    """n hand-offs per row, in ``rounds`` rounds; each round runs every row once, in an order
    rotated by one each round (no row always first or last)."""
    live = [r for r in rows if not r.not_run]
    for r in live:
        r.handoffs = Handoffs(r.url)
    rounds = max(1, min(rounds, n))
    sizes = [n // rounds + (1 if i < n % rounds else 0) for i in range(rounds)]
    try:
        for i, size in enumerate(sizes):
            for r in live[i % len(live) :] + live[: i % len(live)]:
                assert r.handoffs is not None
                await r.handoffs.run(size)
    finally:
        for r in live:
            if r.handoffs is not None:
                await r.handoffs.aclose()


async def deployment_handoffs(single_url: str, n: int, rounds: int, limit_ms: float, which: tuple[str, ...] = DEPLOYMENTS) -> None:
    """Start the deployments, measure, print the table, the WAIT deltas and a goal line per deployment."""
    print()
    print(
        f"hand-off by deployment: the same hand-off, {n} per row; each deployment alone on the machine (started, measured, stopped), "
        f"its rows in {max(1, min(rounds, n))} interleaved rounds"
    )
    rows: list[Row] = []
    for kind in which:  # one at a time: a user runs one deployment, not three side by side
        with contextlib.ExitStack() as stack:
            mine = start_rows(stack, single_url, (kind,), print)
            await measure_interleaved(mine, n, rounds)
        rows += mine
    print(
        f"{'deployment':<11} {'servers':<35} {'WAIT':>4} {'n':>5} {'claim p50':>9} {'claim p99':>9} "
        f"{'call p50':>9} {'call p90':>9} {'call p99':>9} {'call max':>9}  woken by"
    )
    for r in rows:
        wait = str(r.wait)
        if r.handoffs is None:
            print(f"{r.deployment:<11} {'-':<35} {wait:>4} {'n/a: not run (' + r.not_run + ')'}")
            continue
        h = r.handoffs
        woken = ", ".join(f"{k} {v}" for k, v in sorted(h.via.items(), key=lambda kv: -kv[1]))
        if h.not_replicated or h.holder_not_replicated:
            woken += f"; {h.not_replicated + h.holder_not_replicated} claim(s) not replicated, undone"
        if failovers := h.waiter.deployment.failovers_seen:
            woken += f"; feed re-made as a topology change {failovers}x"
        if h.settled:
            woken += f"; release held until the waiter blocked {h.settled}x"
        print(
            f"{r.deployment:<11} {r.setup:<35} {wait:>4} {len(h.to_return):>5} {statistics.median(h.to_claim):>9.3f} {pct(h.to_claim, 99):>9.3f} "
            f"{statistics.median(h.to_return):>9.3f} {pct(h.to_return, 90):>9.3f} {pct(h.to_return, 99):>9.3f} {max(h.to_return):>9.3f}  {woken}"
        )
    print(
        "WAIT: wait_replicas (1: the claim counts once one replica acknowledged it); claim: to the waiter's claim returned; call: to wait_for_gpu returned; ms"
    )
    print(
        "the waiter's keyevent feed stays subscribed between its waits (feed_linger_s, 10 s); the release comes once the waiter is blocked: "
        "no claim or topology refresh of it in flight, nothing queued for it"
    )
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.deployment, []).append(r)
    for name, group in by.items():
        pairs = [(a, b) for a in group for b in group if a.wait == 0 and b.wait == 1 and a.setup == b.setup and a.handoffs and b.handoffs]
        for a, b in pairs:
            assert a.handoffs is not None and b.handoffs is not None
            d50 = statistics.median(b.handoffs.to_return) - statistics.median(a.handoffs.to_return)
            d50c = statistics.median(b.handoffs.to_claim) - statistics.median(a.handoffs.to_claim)
            d99 = pct(b.handoffs.to_return, 99) - pct(a.handoffs.to_return, 99)
            print(f"{name} ({a.setup}): WAIT 1 vs 0, to the call's return: p50 {d50:+.3f} ms, p99 {d99:+.3f} ms; to the claim's return: p50 {d50c:+.3f} ms")
    for name, group in by.items():
        goal = (
            f"hand-off p99 at most {GOAL_HANDOFF_CALIBRATION_RATIO:g}x the calibration ({limit_ms:.2f} ms) on loopback on {name}, "
            "to wait_for_gpu returning, with and without WAIT"
        )
        if any(r.handoffs is None for r in group):
            print(goal_line(goal, f"not run ({next(r.not_run for r in group if r.not_run)})", False))
            continue
        figures = [(r, pct(r.handoffs.to_return, 99)) for r in group if r.handoffs is not None]
        parts = []
        for r, p99 in figures:
            where = f", {r.setup}" if name == "one server" else ""
            parts.append(f"{p99:.3f} ms {'with WAIT' if r.wait else 'without WAIT'}{where}")
        print(goal_line(goal, "p99 " + "; ".join(parts), all(float(f"{p99:.3f}") <= limit_ms for _, p99 in figures)))
