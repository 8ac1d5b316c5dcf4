"""store.errors: the one classification of Redis answers (retryable during a failover or a
resync, or an answer), as redis-py raises them: its own classes, a plain ResponseError
(NOREPLICAS has none), a pipeline's annotated first error, a script's error."""

from __future__ import annotations

import pytest
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    DataError,
    MasterDownError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from llm_health.store.errors import NotReplicated, code, retryable, suppress_retryable

RETRYABLE = [
    ResponseError("NOREPLICAS Not enough good replicas to write."),
    ResponseError("NOREPLICAS Not enough good replicas to write. script: 57d2576, on @user_script:3."),
    ResponseError("Command # 3 (EVALSHA 57d2576 1 x) of pipeline caused error: NOREPLICAS Not enough good replicas to write."),
    ResponseError("UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)"),
    ResponseError("ERR Error running script (call to f_57d2576): @user_script:1: -READONLY You can't write against a read only replica."),
    ReadOnlyError("You can't write against a read only replica."),
    BusyLoadingError("Redis is loading the dataset in memory"),
    MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    ClusterDownError("The cluster is down"),
    TryAgainError("Multiple keys request during rehashing of slot"),
    MovedError("3999 127.0.0.1:6381"),
    AskError("3999 127.0.0.1:6381"),
    SlotNotCoveredError("no node serves slot 3999"),
    RedisConnectionError("Connection refused"),
    RedisTimeoutError("Timeout reading from socket"),
    ConnectionResetError(),
    TimeoutError(),
    NotReplicated(0, 1, 500, []),
]

ANSWERS = [
    ResponseError("ERR wrong number of arguments for 'get' command"),
    ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    ResponseError("Command # 1 (EVALSHA x 0) of pipeline caused error: ERR user_script:1: Script attempted to access nonexistent global variable"),
    ResponseError("ERR Error running script (call to f_1): @user_script:1: user_script:1: attempt to compare nil with number"),
    NoScriptError("NOSCRIPT No matching script."),
    OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."),
    NoPermissionError("NOPERM this user has no permissions"),
    DataError("Invalid input of type: 'dict'"),
    ValueError("not Redis at all"),
]


@pytest.mark.parametrize("exc", RETRYABLE, ids=lambda e: f"{type(e).__name__}:{str(e)[:30]}")
def test_a_failovers_answers_are_retryable(exc: BaseException) -> None:
    assert retryable(exc)


@pytest.mark.parametrize("exc", ANSWERS, ids=lambda e: f"{type(e).__name__}:{str(e)[:30]}")
def test_any_other_answer_is_not(exc: BaseException) -> None:
    assert not retryable(exc)


def test_the_code_of_a_pipelines_error_is_the_replys() -> None:
    assert code(ResponseError("Command # 3 (EVALSHA a 1 b) of pipeline caused error: NOREPLICAS Not enough")) == "NOREPLICAS"
    assert code(ResponseError("NOREPLICAS Not enough good replicas")) == "NOREPLICAS"
    assert code(ValueError("NOREPLICAS")) is None


def test_suppress_retryable_lets_any_other_error_through() -> None:
    with suppress_retryable():
        raise ResponseError("NOREPLICAS Not enough good replicas to write.")
    with pytest.raises(ResponseError, match="WRONGTYPE"), suppress_retryable():
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
