"""The fast path of redis-py's pipeline for the doors' hot path: one multiplexed connection
to one Redis server for a door's decision script and the batched attempt finishes
(`gate.decision`), without redis-py's pool, pipeline, retry and per-command timeout
layers, which cost more CPU per request than the decision itself (docs/benchmarks.md,
"Profile of decide").

The seam is `Pipe`: what `AdmissionQueue._pipelined` writes its scripts on and sends in
one round trip. redis-py's `Pipeline` (`transaction=False`, `AdmissionQueue.pipeline`) is
the library counterpart; `FastPipe` (`FastRedis.pipeline`) is this module's.
tests/integration/test_fast_redis_parity.py runs the same pipelines through both on a real
redis-server (docs/architecture.md, "Fast paths and their library counterparts").

hiredis packs the commands and parses the replies; what is written here is the queue of
callers waiting for their replies (Redis answers in the order it was sent, so the replies
are matched first in, first out) and the errors, raised as redis-py's classes so that
`store.errors` reads them as it reads redis-py's: a refused or broken connection is a
`ConnectionError` (nothing ran), no answer within the socket timeout a `TimeoutError`
(it was sent: it may run late), on which the connection is closed and every caller
waiting on it gets the same error; the next call connects again. An error reply is raised
as redis-py's parser makes it (its class by the reply's code: `NoScriptError` for
NOSCRIPT, `ReadOnlyError` for READONLY, ...; else `ResponseError`), without the
"Command # n (...) of pipeline caused error:" that redis-py's pipeline puts before its text. The
replies are hiredis' bytes, where the deployment's redis-py client decodes them
(`decode_responses`): their readers take both (`store.connection.text`).

Used only where the gate talks to one server over plain TCP (`for_deployment`): Sentinel,
Cluster and TLS keep redis-py, which follows failovers, slots and certificates.
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Any, Protocol

import hiredis
from redis._parsers import BaseParser  # the error replies' classes, as redis-py's own parsers read them
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .deployment import Deployment

_Waiter = tuple[asyncio.Future[list[Any]], int, list[Any]]  # the caller, replies wanted, replies read


class Pipe(Protocol):
    """The seam: a pipeline of the admission queue's scripts (`AdmissionQueue._pipelined`
    writes on it), sent in one round trip by `execute`: the replies in order, the first
    error reply raised as redis-py raises it. redis-py's `Pipeline` and `FastPipe` are
    both one (`command_stack` holds each one's own form of a command)."""

    command_stack: list[Any]

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> Any: ...

    async def execute(self) -> list[Any]: ...


if TYPE_CHECKING:  # mypy holds the library counterpart to the seam too
    from redis.asyncio.client import Pipeline

    _LIBRARY: type[Pipe] = Pipeline


class FastPipe:
    """The commands of one round trip on `FastRedis`: what `AdmissionQueue._pipelined`
    writes, sent by `execute` (again, after a NOSCRIPT: the commands are kept)."""

    def __init__(self, redis: FastRedis) -> None:
        self.redis = redis
        self.command_stack: list[tuple[Any, ...]] = []

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> None:
        self.command_stack.append(("EVALSHA", sha, numkeys, *keys_and_args))

    async def execute(self) -> list[Any]:
        return await self.redis.execute(self)


def _error(reply: hiredis.ReplyError) -> ResponseError:
    """The error reply as redis-py's parser makes it (its class by the reply's code:
    NoScriptError, ReadOnlyError, BusyLoadingError, ...; the code taken off the text)."""
    error: ResponseError = BaseParser.parse_error(str(reply))
    return error


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: FastRedis):
        self.owner = owner
        self.reader = hiredis.Reader(replyError=hiredis.ReplyError)
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.owner.waiting
        while (reply := self.reader.gets()) is not False:
            if not waiting:  # an answer nobody waits for: the connection is out of step
                self.owner.abort(self, RedisConnectionError("a reply from Redis that no command asked for"))
                return
            future, wanted, replies = waiting[0]
            replies.append(reply)
            if len(replies) == wanted:
                waiting.popleft()
                if not future.done():
                    future.set_result(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.abort(self, RedisConnectionError(f"Redis closed the connection{f': {exc}' if exc else ''}"))


class FastRedis:
    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None, password: str | None = None, timeout: float = 1.0):
        self.host, self.port, self.db = host, port, db
        self.username, self.password = username, password
        self.timeout = timeout
        self.waiting: collections.deque[_Waiter] = collections.deque()
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    @classmethod
    def for_deployment(cls, deployment: Deployment) -> FastRedis | None:
        """The fast path's connection to the deployment's server when it is one server over plain
        TCP (redis-py's own `Connection` class), None otherwise."""
        pool = deployment.server_pool()  # None on Sentinel and Cluster
        if pool is None or pool.connection_class is not Connection or not hasattr(hiredis, "pack_command"):  # hiredis 2.1+
            return None
        kw = pool.connection_kwargs
        timeout = kw.get("socket_timeout") or 1.0
        return cls(
            kw.get("host", "localhost"),
            int(kw.get("port", 6379)),
            db=int(kw.get("db") or 0),
            username=kw.get("username"),
            password=kw.get("password"),
            timeout=timeout,
        )

    def pipeline(self) -> FastPipe:
        return FastPipe(self)

    async def execute(self, commands: FastPipe) -> list[Any]:
        """Send the commands in one write; their replies, or the first error reply raised.
        NOSCRIPT is raised as `NoScriptError`: the caller loads the scripts and sends again."""
        replies = await self.send(commands.command_stack)
        for reply in replies:
            if isinstance(reply, hiredis.ReplyError):
                raise _error(reply)
        return replies

    async def send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        protocol = self._protocol or await self._connect()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self.waiting.append((future, len(commands), []))
        protocol.transport.write(b"".join(hiredis.pack_command(c) for c in commands))
        timer = loop.call_later(self.timeout, self._expire, protocol, future)
        try:
            return await future
        finally:
            timer.cancel()

    def _expire(self, protocol: _Protocol, future: asyncio.Future[list[Any]]) -> None:
        if not future.done():
            self.abort(protocol, RedisTimeoutError(f"no answer from Redis at {self.host}:{self.port} within {self.timeout:g} s"))

    def abort(self, protocol: _Protocol, exc: Exception) -> None:
        """Close ``protocol``'s connection; every caller waiting on it gets ``exc``."""
        if protocol is not self._protocol:
            return
        self._protocol = None
        if protocol.transport is not None:
            protocol.transport.close()
        waiting, self.waiting = self.waiting, collections.deque()  # sent on that connection: all of them
        for future, _, _ in waiting:
            if not future.done():
                future.set_exception(exc)

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
            self._connecting.add_done_callback(lambda _: setattr(self, "_connecting", None))
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                _, protocol = await loop.create_connection(lambda: _Protocol(self), self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis at {self.host}:{self.port}: {exc}") from exc
        self._protocol = protocol
        hello: list[tuple[Any, ...]] = []
        if self.password is not None:
            hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            hello.append(("SELECT", self.db))
        if hello:
            for reply in await self.send(hello):
                if isinstance(reply, hiredis.ReplyError):
                    self.abort(protocol, RedisConnectionError(str(reply)))
                    raise RedisConnectionError(f"Redis refused the connection's setup: {reply}")
        return protocol

    def close(self) -> None:
        if self._protocol is not None:
            self.abort(self._protocol, RedisConnectionError("closed"))
