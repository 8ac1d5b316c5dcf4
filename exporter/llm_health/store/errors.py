"""Which Redis answers a caller outlives and which it does not: one classification for the
lease library, the waiters, the admission queue and the gate, the exporter's view and the
restarter's shared state.

A failover, a replica's resync or a Cluster settling answers, for a while, with errors
that mean "not now" rather than "never":

- the connection broke, or timed out (the old primary died, a paused server);
- ``NOREPLICAS``: the primary has ``min-replicas-to-write`` set and fewer good replicas
  (after a failover, until a replica has resynced);
- ``READONLY``: the server was a primary and is a replica now (a demotion);
- ``LOADING``: the server is loading its dataset (a restart, a full resync);
- ``MASTERDOWN``: a replica whose link to its primary is down (``replica-serve-stale-data no``);
- ``CLUSTERDOWN``, ``TRYAGAIN``, ``MOVED``, ``ASK``, a slot no node serves: a Cluster
  settling, a slot migrating;
- ``UNBLOCKED``: a blocked command (``WAIT``) cut short because the server was demoted.

They are *retryable*: a waiter tries again soon, until its deadline; a claim refused that
way is "not yet", never an exception to the caller; the gate treats Redis as down (the
route's ``redis_down`` policy). Any other error reply (a script's bug, a wrong type, an
out-of-memory refusal, ``NOPERM``) is an answer: it is raised or logged as it is.

redis-py gives some of these their own classes and the others (``NOREPLICAS`` among
them) a plain ``ResponseError``, and a script that met one inside ``redis.call`` returns
it under the script's own error; so the test is on the class and on the reply's code.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from .codes import RETRYABLE_CODES, StoreError  # the error codes (an error reply's first word) of a failover or a resync
from .connection import TRANSIENT
from .records import LeaseError


class NotReplicated(LeaseError, RedisError):
    """A write the primary applied but fewer replicas than required acknowledged in
    time: it may be lost in a failover, so it does not count (the caller undoes it)."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int, replies: Sequence[Any]):
        super().__init__(f"write acknowledged by {acked} replica(s) of the {wanted} required within {timeout_ms} ms (WAIT)")
        self.acked, self.wanted, self.replies = acked, wanted, list(replies)


# The classes redis-py raises for them (MovedError is an AskError); a connection error or
# a timeout (TRANSIENT: BusyLoadingError is a ConnectionError too).
RETRYABLE_TYPES: tuple[type[BaseException], ...] = (
    *TRANSIENT,
    BusyLoadingError,
    ReadOnlyError,
    MasterDownError,
    ClusterDownError,
    TryAgainError,
    AskError,
    SlotNotCoveredError,
)

# Every error a Redis call can raise: what a caller that must never crash catches.
ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT, RedisError)

# A code inside a script's error (`... script: ...: -NOREPLICAS ...`, older servers).
_INNER_CODE = re.compile(r"(?:^|[\s:-])(" + "|".join(sorted(RETRYABLE_CODES)) + r")\b")


_PIPELINE = "of pipeline caused error: "  # redis-py's prefix on a pipeline's first error reply


def _reply(exc: ResponseError) -> str:
    message = str(exc.args[0]) if exc.args else ""
    if message.startswith("Command # ") and _PIPELINE in message:
        return message.split(_PIPELINE, 1)[1]
    return message


def code(exc: BaseException) -> str | None:
    """The error code of an error reply (its first word), None for anything else."""
    if not isinstance(exc, ResponseError):
        return None
    first = _reply(exc).split(" ", 1)[0]
    return first if first.isupper() else None


def retryable(exc: BaseException) -> bool:
    """True for what a failover or a resync answers (see the module's docstring)."""
    if isinstance(exc, (*RETRYABLE_TYPES, NotReplicated)):
        return True
    if isinstance(exc, RedisClusterException):
        # redis-py's own: the slot map cannot be had now (every node refused or died).
        return True
    if not isinstance(exc, ResponseError):
        return False
    found = code(exc)
    if found in RETRYABLE_CODES:
        return True
    reply = _reply(exc)
    return bool(_INNER_CODE.search(reply)) if found in ("ERR", None) and "script" in reply.lower() else False


class RedisDown(StoreError, RedisError):
    """An error reply of a failover or a resync (`retryable`), as a class: what the gate's
    doors catch as "Redis down" beside the connection errors."""


# Redis is down, unreachable or failing over: a door's route applies its redis_down
# policy. An error reply that means the same (NOREPLICAS, a script's READONLY) is turned
# into RedisDown where it is caught (`as_down`).
REDIS_DOWN: tuple[type[BaseException], ...] = (*RETRYABLE_TYPES, RedisDown)


def as_down(exc: RedisError) -> RedisError:
    """``exc`` as RedisDown when it is a failover's or a resync's answer (NOREPLICAS, ...)."""
    return RedisDown(str(exc)) if retryable(exc) else exc


def may_run_late(exc: BaseException) -> bool:
    """A command was sent and no answer came in time: Redis may run it later (a stall, a
    paused VM). A refused connection or a failover's error reply ran nothing."""
    return isinstance(exc, (TimeoutError, RedisTimeoutError))


@contextlib.contextmanager
def suppress_retryable() -> Iterator[None]:
    """``contextlib.suppress`` for the retryable errors only; any other goes on."""
    try:
        yield
    except Exception as exc:
        if not retryable(exc):
            raise
