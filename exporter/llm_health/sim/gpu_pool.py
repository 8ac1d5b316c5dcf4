"""The demo's GPU pool: simulated jobs that lease GPUs through the lease library on a real
Redis (claim or wait for a free GPU, heartbeat renewals while they work, release), and
one job that crashes holding its lease, which then expires.

Every figure is counted here as it happens: claims and how each was won (`claim`: first
try; `del` or `expired`: a waiter woken by that keyspace event; `fallback`: the slow
re-check), renewals, releases, the crashed lease's expiry. A double holder is a claim
won while another job's lease on the same GPU could still be valid by that job's own
clock: two jobs that could both be writing to one GPU. A live holder counts until it
stops working (before it sends its release) or until its lease could have expired by
its heartbeat's reckoning (the last confirmed renewal's send time plus the TTL),
whichever comes first; the crashed one until its TTL from its claim. A job whose
heartbeat gave the lease up (a renewal that came too late, as on a stalled machine)
stopped at that moment, and Redis lets another job have the GPU only later, so that is
counted apart (`lost`), not as a double holder.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from ..store.leases import LeaseClient
from ..store.records import Lease, Pool


@dataclass
class PoolFigures:
    claims: Counter[str] = field(default_factory=Counter)  # by `via`
    renewals: int = 0
    releases: int = 0
    double_holders: int = 0
    lost: int = 0  # leases given up by their own heartbeat before they could expire
    doubles: list[str] = field(default_factory=list)  # the first few double holders, kept for the verdict
    crashed: str = ""  # "job-crash on g2" once it crashed
    crash_ttl_ms: int = 0
    expired_taken_by: str = ""  # the job that claimed the crashed job's GPU, and how
    expired_taken_after_s: float | None = None  # from the crash to that claim
    holders: dict[str, str] = field(default_factory=dict)  # gpu -> job, now
    waiting: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)  # the last few events


class GpuPool:
    """`jobs` jobs sharing the pool's GPUs; `crash_after` seconds in, one more job claims a
    GPU and dies without releasing it (its lease expires `crash_ttl_ms` later)."""

    def __init__(
        self,
        redis_url: str,
        pool: Pool,
        jobs: int = 6,
        ttl_ms: int = 3000,
        work_s: tuple[float, float] = (2.0, 5.0),
        crash_after: float = 3.0,
        crash_ttl_ms: int = 4000,
    ):
        self.pool, self.jobs, self.ttl_ms, self.work_s = pool, jobs, ttl_ms, work_s
        self.crash_after, self.crash_ttl_ms = crash_after, crash_ttl_ms
        self.client = LeaseClient.from_url(redis_url, fallback_interval_s=1.0)
        self.figures = PoolFigures(crash_ttl_ms=crash_ttl_ms)
        # gpu -> {job: when its lease could expire by its own clock (monotonic), asked at each claim}
        self._valid_until: dict[str, dict[str, Callable[[], float]]] = {g: {} for g in pool.gpus}
        self._crash_at: float | None = None
        self._crashed_gpu = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._rng = random.Random(7)

    async def start(self) -> None:
        await self.client.check_notifications()  # raises, naming the CONFIG SET, if events are off
        self._tasks = [asyncio.create_task(self._job(f"job-{i + 1}")) for i in range(self.jobs)]
        self._tasks.append(asyncio.create_task(self._crashing_job("job-crash")))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()

    def _event(self, what: str) -> None:
        self.figures.log = [*self.figures.log[-5:], what]

    def _won(self, job: str, lease: Lease, valid_until: Callable[[], float]) -> None:
        now = time.monotonic()
        others = self._valid_until[lease.gpu]
        clash = [other for other, until in others.items() if other != job and until() > now]
        if clash:
            self.figures.double_holders += 1
            what = f"{job} claimed {lease.gpu} (via {lease.via}) while the lease of {', '.join(clash)} on it was valid"
            if len(self.figures.doubles) < 3:
                self.figures.doubles.append(what)
            self._event(f"DOUBLE HOLDER: {what}")
        others[job] = valid_until
        self.figures.claims[lease.via] += 1
        self.figures.holders[lease.gpu] = job
        if lease.gpu == self._crashed_gpu and self._crash_at is not None and not self.figures.expired_taken_by:
            self.figures.expired_taken_by = f"{job} (via {lease.via})"
            self.figures.expired_taken_after_s = now - self._crash_at
            self._event(f"{job} woken by `{lease.via}`: claimed {lease.gpu} {self.figures.expired_taken_after_s:.1f} s after the crash")
        elif lease.via != "claim":
            self._event(f"{job} woken by `{lease.via}`: claimed {lease.gpu}")

    def _let_go(self, job: str, gpu: str) -> None:
        self._valid_until[gpu].pop(job, None)
        if self.figures.holders.get(gpu) == job:
            del self.figures.holders[gpu]

    async def _job(self, job: str) -> None:
        await asyncio.sleep(self._rng.uniform(0.0, 1.0))
        while True:
            self.figures.waiting.add(job)
            try:
                lease = await self.client.wait_for_gpu(self.pool, job, timeout=60, ttl_ms=self.ttl_ms, job_id=job)
            finally:
                self.figures.waiting.discard(job)
            if lease is None:
                continue
            hb = self.client.heartbeat(lease)
            self._won(job, lease, partial(getattr, hb, "valid_until"))  # until it lets go, or its lease could expire
            try:
                await asyncio.wait_for(hb.lost.wait(), self._rng.uniform(*self.work_s))
                self.figures.lost += 1
                self._event(f"{job} lost its lease on {lease.gpu}: {hb.reason}")
            except TimeoutError:
                pass  # the work is done
            finally:
                await hb.stop()
                self.figures.renewals += hb.renewals
            self._let_go(job, lease.gpu)  # it has stopped working on the GPU: then it releases
            if not hb.lost.is_set() and await self.client.release(lease):
                self.figures.releases += 1
            await asyncio.sleep(self._rng.uniform(0.2, 1.0))

    async def _crashing_job(self, job: str) -> None:
        """Claims a GPU, works a second, then dies: no renewal, no release."""
        await asyncio.sleep(self.crash_after)
        lease = None
        while lease is None:
            lease = await self.client.wait_for_gpu(self.pool, job, timeout=60, ttl_ms=self.crash_ttl_ms, job_id=job)
        expires = lease.sent_at + lease.ttl_ms / 1000  # by its own clock: a TTL from its claim
        self._won(job, lease, lambda: expires)
        await asyncio.sleep(1.0)
        self._crash_at, self._crashed_gpu = time.monotonic(), lease.gpu
        self.figures.crashed = f"{job} on {lease.gpu}"
        self._event(f"{job} crashed holding {lease.gpu} (lease TTL {lease.ttl_ms} ms, never renewed)")
        if self.figures.holders.get(lease.gpu) == job:
            del self.figures.holders[lease.gpu]
        await asyncio.Event().wait()  # dead: it gives nothing back
