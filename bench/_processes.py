"""The benchmarks' server processes: a process tree, its CPU time (precise where the kernel
shows it), pinning to CPUs, and waiting for a port (bench_admission and lua_door_profile)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import subprocess
import time
from pathlib import Path

from tests.harness.processes import descendants


def tree(pid: int) -> list[int]:
    """The pid and every descendant of it alive now."""
    return [pid, *(p for p, _ in descendants(pid))]


def _on_cpu_ms(sched: str) -> float:
    """The scheduler's on-CPU time of one thread, in ms with nanoseconds (/proc/.../sched)."""
    for line in sched.splitlines():
        if line.startswith("se.sum_exec_runtime"):
            return float(line.rsplit(":", 1)[1])
    raise ValueError("no se.sum_exec_runtime")


# Where the kernel shows each thread's on-CPU time in nanoseconds (CONFIG_SCHED_DEBUG: Debian's
# and most distributions' kernels), CPU time is read from it: utime and stime come in clock
# ticks (10 ms) charged to whoever runs at the tick, so a 3 s half at 500 requests/s holds
# some 15 to 70 ticks of one process, and a difference of two paths' CPU per request read
# from them swings by a third between runs of the same code.
PRECISE_CPU = Path("/proc/self/sched").exists() and "se.sum_exec_runtime" in Path("/proc/self/sched").read_text()


def cpu_seconds(root: int) -> float:
    """CPU seconds of this process and its descendants so far: every thread's on-CPU time
    where the kernel shows it (PRECISE_CPU), else user plus system time in clock ticks."""
    total = 0.0
    for p in tree(root):
        if not PRECISE_CPU:
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14 and 15)
            continue
        with contextlib.suppress(OSError):
            for t in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError, ValueError):  # a thread gone since the listing
                    total += _on_cpu_ms(Path(f"/proc/{p}/task/{t}/sched").read_text()) / 1000
    return total


def pin(pids: list[int], cpus: set[int]) -> None:
    for root in pids:
        for p in tree(root):
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{p}/task"):  # every thread: a pid's own affinity is its main thread's
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(int(task), cpus)


def wait_port(port: int, proc: subprocess.Popen | mp.Process | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        if isinstance(proc, subprocess.Popen) and proc.poll() is not None:
            raise RuntimeError(f"a server exited with {proc.returncode} before listening on {port}")
        time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")
