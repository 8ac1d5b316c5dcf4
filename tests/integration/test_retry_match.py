"""Retries sent without an id, matched to their first copies in order (issue 48), on one
server, Sentinel and Cluster (tests/fixtures/redis_any.py): the decision script
(store.scripts.DECIDE_LUA) gives a retry the OLDEST first copy of its fingerprint that has
not had a retry at its count, never the newest; two retries at one count sent at once take
two first copies; first copies past their window, gone or answered for good are skipped
and pruned; the fingerprint's set is bounded and expires."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from llm_health.config.gate import parse_gate_config
from llm_health.gate.decision import Admission
from llm_health.gate.headers import retry_fingerprint
from llm_health.store.connection import text
from llm_health.store.scripts import FP_MAX

BODY = b'{"model":"m","messages":[{"role":"user","content":"same"}]}'
PATH = "/v1/chat/completions"
KEY = {"Authorization": "Bearer sk-shared-not-a-secret"}


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    return any_redis_url


def config(redis_url: str, deadline_ms: int = 30_000, window_ms: int = 120_000) -> Any:
    return parse_gate_config(
        {
            "admission": {"reject_if_queue_age_ms_gte": 600_000, "reject_if_retry_count_gte": 1, "ignore_worker_util_when_slack_ms_lte": 0},
            "gate": {
                "redis": redis_url,
                "routes": {"chat": {"upstream": "http://127.0.0.1:1", "default_deadline_ms": deadline_ms, "retry_match_window_ms": window_ms}},
            },
        },
        "test.yml",
    )


@pytest.fixture
async def admission(redis_url):
    adm = Admission(config(redis_url))
    yield adm
    await adm.stop()


def retry(n: int) -> dict[str, str]:
    return {**KEY, "X-Stainless-Retry-Count": str(n)}


async def send(adm: Admission, n: int = 0, body: bytes = BODY) -> tuple[str, Any]:
    out = await adm.decide("POST", PATH, retry(n), body)
    return out.headers["X-Request-Id"], out


async def ended(adm: Admission, out: Any, status: int | None = 499) -> None:
    """The attempt's end as a door writes it (the client gave up: 499)."""
    assert out.attempt is not None
    assert await adm.finish(out.attempt, status, 0)


async def test_a_retry_goes_to_the_oldest_first_copy_without_a_retry_at_its_count(admission):
    a, oa = await send(admission)
    b, ob = await send(admission)
    assert a != b  # identical fresh requests are two requests
    await ended(admission, oa)
    await ended(admission, ob)
    r1, o1 = await send(admission, 1)
    r2, o2 = await send(admission, 1)
    assert (r1, r2) == (a, b)  # first in, first out: never the newest first
    await ended(admission, o1)
    await ended(admission, o2)
    r3, _ = await send(admission, 2)  # A's second retry: A has had none at count 2
    assert r3 == a
    r4, _ = await send(admission, 1)  # a third retry at count 1: both had theirs
    assert r4 not in (a, b) and r4.startswith("gate-")
    rec_a, rec_b = await admission.queue.read(f"default/{a}"), await admission.queue.read(f"default/{b}")
    assert (rec_a.retry_count, rec_b.retry_count) == (2, 1)


async def test_an_ended_attempt_is_preferred_to_one_still_running(admission):
    """A caller retries once its attempt ended: B's quick failure is not matched to A's
    copy still at the upstream, though A's is older."""
    a, _oa = await send(admission)
    b, ob = await send(admission)
    await ended(admission, ob, 503)
    r, _ = await send(admission, 1)
    assert r == b
    r, _ = await send(admission, 1)  # no ended one left: the oldest running one
    assert r == a


async def test_two_retries_at_one_count_at_once_take_two_first_copies(admission):
    firsts = [await send(admission) for _ in range(6)]
    for _, out in firsts:
        await ended(admission, out)
    got = await asyncio.gather(*(send(admission, 1) for _ in range(6)))
    assert sorted(r for r, _ in got) == sorted(i for i, _ in firsts)


async def test_first_copies_answered_or_past_their_window_are_skipped_and_pruned(admission, redis_url):
    short = Admission(config(redis_url, deadline_ms=100, window_ms=200))  # the same route and fingerprint
    try:
        a, oa = await send(admission)
        await ended(admission, oa, 200)  # answered: its caller sends no retry
        b, ob = await send(admission)
        await ended(admission, ob)
        c, oc = await send(short)  # matched until 300 ms after it came
        await ended(short, oc)
        await asyncio.sleep(0.6)
        r, _ = await send(admission, 1)
        assert r == b  # a answered for good: skipped
        r, _ = await send(admission, 1)
        assert r not in (a, b, c)  # c is past its window: the retry is a request of its own
        key = admission.queue.keys.retry_match(retry_fingerprint("default", "chat", "POST", PATH, retry(0), BODY))
        members = {text(m) for m in await admission.redis.zrange(key, 0, -1)}
        assert members == {f"default/{b}", f"default/{r}"}, members  # a and c pruned; the unmatched retry listed
    finally:
        await short.stop()


async def test_the_fingerprint_set_expires_with_its_last_window(redis_url):
    short = Admission(config(redis_url, deadline_ms=100, window_ms=200))
    try:
        _, out = await send(short, body=BODY.replace(b"same", b"brief"))
        await ended(short, out)
        key = short.queue.keys.retry_match(retry_fingerprint("default", "chat", "POST", PATH, retry(0), BODY.replace(b"same", b"brief")))
        await asyncio.sleep(0.6)
        assert await short.redis.exists(key) == 0
    finally:
        await short.stop()


async def test_the_fingerprint_set_is_bounded(admission):
    key = admission.queue.keys.retry_match(retry_fingerprint("default", "chat", "POST", PATH, retry(0), BODY))
    client: aioredis.Redis = admission.redis
    now = int(time.time() * 1000)
    # FP_MAX live first copies already listed (their records alive), then one more.
    await client.zadd(key, {f"default/x{i}": now - FP_MAX + i for i in range(FP_MAX)})
    for i in range(FP_MAX):  # one at a time: on Cluster a pipeline is one node's
        await client.hset(admission.queue.keys.record(f"default/x{i}"), mapping={"match_until": now + 60_000, "matched_retry": 0, "state": "done"})
    new, _ = await send(admission)
    assert await client.zcard(key) == FP_MAX
    assert await client.zscore(key, f"default/{new}") is not None and await client.zscore(key, "default/x0") is None


async def test_where_the_door_sees_only_the_length_different_bodies_of_one_length_collide(admission):
    """nginx's auth_request and Envoy's ext_authz hand `decide` no body: two different
    requests of one caller with one length share a fingerprint, and a retry of the newer
    one is matched to the older one, first in, first out (docs/admission.md)."""
    length = {**KEY, "X-Original-Content-Length": str(len(BODY))}
    older = await admission.decide("POST", PATH, {**length, "X-Stainless-Retry-Count": "0"}, None)
    newer = await admission.decide("POST", PATH, {**length, "X-Stainless-Retry-Count": "0"}, None)
    await ended(admission, older)
    await ended(admission, newer)
    retry_of_newer = await admission.decide("POST", PATH, {**length, "X-Stainless-Retry-Count": "1"}, None)
    assert retry_of_newer.headers["X-Request-Id"] == older.headers["X-Request-Id"]
    # The gate hashes the body: there the same two requests never meet.
    a, _ = await send(admission, body=BODY.replace(b"same", b"samf"))
    _, ob = await send(admission, body=BODY.replace(b"same", b"samg"))
    await ended(admission, ob)
    r, _ = await send(admission, 1, body=BODY.replace(b"same", b"samg"))
    assert r == ob.headers["X-Request-Id"] != a
