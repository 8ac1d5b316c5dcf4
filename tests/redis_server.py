"""A real ``redis-server`` for tests and benchmarks: free port on 127.0.0.1, no
persistence, keyspace events on, killed at teardown.

Tests get it through the fixtures of ``tests/conftest_redis.py``; benchmarks use it
directly::

    with RedisServer() as server:
        url = server.url
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


class RedisServerMissing(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    path = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
    if not path:
        raise RedisServerMissing(
            "redis-server not found: apt-get install -y redis-server (or set REDIS_SERVER)"
        )
    return path


class RedisServer:
    """One ``redis-server`` process. ``kill()`` then ``start()`` restarts it on the
    same port (empty: there is no persistence), as a real crash and restart would."""

    def __init__(self, notify_keyspace_events: str = "Egx", port: int | None = None, extra_args: tuple[str, ...] = ()):
        self.binary = find_redis_server()
        self.notify = notify_keyspace_events
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.dir = tempfile.mkdtemp(prefix="llm-health-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--notify-keyspace-events", self.notify,
            "--daemonize", "no",
            "--loglevel", "warning",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            if self._ping():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the crash case. Waits until the process is gone."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
