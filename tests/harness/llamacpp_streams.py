"""The streaming completions the llama.cpp harness (tests/harness/llamacpp.py) runs: one
per thread, each cancellable by closing its connection (llama-server frees the slot
within a second), a load of them, and what a freeze in decode found."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass, field

from tests.harness.freeze_thread import FrozenThread


@dataclass
class Stream:
    """One streaming completion running in a thread. `cancel()` closes its connection:
    llama-server notices within a second and frees the slot."""

    status: int | None = None
    events: int = 0  # SSE data events received
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _conn: http.client.HTTPConnection | None = None
    _cancelled: bool = False

    def run(self, host: str, port: int, body: dict, timeout: float) -> None:
        try:
            self._conn = http.client.HTTPConnection(host, port, timeout=timeout)
            self._conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = self._conn.getresponse()
            self.status = resp.status
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                self.events += 1
                with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                    msg = json.loads(data)
                    if msg.get("usage"):
                        self.completion_tokens = msg["usage"].get("completion_tokens")
                    reason = msg["choices"][0].get("finish_reason") if msg.get("choices") else None
                    self.finish_reason = reason or self.finish_reason
        except Exception as e:
            if not self._cancelled:
                self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()

    def cancel(self) -> None:
        self._cancelled = True
        sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


@dataclass
class Load:
    streams: list[Stream] = field(default_factory=list)

    @property
    def events(self) -> int:
        return sum(s.events for s in self.streams)

    def done(self) -> bool:
        return all(s.done.is_set() for s in self.streams)

    def wait(self, timeout: float = 600) -> list[Stream]:
        deadline = time.monotonic() + timeout
        for s in self.streams:
            s.done.wait(max(0.0, deadline - time.monotonic()))
        return self.streams

    def cancel(self, timeout: float = 30) -> None:
        for s in self.streams:
            s.cancel()
        self.wait(timeout)


@dataclass
class Freeze:
    """What `frozen_in_decode` found: when the thread stopped (monotonic), the frozen
    snapshot of llama.cpp's series, and how many freezes it took to land in a decode."""

    frozen_at: float
    snapshot: dict[str, float]
    attempts: int
    thread: FrozenThread | None = None  # the freeze itself (hand_over_to_sigstop)
