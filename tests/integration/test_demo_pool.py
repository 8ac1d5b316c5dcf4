"""The demo's GPU pool (sim/gpu_pool.py) counts a double holder only when two leases on
one GPU could both be valid by their holders' own clocks. A job whose heartbeat gave its
lease up (a stalled machine: the renewal came too late) stopped at that moment, and
Redis hands the GPU to another job only after the lease expired there: a lost lease, not
a double holder. The demo's verdict once failed in CI on exactly that: the live holder
was counted as holding "until it lets go", after its lease had already expired.

On a real redis-server; the stall is the test blocking the event loop for twice the TTL."""

from __future__ import annotations

import asyncio
import time

from llm_health.sim.demo_view import Parts, proofs
from llm_health.sim.gpu_pool import GpuPool
from llm_health.sim.stalls import StallWatch, starved_s
from llm_health.store.records import Lease, Pool


def _lease(gpu: str, holder: str) -> Lease:
    return Lease(gpu=gpu, holder=holder, token=1, ttl_ms=1000, claimed_ms=0, sent_at=time.monotonic())


async def test_a_claim_counts_double_only_while_the_other_lease_could_be_valid(redis_url: str):
    pool = GpuPool(redis_url, Pool("p", ["g0"]), jobs=0)
    try:
        now = time.monotonic()
        pool._won("job-1", _lease("g0", "job-1"), lambda: now + 60)  # valid for a minute yet
        pool._won("job-2", _lease("g0", "job-2"), lambda: now + 60)
        assert pool.figures.double_holders == 1
        assert pool.figures.doubles == ["job-2 claimed g0 (via claim) while the lease of job-1 on it was valid"]

        pool._let_go("job-1", "g0")
        pool._let_go("job-2", "g0")
        pool._won("job-3", _lease("g0", "job-3"), lambda: now - 0.5)  # its lease could have expired already
        pool._won("job-4", _lease("g0", "job-4"), lambda: now + 60)
        assert pool.figures.double_holders == 1  # job-3's lease was no longer valid by its own clock
        pool._won("job-5", _lease("g0", "job-5"), lambda: now + 60)
        assert pool.figures.double_holders == 2  # job-4's is
        assert pool.figures.doubles[1] == "job-5 claimed g0 (via claim) while the lease of job-4 on it was valid"
    finally:
        await pool.client.aclose()


async def test_a_stalled_holder_loses_its_lease_and_is_no_double_holder(redis_url: str):
    pool = GpuPool(redis_url, Pool("p", ["g0"]), jobs=2, ttl_ms=1000, work_s=(30.0, 30.0), crash_after=3600.0)
    stalls = StallWatch()
    stalls.start()
    await pool.start()
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        while not ("g0" in pool.figures.holders and pool.figures.waiting):
            assert loop.time() < end, f"no holder and waiter on g0: {pool.figures}"
            await asyncio.sleep(0.01)
        first = pool.figures.holders["g0"]

        time.sleep(2.0)  # the machine stalls: no renewal can be sent, the lease expires in Redis

        end = loop.time() + 30
        while pool.figures.holders.get("g0") in (None, first):
            assert loop.time() < end, f"the waiter never got g0: {pool.figures}"
            await asyncio.sleep(0.01)
        assert pool.figures.lost >= 1, pool.figures.log
        assert any(f"{first} lost its lease on g0" in e for e in pool.figures.log), pool.figures.log
        assert pool.figures.double_holders == 0, pool.figures.log
        assert stalls.longest_s >= 1.0 and stalls.noted  # the watch saw the 2 s block
        parts = Parts(exporter=None, exporter_url="", pool=pool, route=None, alerts=None, skipped={}, stalls=stalls)
        line = next(p for p in proofs(parts, {}, set()) if p.line.startswith("double lease holders"))
        assert line.ok and line.line.startswith("double lease holders: 0 (leases given up by a late heartbeat: "), line.line
        assert "longest event-loop stall " in line.line, line.line
    finally:
        await pool.stop()
        await stalls.stop()


async def test_the_stall_watch_notes_a_starved_loop():
    watch = StallWatch()
    watch.start()
    try:
        await asyncio.sleep(0.2)
        time.sleep(1.5)  # starved: the thread holds no CPU, as when the machine does not schedule it
        await asyncio.sleep(0.2)
        assert len(watch.noted) >= 1 and watch.longest_s >= 1.0
        start, end = watch.noted[-1]
        assert end - start >= 1.0 and watch.stalled_between(start + 0.1, start + 0.2) and not watch.stalled_between(end + 0.1, end + 5)
    finally:
        await watch.stop()


def test_only_time_off_the_cpu_counts_as_starvation():
    assert starved_s(1.5, 0.0) == 1.5  # asleep or unscheduled the whole stall
    assert starved_s(1.5, 1.5) == 0.0  # the loop's own code ran the whole stall: a product defect, not excused
    assert starved_s(3.0, 1.5) == 1.5  # own code on a loaded machine: only the unscheduled part
    assert starved_s(0.01, 0.05) == 0.0
