"""A process something else started (a restart script), taken over by its pid: what a
harness's `close()` and `wait_ready()` need of a Popen. Standard library only."""

from __future__ import annotations

import subprocess
import time


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return stat[stat.rfind(")") + 2 :].split()[0]


class Adopted:
    """Not this process's child, so it cannot be waited for: gone is gone from /proc (or a zombie)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if _state(self.pid) in ("", "Z"):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.1)
        return -1
