"""Admission queue records against a real redis-server (fixtures: tests/conftest_redis.py).
Async tests run under `asyncio_mode = "auto"` (pyproject)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from llm_health.store.queue import AdmissionQueue, QueueRecord, now_ms


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    """Every test of this module on one server, Sentinel and Cluster (tests/fixtures/redis_any.py)."""
    return any_redis_url


@pytest_asyncio.fixture
async def queue(redis_url: str):
    q = AdmissionQueue.from_url(redis_url)
    try:
        yield q
    finally:
        await q.aclose()


async def test_enqueue_then_read_the_record(queue: AdmissionQueue):
    rec = await queue.enqueue("lab-1", "chat", "team-a", deadline_ms=10_000, enqueued_ms=7_000)
    assert rec == QueueRecord("lab-1", "chat", "team-a", 7_000, 10_000, state="queued")
    assert not rec.is_retry
    assert await queue.read("lab-1") == rec
    assert await queue.read("never-seen") is None
    assert await queue.routes() == ["chat"]


async def test_resent_id_is_a_retry_that_keeps_its_age(queue: AdmissionQueue):
    t0 = now_ms()
    await queue.enqueue("lab-1", "chat", "team-a", deadline_ms=t0 + 3000, enqueued_ms=t0)
    await queue.dequeue("lab-1")
    await queue.record_attempt("lab-1", token_units=256, http_status=503)
    await queue.complete("lab-1", http_status=503)
    # The client resends the same id later (the drill's T+4001): same age, same deadline.
    again = await queue.enqueue("lab-1", "chat", "team-a", deadline_ms=t0 + 999_999, enqueued_ms=t0 + 4001)
    assert again.is_retry and again.retry_count == 1
    assert again.enqueued_ms == t0 and again.deadline_ms == t0 + 3000
    assert again.age_ms(t0 + 4001) == 4001 and again.slack_ms(t0 + 4001) == -1001
    assert again.http_status == 503 and again.state == "queued"
    stats = await queue.route_stats("chat", t0 + 4001)
    assert stats.depth == 1 and stats.retried == 1 and stats.past_deadline == 1


async def test_attempts_count_tokens_per_id(queue: AdmissionQueue):
    t0 = now_ms()
    await queue.enqueue("r1", "chat", "t", deadline_ms=t0 + 30_000)
    for status in (503, 429, 503):
        await queue.record_attempt("r1", token_units=256, http_status=status)
    rec = await queue.record_attempt("r1", token_units=256, http_status=200, retry_count=3)
    assert rec is not None
    assert (rec.attempts, rec.token_units, rec.attempt_units_max) == (4, 1024, 256)
    assert rec.token_duplication_ratio == 4.0
    assert rec.http_status == 200 and rec.retry_count == 3
    assert await queue.record_attempt("unknown", token_units=1) is None
    with pytest.raises(ValueError):
        await queue.record_attempt("r1", token_units=-1)
    stats = await queue.route_stats("chat")
    assert stats.token_duplication_ratio_max == 4.0
    assert stats.retried == 1  # retry_count reported by the sidecar, id still waiting


async def test_route_stats_oldest_age_smallest_slack_past_deadline(queue: AdmissionQueue):
    now = 1_000_000
    await queue.enqueue("a", "chat", "t", deadline_ms=now + 5_000, enqueued_ms=now - 2_000)
    await queue.enqueue("b", "chat", "t", deadline_ms=now - 500, enqueued_ms=now - 47_000)
    await queue.enqueue("c", "chat", "t", deadline_ms=now - 100, enqueued_ms=now - 1_000)
    await queue.enqueue("d", "batch", "t", deadline_ms=now + 60_000, enqueued_ms=now)
    chat = await queue.route_stats("chat", now)
    assert chat.depth == 3
    assert chat.oldest_age_ms == 47_000
    assert chat.smallest_slack_ms == -500
    assert chat.past_deadline == 2
    assert chat.retried == 0 and chat.token_duplication_ratio_max is None
    batch = await queue.route_stats("batch", now)
    assert (batch.depth, batch.oldest_age_ms, batch.smallest_slack_ms, batch.past_deadline) == (1, 0, 60_000, 0)
    empty = await queue.route_stats("none", now)
    assert (empty.depth, empty.oldest_age_ms, empty.smallest_slack_ms) == (0, None, None)


async def test_dequeue_pop_and_complete_leave_the_waiting_sets(queue: AdmissionQueue):
    t0 = now_ms()
    await queue.enqueue("old", "chat", "t", deadline_ms=t0 + 9000, enqueued_ms=t0 - 10)
    await queue.enqueue("new", "chat", "t", deadline_ms=t0 + 9000, enqueued_ms=t0)
    await queue.enqueue("other", "chat", "t", deadline_ms=t0 + 9000, enqueued_ms=t0 + 10)
    popped = await queue.pop_oldest("chat")
    assert popped is not None and popped.request_id == "old" and popped.state == "running"
    taken = await queue.dequeue("new")
    assert taken is not None and taken.state == "running"
    done = await queue.complete("new", http_status=200)
    assert done is not None and done.state == "done" and done.http_status == 200
    assert (await queue.route_stats("chat")).depth == 1
    assert await queue.dequeue("nope") is None
    assert (await queue.pop_oldest("chat")).request_id == "other"  # type: ignore[union-attr]
    assert await queue.pop_oldest("chat") is None


async def test_concurrent_pops_never_share_an_id(queue: AdmissionQueue):
    import asyncio

    t0 = now_ms()
    for i in range(30):
        await queue.enqueue(f"r{i}", "chat", "t", deadline_ms=t0 + 60_000, enqueued_ms=t0 + i)
    got = await asyncio.gather(*(queue.pop_oldest("chat") for _ in range(40)))
    ids = [r.request_id for r in got if r is not None]
    assert sorted(ids) == sorted(f"r{i}" for i in range(30))


async def test_everything_expires(redis_url: str):
    clock = {"now": now_ms()}
    q = AdmissionQueue.from_url(redis_url, retention_ms=1_000, clock=lambda: clock["now"])
    try:
        t0 = clock["now"]
        await q.enqueue("stale", "chat", "t", deadline_ms=t0 - 5_000, enqueued_ms=t0 - 6_000)
        await q.record_attempt("stale", token_units=10)
        # Every record has a TTL: retention after max(deadline, last write).
        ttl = await q.redis.pttl(q.keys.record("stale"))
        assert 0 < ttl <= 1_000
        # Once its window has passed, the GC inside the next enqueue drops the id.
        clock["now"] = t0 + 2_000
        await q.enqueue("fresh", "chat", "t", deadline_ms=t0 + 7_000)
        members = {what: await q.redis.zrange(q.keys.route("chat", what), 0, -1) for what in ("enqueued", "deadline", "retried", "live", "dup")}
        assert all("stale" not in m for m in members.values()), members
        assert "fresh" in members["enqueued"]
        # The explicit GC (the exporter's too) does the same on a quiet route.
        assert await q.gc("chat", now=t0 + 10 * 60_000) == 1
        assert await q.redis.zcard(q.keys.route("chat", "live")) == 0
        # Every key the queue writes either expires or is a per-route set the GC bounds.
        for key in await q.redis.keys(q.keys.prefix + "*"):  # test only; the code never uses KEYS
            kind = await q.redis.type(key)
            assert kind in ("zset", "set") or await q.redis.pttl(key) > 0, key
    finally:
        await q.aclose()
