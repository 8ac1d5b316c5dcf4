"""pytest fixtures for a real redis-server (see redis_server.py).

tests/conftest.py makes them available to every test with
``from tests.conftest_redis import *``.

- ``redis_server``: one server for the whole session (keyspace events ``Egx``),
  flushed before each test that uses ``redis_url``.
- ``redis_url``: its URL, database flushed and notify-keyspace-events reset to ``Egx``.
- ``own_redis_server``: a server for this test alone, for tests that kill it.
- ``redis_server_factory``: start servers with other settings; all killed at teardown.

Tests skip (not fail) when redis-server is not installed, with the install command.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

try:
    from tests.redis_server import RedisServer, RedisServerMissing
except ImportError:  # tests/ on sys.path as plain modules
    from redis_server import RedisServer, RedisServerMissing  # type: ignore[no-redef]


def _redis_command(port: int, *args: str) -> bytes:
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload.encode())
        return s.recv(1024)


def _start(**kwargs: object) -> RedisServer:
    try:
        return RedisServer(**kwargs).start()  # type: ignore[arg-type]
    except RedisServerMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = _start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    if redis_server.proc is None:  # a test killed it
        redis_server.start()
    _redis_command(redis_server.port, "FLUSHALL")
    _redis_command(redis_server.port, "CONFIG", "SET", "notify-keyspace-events", "Egx")
    return redis_server.url


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    server = _start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    started: list[RedisServer] = []

    def make(**kwargs: object) -> RedisServer:
        server = _start(**kwargs)
        started.append(server)
        return server

    try:
        yield make
    finally:
        for server in started:
            server.stop()
