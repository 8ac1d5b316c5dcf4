"""Freeze ONE thread of a running process with ptrace, leaving its other threads running.

Stdlib only (ctypes). Linux only. The tracer must be allowed to trace the process: the same
uid and, under Yama `ptrace_scope` 1 (Ubuntu's default), an ancestor of it. The test
process is the parent of the llama-server it starts, so it may freeze its threads.

    with FrozenThread(pid):          # the main thread (tid == pid)
        ...                          # that thread is in a tracing stop ('t') here

How: PTRACE_SEIZE attaches to the one thread without stopping it or the rest of the
thread group, PTRACE_INTERRUPT stops it (`waitpid(tid, __WALL)` collects the stop), and
PTRACE_DETACH resumes it. SIGSTOP, by contrast, stops every thread of the process.

The ptrace relation belongs to the tracer *thread*, so a `FrozenThread` attaches and
detaches from a thread of its own. If the test process dies, the kernel detaches and the
thread runs again by itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
WALL = 0x40000000  # __WALL: wait for any child or thread, non-leader threads included

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(req: int, tid: int) -> None:
    ctypes.set_errno(0)
    if _libc.ptrace(req, tid, None, None) == -1:
        e = ctypes.get_errno()
        raise OSError(e, f"ptrace({req:#x}, {tid}): {os.strerror(e)}")


def freeze(tid: int) -> None:
    """Attach to thread `tid` and stop it; returns once it is stopped."""
    _ptrace(PTRACE_SEIZE, tid)
    try:
        _ptrace(PTRACE_INTERRUPT, tid)
        _, status = os.waitpid(tid, WALL)
        if not os.WIFSTOPPED(status):
            raise RuntimeError(f"thread {tid} did not stop (wait status {status:#x})")
    except BaseException:
        try:
            _ptrace(PTRACE_DETACH, tid)
        except OSError:
            pass
        raise


def thaw(tid: int) -> None:
    """Detach from thread `tid` (from the thread that froze it); it runs again."""
    _ptrace(PTRACE_DETACH, tid)


def thread_state(pid: int, tid: int) -> str:
    """Scheduler state of a thread: R, S, D, t (tracing stop), T (stopped), '' if gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


class FrozenThread:
    """Thread `tid` of `pid` (default: the main thread) stopped while the block runs."""

    def __init__(self, pid: int, tid: int | None = None, timeout: float = 30.0):
        self.pid = pid
        self.tid = pid if tid is None else tid
        self.timeout = timeout
        self._frozen = threading.Event()
        self._thaw = threading.Event()
        self._thawed = threading.Event()
        self._error: BaseException | None = None
        self._tracer: threading.Thread | None = None

    def _run(self) -> None:
        try:
            freeze(self.tid)
        except BaseException as exc:
            self._error = exc
            self._frozen.set()
            self._thawed.set()
            return
        self._frozen.set()
        self._thaw.wait()
        try:
            thaw(self.tid)
        except OSError:
            pass  # the process is gone
        self._thawed.set()

    def freeze(self) -> FrozenThread:
        if not os.path.isdir(f"/proc/{self.pid}/task/{self.tid}"):
            raise ProcessLookupError(f"no thread {self.tid} in process {self.pid}")
        self._tracer = threading.Thread(target=self._run, name=f"ptrace-{self.tid}", daemon=True)
        self._tracer.start()
        if not self._frozen.wait(self.timeout):
            raise TimeoutError(f"thread {self.tid} did not stop within {self.timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def hand_over_to_sigstop(self) -> None:
        """Leave the whole process SIGSTOPped, the frozen thread where it was, and let go of
        it: a debugger may attach then (two tracers cannot hold one thread). SIGSTOP first,
        so every other thread enters the group stop; the detached thread joins it before it
        runs a user instruction (the kernel re-arms a group stop in effect on detach)."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + self.timeout
        others = [int(t) for t in os.listdir(f"/proc/{self.pid}/task") if int(t) != self.tid]
        while any(thread_state(self.pid, t) not in ("T", "") for t in others):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {self.pid} did not stop")
            time.sleep(0.01)
        self.thaw()
        while thread_state(self.pid, self.tid) not in ("T", ""):
            if time.monotonic() > deadline:
                raise TimeoutError(f"thread {self.tid} did not join the group stop")
            time.sleep(0.01)

    def thaw(self) -> None:
        if self._tracer is None:
            return
        self._thaw.set()
        self._thawed.wait(self.timeout)
        self._tracer = None

    @property
    def frozen(self) -> bool:
        return self._tracer is not None and self._error is None

    def __enter__(self) -> FrozenThread:
        return self.freeze()

    def __exit__(self, *exc: object) -> None:
        self.thaw()
