"""GPU leases against a real redis-server (fixtures: tests/conftest_redis.py).

No test asserts a wall-clock time: timeouts below are failure bounds only. Async tests
run under `asyncio_mode = "auto"` (pyproject); async fixtures use pytest_asyncio.fixture.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from llm_health.store.feed import keyevent_channels
from llm_health.store.keys import LeaseKeys
from llm_health.store.leases import LeaseClient
from llm_health.store.records import KeyspaceEventsOff, Lease, LeaseLost, Pool
from tests.fixtures.redis_ops import keyevent_subscribers, kill_our_feeds, our_feeds, set_everywhere


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    """Every test of this module on one server, Sentinel and Cluster (tests/fixtures/redis_any.py)."""
    return any_redis_url


LONG = 3600.0  # a fallback interval no test lives long enough to reach


@pytest_asyncio.fixture
async def client(redis_url: str):
    # No linger: the feed closes as its last waiter leaves (the linger: test_lease_waiting.py).
    c = LeaseClient.from_url(redis_url, ttl_ms=10_000, feed_linger_s=0)
    try:
        yield c
    finally:
        await c.aclose()


async def eventually(predicate, what: str, bound_s: float = 10.0):
    """Poll an async predicate until it holds; fail after a generous bound."""
    loop = asyncio.get_running_loop()
    end = loop.time() + bound_s
    while True:
        value = await predicate()
        if value:
            return value
        if loop.time() > end:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.01)


async def no_feed_left(c: LeaseClient) -> None:
    """Eventually: Redis drops a closed connection's subscriptions when it reads the close."""

    async def none() -> bool:
        return await subscribers(c) == 0

    await eventually(none, "no keyevent subscription left")


async def subscribers(c: LeaseClient) -> int:
    """Keyevent subscribers on every primary, per primary (Cluster has one feed on each)."""
    return await keyevent_subscribers(c.deployment) // len(await c.deployment.primaries())


# ----------------------------------------------------------------------------- claim


async def test_claim_has_exactly_one_winner(client: LeaseClient):
    results = await asyncio.gather(*(client.claim("g0", f"w{i}") for i in range(50)))
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    state = await client.read("g0")
    assert state is not None and state.holder == winners[0].holder
    assert state.token == winners[0].token


async def test_old_style_scheduler_reads_and_writes_the_same_keys(client: LeaseClient):
    r = client.redis
    # An old scheduler claims g0 the old way: our claim must lose...
    assert await r.set(client.keys.lease("g0"), "old-worker", nx=True, px=10_000)
    assert await client.claim("g0", "new") is None
    state = await client.read("g0")
    assert state is not None and state.holder == "old-worker" and state.token is None
    assert not await client.check_fence("g0", 1)
    # ...and our lease's value is the plain holder id an old reader compares with.
    lease = await client.claim("g1", "new-worker", job_id="job-1")
    assert lease is not None
    assert await r.get(client.keys.lease("g1")) == "new-worker"
    assert await r.set(client.keys.lease("g1"), "old-worker", nx=True, px=10_000) is None
    # The side hash has the same TTL as the lease.
    assert await r.pttl(client.keys.info("g1")) > 0
    assert await r.hget(client.keys.info("g1"), "job_id") == "job-1"
    # The old scheduler's own release (plain DEL) frees the GPU for us.
    await r.delete(client.keys.lease("g0"))
    assert await client.claim("g0", "new") is not None


async def test_lease_prefix_is_configurable(redis_url: str):
    c = LeaseClient.from_url(redis_url, keys=LeaseKeys("sched:gpu:lease:"))
    try:
        lease = await c.claim("g0", "w")
        assert lease is not None
        assert c.keys.lease("g0") in ("sched:gpu:lease:g0", "sched:gpu:lease:{g0}")  # one server / Cluster
        assert await c.redis.get(c.keys.lease("g0")) == "w"
        assert await c.redis.exists(c.keys.info("g0"), c.keys.fence("g0")) == 2
    finally:
        await c.aclose()


# ----------------------------------------------------------------------------- contention


async def test_many_tasks_on_few_gpus_never_share_a_gpu(client: LeaseClient):
    pool = Pool("p", ["g0", "g1", "g2"])
    occupancy: dict[str, str] = {}
    double_claims: list[tuple[str, str, str]] = []
    done: list[str] = []

    async def job(name: str) -> None:
        lease = await client.wait_for_gpu(pool, name, timeout=60)
        assert lease is not None, f"{name} never got a GPU"
        if lease.gpu in occupancy:
            double_claims.append((lease.gpu, occupancy[lease.gpu], name))
        occupancy[lease.gpu] = name
        assert await client.check_fence(lease.gpu, lease.token)
        await asyncio.sleep(random.uniform(0, 0.004))
        if occupancy.get(lease.gpu) != name:
            double_claims.append((lease.gpu, occupancy.get(lease.gpu, "?"), name))
        del occupancy[lease.gpu]
        assert await client.release(lease)
        done.append(name)

    names = [f"job{i}" for i in range(40)]
    await asyncio.gather(*(job(n) for n in names))
    assert double_claims == []
    assert sorted(done) == sorted(names)
    assert await client.redis.zcard(client.keys.waiters("p")) == 0
    await no_feed_left(client)


# ----------------------------------------------------------------------------- crash


async def test_crashed_holder_frees_its_gpu_by_the_expired_event(client: LeaseClient):
    pool = Pool("p", ["g0"])
    doomed = await client.claim("g0", "doomed", ttl_ms=300)
    assert doomed is not None

    async def job_that_dies() -> None:
        await asyncio.sleep(LONG)  # never releases; killed below

    task = asyncio.create_task(job_that_dies())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The fallback re-check would only run in an hour: only the event can wake it.
    lease = await client.wait_for_gpu(pool, "next", timeout=30, fallback_interval_s=LONG)
    assert lease is not None, "the waiter was not woken"
    assert lease.via == "expired"
    assert lease.token > doomed.token


# ----------------------------------------------------------------------------- race


async def naive_wait(c: LeaseClient, pool: Pool, holder: str, timeout: float, after_first_miss) -> Lease | None:
    """Check first, subscribe after: the order that loses a release fired in between."""
    lease = await c.claim_any(pool.gpus, holder)
    if lease is not None:
        return lease
    await after_first_miss()
    pubsub = c.redis.pubsub()  # one server or Sentinel's primary (the test skips this on Cluster)
    try:
        await pubsub.subscribe(*keyevent_channels(c.db))
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=end - loop.time())
            if msg and c.keys.gpu_of(msg["data"]) in pool.gpus:
                got = await c.claim(c.keys.gpu_of(msg["data"]), holder)
                if got is not None:
                    return got
        return None
    finally:
        await pubsub.aclose()


async def test_release_between_check_and_wait_is_not_lost(client: LeaseClient):
    pool = Pool("p", ["g0"])

    async def hold_then_release_on_first_miss():
        held = await client.claim("g0", "holder")
        assert held is not None

        async def release_now() -> None:
            assert await client.release(held)

        return release_now

    # Ours: subscribed before the first claim, so the del is already on our feed.
    hook = await hold_then_release_on_first_miss()
    lease = await client.wait_for_gpu(pool, "ours", timeout=30, fallback_interval_s=LONG, after_first_miss=hook)
    assert lease is not None and lease.via == "del"
    assert await client.release(lease)

    # The naive order misses the very same interleaving and waits out its timeout
    # although the GPU is free the whole time (shown on one primary: on Cluster the
    # naive subscription would need a connection per node).
    if client.deployment.kind == "cluster":
        return
    hook = await hold_then_release_on_first_miss()
    assert await naive_wait(client, pool, "naive", 0.5, hook) is None
    assert await client.read("g0") is None


# ----------------------------------------------------------------------------- stale holder


async def test_stale_holder_is_refused_and_has_the_older_token(client: LeaseClient):
    pool = Pool("p", ["g0"])
    stale = await client.claim("g0", "w1", ttl_ms=200)
    assert stale is not None
    # While it holds the lease, the same holder claiming again gets the same lease back
    # (a claim re-sent after a lost reply must not take a second GPU or a new token).
    again = await client.claim_any(["g0", "g1"], "w1", ttl_ms=200)
    assert again is not None and (again.gpu, again.token) == ("g0", stale.token)
    # Same worker id, new claim after the expiry: only the token tells them apart.
    while await client.read("g0") is not None:
        await asyncio.sleep(0.02)
    fresh = await client.wait_for_gpu(pool, "w1", timeout=30, fallback_interval_s=LONG)
    assert fresh is not None
    assert fresh.token > stale.token
    assert not await client.renew(stale)
    assert not await client.release(stale)
    assert not await client.check_fence("g0", stale.token)
    assert await client.check_fence("g0", fresh.token)
    state = await client.read("g0")
    assert state is not None and state.token == fresh.token
    assert await client.renew(fresh)
    assert await client.release(fresh)
    assert not await client.check_fence("g0", fresh.token)


# ----------------------------------------------------------------------------- heartbeat


async def test_heartbeat_keeps_a_long_job_leased(client: LeaseClient):
    lease = await client.claim("g0", "w", ttl_ms=1_500)
    assert lease is not None
    seen: list[bool] = []

    async def long_job() -> str:
        for _ in range(25):  # 2.5 s: well past the 1.5 s TTL
            await asyncio.sleep(0.1)
            seen.append(await client.check_fence("g0", lease.token))
        return "done"

    assert await client.run_leased(lease, long_job(), interval_s=0.1) == "done"
    assert all(seen)
    assert await client.read("g0") is None  # released at the end


async def test_failed_renewal_cancels_the_job(client: LeaseClient):
    lease = await client.claim("g0", "w", ttl_ms=10_000)
    assert lease is not None
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def steal() -> None:
        await started.wait()
        await client.redis.delete(client.keys.lease("g0"))  # e.g. a reconcile, or an operator
        assert await client.claim("g0", "thief") is not None

    stealer = asyncio.create_task(steal())
    with pytest.raises(LeaseLost) as lost:
        await client.run_leased(lease, job(), interval_s=0.02)
    await stealer
    assert cancelled.is_set()
    assert "refused" in lost.value.reason
    state = await client.read("g0")
    assert state is not None and state.holder == "thief"  # the thief's lease is untouched


async def test_heartbeat_sets_an_event_the_job_can_watch(client: LeaseClient):
    lease = await client.claim("g0", "w", ttl_ms=10_000)
    assert lease is not None
    hb = client.heartbeat(lease, interval_s=0.02)
    try:
        await client.redis.delete(client.keys.lease("g0"))
        await asyncio.wait_for(hb.lost.wait(), 10)
        assert hb.reason and "refused" in hb.reason
    finally:
        await hb.stop()


# ----------------------------------------------------------------------------- waiting


async def test_timeout_and_cancel_leave_no_subscription_and_no_waiter(client: LeaseClient):
    pool = Pool("p", ["g0"])
    assert await client.claim("g0", "busy") is not None

    assert await client.wait_for_gpu(pool, "late", timeout=0.2) is None
    await no_feed_left(client)
    assert await client.redis.zcard(client.keys.waiters("p")) == 0

    task = asyncio.create_task(client.wait_for_gpu(pool, "cancelled", timeout=60))

    async def waiting() -> bool:
        return await client.redis.zcard(client.keys.waiters("p")) == 1

    await eventually(waiting, "the waiter to be listed")
    assert await subscribers(client) == 2  # del and expired
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await no_feed_left(client)
    assert await client.redis.zcard(client.keys.waiters("p")) == 0


async def test_waiters_share_one_feed_that_survives_a_broken_connection(client: LeaseClient):
    pool = Pool("p", ["g0"])
    held = await client.claim("g0", "busy")
    assert held is not None
    tasks = [asyncio.create_task(client.wait_for_gpu(pool, f"w{i}", timeout=60, fallback_interval_s=LONG)) for i in range(10)]

    async def all_waiting() -> bool:
        return await client.redis.zcard(client.keys.waiters("p")) == 10

    await eventually(all_waiting, "ten waiters")
    # One connection for all (per primary: keyevents are node-local on Cluster).
    assert len(await our_feeds(client.deployment)) == len(await client.deployment.primaries())
    # A release the feed cannot see (events off), then the feed's connection breaks:
    # only the re-subscription (which re-checks every GPU) can find the free GPU.
    await set_everywhere(client.deployment, "notify-keyspace-events", "")
    assert await client.release(held)
    await set_everywhere(client.deployment, "notify-keyspace-events", "Egx")
    assert await kill_our_feeds(client.deployment) >= 1
    done, pending = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1
    winner = done.pop().result()
    assert winner is not None and winner.via == "resubscribe"
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await no_feed_left(client)
    assert await client.redis.zcard(client.keys.waiters("p")) == 0


async def test_a_short_waiter_never_shortens_the_waiter_list_ttl(client: LeaseClient):
    pool = Pool("p", ["g0"])
    assert await client.claim("g0", "busy")
    long = asyncio.create_task(client.wait_for_gpu(pool, "long", timeout=600))

    async def listed() -> bool:
        return await client.redis.zcard(client.keys.waiters("p")) == 1

    await eventually(listed, "the long waiter")
    assert await client.wait_for_gpu(pool, "short", timeout=0.1) is None
    assert await client.redis.pttl(client.keys.waiters("p")) > 500_000  # still the long one's
    long.cancel()
    await asyncio.gather(long, return_exceptions=True)
    assert await client.redis.zcard(client.keys.waiters("p")) == 0


async def test_waiter_that_wins_first_try_never_waits(client: LeaseClient):
    lease = await client.wait_for_gpu(Pool("p", ["g0", "g1"]), "w", timeout=5)
    assert lease is not None and lease.via == "claim"
    await no_feed_left(client)


async def test_fallback_recheck_finds_a_gpu_freed_without_an_event(client: LeaseClient):
    pool = Pool("p", ["g0"])
    held = await client.claim("g0", "busy")
    assert held is not None

    async def free_silently() -> None:
        # Events off for a moment: the release is invisible to the feed.
        await set_everywhere(client.deployment, "notify-keyspace-events", "")
        assert await client.release(held)
        await set_everywhere(client.deployment, "notify-keyspace-events", "Egx")

    lease = await client.wait_for_gpu(pool, "w", timeout=30, fallback_interval_s=0.05, after_first_miss=free_silently)
    assert lease is not None and lease.via == "fallback"


async def test_keyspace_events_off_names_the_exact_config_set(single_lease_client: LeaseClient):
    client = single_lease_client  # one server: CONFIG SET on it (every primary: the next test)
    await client.redis.config_set("notify-keyspace-events", "")
    with pytest.raises(KeyspaceEventsOff) as err:
        await client.wait_for_gpu(Pool("p", ["g0"]), "w", timeout=1)
    assert "CONFIG SET notify-keyspace-events Egx" in str(err.value)
    await no_feed_left(client)

    # Flags already set are kept in the suggested command, and running it is enough.
    await client.redis.config_set("notify-keyspace-events", "Kl")
    current = (await client.redis.config_get("notify-keyspace-events"))["notify-keyspace-events"]
    with pytest.raises(KeyspaceEventsOff) as err:
        await client.check_notifications()
    assert err.value.command == f"CONFIG SET notify-keyspace-events {current}Egx"
    assert err.value.command in str(err.value)
    await client.redis.execute_command(*err.value.command.split())
    flags = await client.check_notifications()
    assert set(current) <= set(flags)

    # A alone (all classes) covers g and x.
    await client.redis.config_set("notify-keyspace-events", "AE")
    await client.check_notifications()


async def test_keyspace_events_off_on_one_primary_is_named(client: LeaseClient, redis_kind: str):
    primaries = await client.deployment.primaries()
    host, port = primaries[-1]
    node = client.deployment.primary_client(host, port)
    await node.config_set("notify-keyspace-events", "")
    with pytest.raises(KeyspaceEventsOff) as err:
        await client.wait_for_gpu(Pool("p", ["g0"]), "w", timeout=1)
    assert err.value.command == "CONFIG SET notify-keyspace-events Egx"
    assert (err.value.where == f"{host}:{port}") if redis_kind == "cluster" else err.value.where is None
    await node.config_set("notify-keyspace-events", "Egx")
    assert set("Egx") <= set(await client.check_notifications())


# ----------------------------------------------------------------------------- reconcile


async def test_reconcile_deletes_orphans_and_reports_busy_gpus_without_lease(client: LeaseClient):
    pool = Pool("p", ["g0", "g1", "g2", "g3", "g4"])
    orphan = await client.claim("g0", "gone-worker")  # the worker forgot it
    ok = await client.claim("g2", "w2", job_id="job-2")
    young = await client.claim("g4", "just-claimed")
    assert orphan and ok and young
    # Make g0's lease old enough to be judged (claimed_ms is the Redis clock).
    await client.redis.hset(client.keys.info("g0"), "claimed_ms", orphan.claimed_ms - 60_000)

    doing = {"g0": None, "g1": "batch-job", "g2": "job-2", "g4": None}

    async def ask_worker(gpu: str) -> str | None:
        if gpu == "g3":
            raise ConnectionRefusedError("worker down")
        return doing[gpu]

    report = await client.reconcile(pool, ask_worker, grace_ms=30_000)
    assert report.deleted == [("g0", "gone-worker")]
    assert report.busy_without_lease == [("g1", "batch-job")]
    assert report.kept_young == [("g4", "just-claimed")]
    assert [g for g, _ in report.unreachable] == ["g3"]
    assert report.consistent == 1 and report.mismatched == []
    assert report.changed
    assert await client.read("g0") is None
    assert (await client.read("g2")).holder == "w2"  # type: ignore[union-attr]
    assert (await client.read("g4")).holder == "just-claimed"  # type: ignore[union-attr]


async def test_reconcile_reports_a_worker_running_someone_elses_job(client: LeaseClient):
    assert await client.claim("g0", "w-a")
    report = await client.reconcile(Pool("p", ["g0"]), lambda gpu: asyncio.sleep(0, "w-b"))
    assert report.mismatched == [("g0", "w-a", "w-b")]
    assert not report.changed


# ----------------------------------------------------------------------------- pools


async def test_pool_from_a_set_and_bounded_discovery(client: LeaseClient):
    await client.redis.sadd("gpu:pool:x", "g1", "g0")
    pool = await client.pool_from_set("x", "gpu:pool:x")
    assert pool == Pool("x", ["g0", "g1"])
    for i in range(6):
        assert await client.claim(f"d{i}", "w")
    assert len(await client.discover_gpus(limit=3, count=2)) == 3
    assert await client.discover_gpus(limit=100) == [f"d{i}" for i in range(6)]


def test_derived_key_names_never_look_like_leases():
    keys = LeaseKeys()
    assert (keys.info("g"), keys.fence("g"), keys.waiters("p")) == ("gpu:leaseinfo:g", "gpu:fence:g", "gpu:waiters:p")
    assert keys.gpu_of("gpu:leaseinfo:g") is None and keys.gpu_of("gpu:lease:g") == "g"
    with pytest.raises(ValueError, match="info_prefix"):
        LeaseKeys("lease")


async def test_the_safety_recheck_is_once_a_second_by_default():
    """docs/redis-schema.md: events wake the waiter; every GPU is re-checked
    once a second by default, as the safety net for a lost notification."""
    client = LeaseClient.from_url("redis://127.0.0.1:1/0")  # never connects: no command is sent
    try:
        assert client.fallback_interval_s == 1.0
    finally:
        await client.aclose()
