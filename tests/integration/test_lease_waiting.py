"""Waiting across time, on one server, Sentinel and Cluster: the waiters' keyevent feed
stays subscribed for `feed_linger_s` after its last waiter left (store/feed.py), so a
worker that waits again soon finds it subscribed, and it is closed after the linger or
with the client; a waiter outlives a Cluster settling.

No test asserts a wall-clock time: the lingers below are either far longer than any test
(so "still there" cannot depend on the machine's speed) or short, with "gone" polled."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import pytest_asyncio
from redis.exceptions import ClusterDownError, SlotNotCoveredError, TryAgainError

from llm_health.store.feed import KeyeventFeed
from llm_health.store.keys import LeaseKeys
from llm_health.store.leases import LeaseClient
from llm_health.store.records import Lease, Pool
from tests.fixtures.redis_ops import kill_our_feeds, our_feeds
from tests.integration.test_leases import eventually, no_feed_left

LONG = 3600.0


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    return any_redis_url


@pytest_asyncio.fixture
async def lingering(redis_url: str):
    c = LeaseClient.from_url(redis_url, ttl_ms=10_000, feed_linger_s=LONG)
    try:
        yield c
    finally:
        await c.aclose()


async def feed_ids(c: LeaseClient) -> set[tuple[str, str]]:
    """Our subscriptions, as (server address, client id): ids are per server."""
    return {(f["laddr"], f["id"]) for f in await our_feeds(c.deployment)}


async def subscribed_everywhere(c: LeaseClient, what: str, not_in: frozenset = frozenset()) -> set[tuple[str, str]]:
    """Eventually: one of our subscriptions on every primary, none of them in `not_in`
    (a short wait may time out before the feed is up)."""

    async def ready() -> set[tuple[str, str]] | None:
        ids = await feed_ids(c)
        return ids if len(ids) == len(await c.deployment.primaries()) and not ids & not_in else None

    return await eventually(ready, what)


async def waited_in_vain(c: LeaseClient, pool: Pool) -> Lease:
    """g0 held by "busy", and a short wait for it that times out: the feed, lingering now."""
    held = await c.claim("g0", "busy")
    assert held is not None
    assert await c.wait_for_gpu(pool, "w", timeout=0.1) is None
    return held


def release_after_miss(c: LeaseClient, held: Lease) -> Callable[[], Awaitable[None]]:
    """An after_first_miss hook that releases `held`: the waiter is woken by its event."""

    async def hook() -> None:
        assert await c.release(held)

    return hook


async def test_a_waiter_back_within_the_linger_reuses_the_subscription(lingering: LeaseClient):
    c = lingering
    pool = Pool("p", ["g0"])
    held = await waited_in_vain(c, pool)
    ids = await subscribed_everywhere(c, "the feed subscribed on every primary, with no waiter left")
    assert await c.wait_for_gpu(pool, "second", timeout=0.2) is None
    assert await feed_ids(c) == ids  # the same connections: not subscribed again

    # And the lingering feed still wakes a waiter on a release.
    hook = release_after_miss(c, held)
    lease = await c.wait_for_gpu(pool, "third", timeout=30, fallback_interval_s=LONG, after_first_miss=hook)
    assert lease is not None and lease.via == "del"
    assert await feed_ids(c) == ids


async def test_the_feed_closes_after_the_linger(redis_url: str):
    c = LeaseClient.from_url(redis_url, ttl_ms=10_000, feed_linger_s=0.2)
    try:
        assert await c.claim("g0", "busy") is not None
        assert await c.wait_for_gpu(Pool("p", ["g0"]), "w", timeout=0.1) is None
        await no_feed_left(c)
        # A later waiter subscribes again.
        assert await c.wait_for_gpu(Pool("p", ["g0"]), "w2", timeout=0.1) is None
        await no_feed_left(c)
    finally:
        await c.aclose()


async def test_closing_the_client_while_it_lingers_leaves_no_feed(redis_url: str):
    c = LeaseClient.from_url(redis_url, ttl_ms=10_000, feed_linger_s=LONG)
    watcher = LeaseClient.from_url(redis_url)
    try:
        assert await c.claim("g0", "busy") is not None
        assert await c.wait_for_gpu(Pool("p", ["g0"]), "w", timeout=0.1) is None
        assert await feed_ids(c)
        await c.aclose()
        await no_feed_left(watcher)
    finally:
        await c.aclose()  # twice is fine
        await watcher.aclose()


async def test_a_feed_broken_while_it_lingers_is_made_again(lingering: LeaseClient):
    c = lingering
    pool = Pool("p", ["g0"])
    held = await waited_in_vain(c, pool)
    before = frozenset(await feed_ids(c))
    assert await kill_our_feeds(c.deployment) >= 1
    await subscribed_everywhere(c, "the lingering feed subscribed again", not_in=before)
    hook = release_after_miss(c, held)
    lease = await c.wait_for_gpu(pool, "w2", timeout=30, fallback_interval_s=LONG, after_first_miss=hook)
    assert lease is not None and lease.via in ("del", "resubscribe")


async def test_a_negative_linger_is_refused(lingering: LeaseClient):
    with pytest.raises(ValueError, match="linger_s"):
        KeyeventFeed(lingering.deployment, LeaseKeys(), linger_s=-1)


@pytest.mark.parametrize(
    "error",
    [ClusterDownError("CLUSTERDOWN The cluster is down"), TryAgainError("TRYAGAIN"), SlotNotCoveredError("slot 9454 not covered")],
    ids=lambda e: type(e).__name__,
)
async def test_a_waiter_outlives_a_cluster_settling(lingering: LeaseClient, error: Exception):
    """CLUSTERDOWN (a primary killed, its replica not yet promoted), TRYAGAIN (a slot
    migrating) and a slot map with a hole are what a Cluster says while it settles: the
    waiter tries again soon (RETRY_SOON) instead of raising to its caller. Injected here
    (the chaos test kills real primaries and prints what, if anything, escaped)."""
    c = lingering
    plain = c.claim_any
    raised = 0

    async def settling(*args, **kw):
        nonlocal raised
        if raised < 2:  # the first claim and the retry after it
            raised += 1
            raise error
        return await plain(*args, **kw)

    c.claim_any = settling  # type: ignore[method-assign]
    lease = await c.wait_for_gpu(Pool("p", ["g0"]), "w", timeout=30, fallback_interval_s=LONG)
    assert raised == 2 and lease is not None and lease.gpu == "g0"
