"""store.fast_redis (the fast path) against its library counterpart, redis-py's pipeline
(`transaction=False`, as `AdmissionQueue.pipeline` makes it on one server), on a real
redis-server: the same pipelines of EVALSHAs through both `Pipe`s give the same replies
(redis-py decodes them, the fast path hands hiredis' bytes: compared decoded), or the same
error: the same redis-py class, the same reply text once redis-py's "Command # n ... of
pipeline caused error:" is taken off, the same classification (`store.errors`). Then the
admission queue's own scripts (a decision, a resent id, an attempt's finish), NOSCRIPT
after the scripts are flushed, and a Redis that is not there or does not answer."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.exceptions import RedisError

from llm_health.core.admission import Policy
from llm_health.store import errors
from llm_health.store.deployment import Deployment, connect
from llm_health.store.fast_redis import FastRedis, Pipe
from llm_health.store.policy import policy_args
from llm_health.store.queue import AdmissionQueue, parse_decide

SCRIPTS = {
    "integer": "return 41 + 1",
    "string": "return 'text'",
    "UTF-8": "return 'ünïcødé ☃'",
    "nil": "return nil",
    "a float, truncated": "return 3.99",
    "true": "return true",
    "false": "return false",
    "empty table": "return {}",
    "nested": "return {1, 'two', {3, {'four'}}, 5}",
    "a nil hole ends the table": "return {1, nil, 3}",
    "status": "return {ok = 'FINE'}",
    "commands": "redis.call('SET', KEYS[1], ARGV[1]); return {redis.call('INCR', KEYS[1]), redis.call('GET', KEYS[1]), redis.call('EXISTS', 'nope')}",
    "hash": "redis.call('HSET', KEYS[1], 'a', ARGV[1], 'b', 'x'); return redis.call('HGETALL', KEYS[1])",
    "ERR reply": "return redis.error_reply('ERR a custom refusal')",
    "a reply without a code": "return redis.error_reply('lowercase words only')",
    "NOREPLICAS reply": "return redis.error_reply('NOREPLICAS Not enough good replicas to write.')",
    "READONLY reply": 'return redis.error_reply("READONLY You can\'t write against a read only replica.")',
    "LOADING reply": "return redis.error_reply('LOADING Redis is loading the dataset in memory')",
    "MASTERDOWN reply": "return redis.error_reply('MASTERDOWN Link with MASTER is down')",
    "TRYAGAIN reply": "return redis.error_reply('TRYAGAIN Multiple keys request during rehashing of slot')",
    "OOM reply": "return redis.error_reply('OOM command not allowed when used memory > maxmemory')",
    "NOPERM reply": "return redis.error_reply('NOPERM this user has no permissions')",
    "a runtime error": "error('boom')",
    "a wrong type inside": "redis.call('SET', KEYS[1], 'v'); return redis.call('LPUSH', KEYS[1], 'x')",
    "an error table": "return {err = 'WRONGTYPE Operation against a key holding the wrong kind of value'}",
}
UNKNOWN_SHA = "0" * 40
Outcome = tuple[Any, ...]


def decoded(reply: Any) -> Any:
    if isinstance(reply, bytes):
        return reply.decode()
    if isinstance(reply, list):
        return [decoded(r) for r in reply]
    return reply


def failed(exc: RedisError) -> Outcome:
    return ("error", type(exc), errors._reply(exc), errors.code(exc), errors.retryable(exc))


async def run(pipe: Pipe, commands: list[tuple[Any, ...]]) -> Outcome:
    for command in commands:
        pipe.evalsha(*command)
    try:
        return ("replies", decoded(await pipe.execute()))
    except RedisError as exc:
        return failed(exc)


@pytest.fixture
async def gate_redis(redis_url: str) -> AsyncIterator[tuple[Deployment, FastRedis]]:
    """The deployment as the gate connects to it, and the fast path's connection to it."""
    deployment = connect(redis_url, socket_timeout=1.0, max_connections=64, blocking_timeout=1.0)
    fast = FastRedis.for_deployment(deployment)
    assert fast is not None
    yield deployment, fast
    fast.close()
    await deployment.aclose()


async def through_both(deployment: Deployment, fast: FastRedis, commands: list[tuple[Any, ...]]) -> dict[str, Outcome]:
    """The same commands through redis-py's pipe and the fast path's, each on an empty database."""
    out = {}
    for name, pipe in (("redis-py", deployment.client.pipeline(transaction=False)), ("fast", fast.pipeline())):
        await deployment.client.flushdb()
        out[name] = await run(pipe, commands)
    return out


@pytest.mark.parametrize("case", list(SCRIPTS))
async def test_one_script_replies_the_same(case, gate_redis):
    deployment, fast = gate_redis
    sha = await deployment.client.script_load(SCRIPTS[case])
    got = await through_both(deployment, fast, [(sha, 1, "{k}:1", "7")])
    assert got["fast"] == got["redis-py"], case


async def test_a_pipeline_replies_in_order_and_raises_its_first_error(gate_redis):
    deployment, fast = gate_redis
    sha = {case: await deployment.client.script_load(SCRIPTS[case]) for case in SCRIPTS}
    pipelines = {
        "all good": [(sha["integer"], 0), (sha["nested"], 0), (sha["commands"], 1, "k", "1"), (sha["nil"], 0)],
        "an error in the middle": [(sha["integer"], 0), (sha["READONLY reply"], 0), (sha["ERR reply"], 0), (sha["string"], 0)],
        "NOSCRIPT among them": [(sha["integer"], 0), (UNKNOWN_SHA, 0), (sha["a runtime error"], 0)],
        "NOSCRIPT alone": [(UNKNOWN_SHA, 0)],
    }
    for name, commands in pipelines.items():
        got = await through_both(deployment, fast, commands)
        assert got["fast"] == got["redis-py"], name


NOW = 1_700_000_000_000
POLICY = policy_args(Policy(default_deadline_ms=30_000))


async def decisions(queue: AdmissionQueue, pipe_of: Any) -> list[Any]:
    """A door's sequence on the queue's scripts: two requests, one resent, one finished."""
    out: list[Any] = []
    for request_id, tenant, now in (("a", "t1", NOW), ("b", "t2", NOW + 5), ("a", "t1", NOW + 9)):
        pipe = await pipe_of()
        queue.pipe_decide(pipe, request_id, "chat", tenant, now + 30_000, now, tenant_key=None, fingerprint=None, backends=["b1"], policy=POLICY)
        replies = await pipe.execute()
        out.append(parse_decide(request_id, replies[0], now))
        out.append(decoded(replies))
    pipe = await pipe_of()
    queue.pipe_attempt(pipe, queue.attempt_call("a", "chat", 12, 200, 1, NOW + 20, attempt_id="x1"))
    queue.pipe_leave(pipe, "a", "chat", "done", 200, NOW + 20, ended=1)
    out.append(decoded(await pipe.execute()))
    out.append(await queue.read("a"))
    return out


async def test_the_admission_queue_s_scripts_decide_the_same(gate_redis):
    deployment, fast = gate_redis
    queue = AdmissionQueue(deployment, clock=lambda: NOW)
    await queue.load_scripts()
    await deployment.client.flushdb()
    library = await decisions(queue, queue.pipeline)
    await deployment.client.flushdb()

    async def fast_pipe() -> Pipe:
        return fast.pipeline()

    assert await decisions(queue, fast_pipe) == library


async def test_noscript_after_the_scripts_are_flushed_is_the_same_error(gate_redis):
    deployment, fast = gate_redis
    queue = AdmissionQueue(deployment, clock=lambda: NOW)
    await queue.load_scripts()
    await deployment.client.script_flush()
    got = {}
    for name, pipe in (("redis-py", deployment.client.pipeline(transaction=False)), ("fast", fast.pipeline())):
        queue.pipe_decide(pipe, "a", "chat", "t1", NOW + 30_000, NOW, tenant_key=None, fingerprint=None, backends=[], policy=POLICY)
        with pytest.raises(RedisError) as caught:
            await pipe.execute()
        got[name] = failed(caught.value)
    assert got["fast"] == got["redis-py"]
    assert got["fast"][1].__name__ == "NoScriptError"


def where_nobody_listens() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{s.getsockname()[1]}"


async def test_a_redis_that_is_not_there_or_does_not_answer_fails_the_same_way():
    """Refused: a ConnectionError, nothing ran; silent: a TimeoutError (the command may run
    late); both Redis down for the doors (store.errors.REDIS_DOWN)."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        for url in (where_nobody_listens(), f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}"):
            deployment = connect(url, socket_timeout=0.3, retries=0)
            fast = FastRedis.for_deployment(deployment)
            assert fast is not None
            got = {}
            for name, pipe in (("redis-py", deployment.client.pipeline(transaction=False)), ("fast", fast.pipeline())):
                pipe.evalsha(UNKNOWN_SHA, 0)
                with pytest.raises(RedisError) as caught:
                    await pipe.execute()
                got[name] = (type(caught.value), isinstance(caught.value, errors.REDIS_DOWN), errors.may_run_late(caught.value))
            fast.close()
            await deployment.aclose()
            assert got["fast"] == got["redis-py"], url
    finally:
        server.close()
        for writer in accepted:
            writer.close()
