"""bench/decide_script_ab.py replays what the nginx Lua door sends at its ceiling: on a real
redis-server each decision admits its request and carries the previous request's end,
which Redis writes (the records done with their tokens, the last one still running)."""

from __future__ import annotations

import pytest
import redis
from bench import decide_script_ab

from llm_health.store.ends import DECIDE_ENDS_LUA
from llm_health.store.queue import AdmissionQueue


def test_the_replay_admits_each_request_and_writes_the_end_it_carries(own_redis_server):
    rc = redis.Redis.from_url(own_redis_server.url)
    q = AdmissionQueue(rc, prefix="ab:")
    work = decide_script_ab.calls(q, 10, 20)
    assert len(work) == 20
    usec = decide_script_ab.block(rc, rc.script_load(DECIDE_ENDS_LUA), work)
    assert usec > 0
    for i in range(10, 29):
        assert rc.hmget(q.keys.record(f"r{i}"), "state", "token_units", "attempts") == [b"done", b"9", b"1"], i
    assert rc.hget(q.keys.record("r29"), "state") == b"running"  # its end would ride on the next call


def test_a_reply_that_is_not_an_admit_stops_the_replay(own_redis_server):
    rc = redis.Redis.from_url(own_redis_server.url)
    work = decide_script_ab.calls(AdmissionQueue(rc, prefix="ab:"), 0, 3)
    with pytest.raises(SystemExit, match="not an admit"):
        decide_script_ab.block(rc, rc.script_load("return 'no'"), work)
