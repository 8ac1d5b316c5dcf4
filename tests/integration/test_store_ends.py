"""Ends carried in one script call (store.ends), on a real redis-server: the same keys and
values as the two scripts the Python doors pipeline, run before the decision that carries
them, and an end Redis refuses skipped without failing the rest or the decision."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from llm_health.core.admission import Policy
from llm_health.store.ends import DECIDE_ARGS, DECIDE_ENDS_LUA, ENDS_LUA, attempt_end, packed
from llm_health.store.policy import policy_args
from llm_health.store.queue import AdmissionQueue
from tests.fixtures import lua_door_calls

NOW = 1_800_000_000_000


def decide_call(q: AdmissionQueue, rid: str, lean: str = "1", **policy: Any) -> list[Any]:
    call = lua_door_calls.decision(q, rid, NOW, NOW + 30_000, backends=["b1"], policy=policy_args(Policy(**policy)), lean=lean)
    assert len(call) == 1 + call[0] + DECIDE_ARGS
    return call


def ends_of(q: AdmissionQueue, rid: str, status: int, units: int, ended: int = 1, tenant_key: str | None = None) -> list[tuple[str, list[Any], list[Any]]]:
    """An attempt's end as its two calls, `a` then `l` (each replying 1)."""
    (keys, args), (lkeys, largs) = lua_door_calls.end_calls(q, rid, status, units, NOW + 5, ended, tenant_key)
    return [("a", keys, [*args, "1"]), ("l", lkeys, [*largs, "1"])]


def whole_end(q: AdmissionQueue, rid: str, status: int, units: int, ended: int = 1, tenant_key: str | None = None) -> list[str]:
    """The same end whole (`e`), as the Lua door sends it."""
    return lua_door_calls.whole_end(q, rid, status, units, NOW + 5, ended, tenant_key)


def flat(ends: list[tuple[str, list[Any], list[Any]]]) -> list[str]:
    """The ends as the Lua door sends them (store.ends.packed), one argument list."""
    return [x for kind, keys, args in ends for x in packed(kind, keys, [str(v) for v in args])]


async def dump(r: Any, prefix: str) -> dict[str, Any]:
    """Every key under ``prefix`` (the prefix taken off) and its value, by type."""
    out: dict[str, Any] = {}
    async for raw in r.scan_iter(match=prefix + "*"):
        key = raw.decode()
        kind = (await r.type(key)).decode()
        if kind == "hash":
            value: Any = await r.hgetall(key)
        elif kind == "zset":
            value = await r.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            value = sorted(await r.smembers(key))
        else:
            value = await r.get(key)
        out[key[len(prefix) :]] = (kind, value, await r.pttl(key) > 0)
    return out


@pytest.fixture
async def two(own_redis_server):
    r = aioredis.Redis.from_url(own_redis_server.url)
    queues = [AdmissionQueue(r, prefix=p, clock=lambda: NOW) for p in ("one:", "two:")]
    yield r, queues
    await r.aclose()


async def test_ends_write_what_the_two_scripts_write(two):
    r, (a, b) = two
    for q in (a, b):
        await r.eval(DECIDE_ENDS_LUA, *decide_call(q, "x"))
    pipe = await a.pipeline()
    for kind, keys, args in ends_of(a, "x", 200, 42):  # the Python doors' finish, as store.batch sends it
        pipe.evalsha(a._attempt.sha if kind == "a" else a._leave.sha, len(keys), *keys, *args)
    await a.load_scripts()
    assert await a.execute(pipe) == [1, 1]
    assert await r.eval(ENDS_LUA, 0, *flat(ends_of(b, "x", 200, 42))) == 2
    one, other = await dump(r, "one:"), await dump(r, "two:")
    record = one[a.keys.record("x")[len("one:") :]][1]
    assert one == other and (record[b"state"], record[b"token_units"]) == (b"done", b"42"), one


@pytest.mark.parametrize(("status", "units", "ended", "tenant"), [(200, 42, 1, False), (499, 3, 2, False), (503, 0, 1, True), (200, 9, 1, True)])
async def test_an_attempt_s_end_whole_writes_what_its_two_calls_write(two, status, units, ended, tenant):
    """`e`, the attempt's end in one run (what the Lua door sends), against `a` then `l`:
    every key the same, a client gone (499, ended 2) and a tenant charged included."""
    r, (a, b) = two
    for q in (a, b):
        await r.eval(DECIDE_ENDS_LUA, *decide_call(q, "x"))
    tkeys = [q.keys.tenant("default", NOW // 60_000) if tenant else None for q in (a, b)]
    assert await r.eval(ENDS_LUA, 0, *flat(ends_of(a, "x", status, units, ended, tkeys[0]))) == 2
    assert await r.eval(ENDS_LUA, 0, *whole_end(b, "x", status, units, ended, tkeys[1])) == 2
    assert await dump(r, "one:") == await dump(r, "two:")


async def _before_the_end(r: Any, q: AdmissionQueue, state: str) -> None:
    """The record ``x`` as the end finds it: decided (running), waiting in the queue (queued,
    on the waiting sets), its attempt already counted (the end sent again), done, a resent
    id decided again, or gone."""
    if state == "queued":
        await q.enqueue("x", "chat", "default", NOW + 30_000, NOW)
        return
    if state == "gone":
        return
    await r.eval(DECIDE_ENDS_LUA, *decide_call(q, "x"))
    if state == "counted":
        keys, args = q.attempt_call("x", "chat", 5, 200, 0, NOW + 2, attempt_id="att-x")
        await r.eval(ENDS_LUA, 0, *flat([("a", keys, [*args, "1"])]))
    elif state == "done":
        await r.eval(ENDS_LUA, 0, *flat(ends_of(q, "x", 200, 7)))
    elif state == "decided twice":
        await r.eval(DECIDE_ENDS_LUA, *decide_call(q, "x"))


@pytest.mark.parametrize("state", ["running", "queued", "counted", "done", "decided twice", "gone"])
async def test_an_end_whole_from_every_state_of_its_record_writes_what_its_two_calls_write(two, state):
    """`e` writes the attempt's state in its write and leaves the record alone after it where
    the record said running: from every state a record can be in, the keys are the two
    calls' (a queued record still taken off the waiting sets, an end sent again counted once)."""
    r, (a, b) = two
    for q in (a, b):
        await _before_the_end(r, q, state)
    assert await r.eval(ENDS_LUA, 0, *flat(ends_of(a, "x", 200, 9))) == 2
    assert await r.eval(ENDS_LUA, 0, *whole_end(b, "x", 200, 9)) == 2
    one, other = await dump(r, "one:"), await dump(r, "two:")
    assert one == other, (one, other)
    if state != "gone":
        record = one[a.keys.record("x")[len("one:") :]][1]
        assert record[b"state"] == b"done" and not any(k.endswith(("enqueued", "deadline", "retried")) and v[1] for k, v in one.items()), one


def test_attempt_end_refuses_calls_of_two_records() -> None:
    q = AdmissionQueue(redis.Redis(), prefix="p:")
    attempt = q.attempt_call("x", "chat", 1, 200, 0, NOW)
    with pytest.raises(ValueError, match="one record at one time"):
        attempt_end(attempt, q.leave_call("y", "chat", "done", 200, NOW, ended=1))
    with pytest.raises(ValueError, match="one record at one time"):
        attempt_end(attempt, q.leave_call("x", "chat", "done", 200, NOW + 1, ended=1))


async def test_a_decision_runs_the_ends_it_carries_first(two):
    r, (a, b) = two
    for q in (a, b):
        await r.eval(DECIDE_ENDS_LUA, *decide_call(q, "x"))
    # a: the end written on its own, then the next decision; b: the end carried by that decision
    assert await r.eval(ENDS_LUA, 0, *flat(ends_of(a, "x", 503, 0))) == 2
    alone = await r.eval(DECIDE_ENDS_LUA, *decide_call(a, "y"))
    carried = await r.eval(DECIDE_ENDS_LUA, *decide_call(b, "y"), *flat(ends_of(b, "x", 503, 0)))
    assert carried == alone and carried.split(b"\t")[:3] == [b"y", b"1800000030000", b"admit_once"], carried
    assert await dump(r, "one:") == await dump(r, "two:")
    assert (await r.hget(b.keys.record("x"), "http_status"), await r.hget(b.keys.record("x"), "state")) == (b"503", b"done")


async def test_an_end_redis_refuses_is_skipped_and_the_rest_run(two):
    r, (a, _) = two
    await r.eval(DECIDE_ENDS_LUA, *decide_call(a, "x"))
    await r.set(a.keys.record("bad"), "a string where a record was")
    await r.hset(a.keys.record("bad2"), "deadline_ms", "not a number")  # the attempt script's tonumber fails
    bad = [*packed("a", [a.keys.record("bad2"), *a.keys.route_keys("chat")], ["bad2", "1", "200", str(NOW), "1000", "", "att", "0", "1"])]
    bad.extend(packed("l", [a.keys.record("bad"), *a.keys.route_keys("chat")[:3]], ["bad", "done", "200", str(NOW), "0", "0", "1"]))
    good = flat(ends_of(a, "x", 200, 7))
    assert await r.eval(ENDS_LUA, 0, *bad, *good) == 2
    assert await r.hget(a.keys.record("x"), "state") == b"done"
    reply = await r.eval(DECIDE_ENDS_LUA, *decide_call(a, "y"), *bad)
    assert reply.split(b"\t")[2] == b"admit_once", reply


async def test_an_end_whole_redis_refuses_is_skipped_and_the_rest_run(two):
    """`e` on a key that is no record: both of its calls refused (its attempt's read, then
    its leave's write), nothing written to it, and the next end recorded."""
    r, (a, _) = two
    await r.eval(DECIDE_ENDS_LUA, *decide_call(a, "x"))
    await r.set(a.keys.record("bad"), "a string where a record was")
    assert await r.eval(ENDS_LUA, 0, *whole_end(a, "bad", 200, 3), *whole_end(a, "x", 200, 7)) == 2
    assert await r.get(a.keys.record("bad")) == b"a string where a record was"
    assert await r.hmget(a.keys.record("x"), "state", "token_units") == [b"done", b"7"]


async def test_an_end_whole_of_other_counts_is_skipped_and_the_rest_run(two):
    """`e` is read where its keys and arguments lie (9 or 10 keys, 9 arguments): one with
    other counts writes nothing, and the ends after it still run, each from its own place."""
    r, (a, _) = two
    for rid in ("x", "y"):
        await r.eval(DECIDE_ENDS_LUA, *decide_call(a, rid))
    good = whole_end(a, "x", 200, 7)
    short = ["e", "8", "9", *good[3:11], *good[12:]]  # the ninth key left out
    assert len(short) == 3 + 8 + 9
    assert await r.eval(ENDS_LUA, 0, *short, *good, *whole_end(a, "y", 200, 5)) == 4
    assert await r.hmget(a.keys.record("x"), "state", "token_units", "attempts") == [b"done", b"7", b"1"]
    assert await r.hmget(a.keys.record("y"), "state", "token_units") == [b"done", b"5"]


@pytest.mark.parametrize("form", ["two calls", "whole"])
async def test_redis_saying_not_now_fails_the_call_and_loses_no_end(two, form):
    """min-replicas-to-write with no replica in reach: every write is NOREPLICAS. The call
    fails (the door sends its ends again) instead of skipping them as refused; once Redis
    takes writes again, the same call records them. An end as its two calls and whole."""
    r, (a, _) = two
    await r.eval(DECIDE_ENDS_LUA, *decide_call(a, "x"))
    ends = flat(ends_of(a, "x", 200, 7)) if form == "two calls" else whole_end(a, "x", 200, 7)
    await r.config_set("min-replicas-to-write", 1)
    try:
        # the reply starts with Redis' own code: every door reads it as Redis down (store.codes)
        with pytest.raises(redis.exceptions.ResponseError, match=r"^NOREPLICAS "):
            await r.eval(ENDS_LUA, 0, *ends)
        with pytest.raises(redis.exceptions.ResponseError, match=r"^NOREPLICAS "):
            await r.eval(DECIDE_ENDS_LUA, *decide_call(a, "y"), *ends)
        assert await r.hget(a.keys.record("x"), "state") == b"running"
    finally:
        await r.config_set("min-replicas-to-write", 0)
    assert await r.eval(ENDS_LUA, 0, *ends) == 2
    assert await r.hget(a.keys.record("x"), "state") == b"done"


@pytest.mark.parametrize("policy", [{}, {"reject_if_queue_age_ms_gte": 0.0}, {"engine_age_unknown": "closed"}])
async def test_the_lean_reply_says_what_the_full_one_says(two, policy):
    """The Lua door reads one tab-separated line (store.policy's `lean`): the same id,
    deadline, decision and figures as the reply the Python doors read."""
    r, (a, b) = two
    await r.zadd(a.keys.route_keys("chat")[0], {"old": NOW - 5000})  # a queue 5 s old
    await r.zadd(b.keys.route_keys("chat")[0], {"old": NOW - 5000})
    full = await r.eval(DECIDE_ENDS_LUA, *decide_call(a, "x", "0", **policy))
    lean = (await r.eval(DECIDE_ENDS_LUA, *decide_call(b, "x", "1", **policy))).decode().split("\t")
    name, reason, status, after, retryable = (v.decode() if isinstance(v, bytes) else v for v in full[9])
    figures = ["" if v is None else str(v) for v in full[10]]
    assert lean == [full[4].decode(), full[1][3].decode(), name, str(status), after or "", str(retryable), *figures, reason], (lean, full)


def test_packed_refuses_an_unknown_call() -> None:
    with pytest.raises(ValueError, match=r"'a' .*, 'l' .* or 'e'"):
        packed("x", [], [])


async def test_a_decision_takes_a_new_record_s_id_off_the_waiting_sets_where_it_was_left(two):
    """A decision skips taking an id off the waiting sets only where the id is new to the
    route's live set: an id whose record went while the sets still held it (deleted by hand,
    evicted) is taken off them, as every decision did before."""
    r, (a, _) = two
    await a.enqueue("x", "chat", "default", NOW + 30_000, NOW)
    await r.delete(a.keys.record("x"))
    await r.eval(DECIDE_ENDS_LUA, *decide_call(a, "x"))
    for kind in ("enqueued", "deadline", "retried"):
        assert await r.zscore(a.keys.route("chat", kind), "default/x") is None and await r.zscore(a.keys.route("chat", kind), "x") is None
    assert (await r.hget(a.keys.record("x"), "state")) == b"running"
