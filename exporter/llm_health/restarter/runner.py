"""Running a restart command: an argv without a shell, in its own process group, with a
timeout on the command's own exit, its output written to a file.

A restart command may start the server in the background (`nohup vllm serve ... &`,
`setsid ...`): the server then inherits the command's stdout. So the output goes to a
file, never to a pipe:

* the command's own exit is what counts: nothing waits for the processes it left behind
  (with a pipe, the reader would see end-of-file only when the server exits);
* nothing the command started is ever killed or broken: past the timeout only the
  command's own process is signalled, never its process group, and a file has no reader
  to lose (a pipe whose reader went away kills the next writer with SIGPIPE);
* the tail shown on /status is read from the file when the command exits.

A process left behind may keep writing to the file; `OutputFiles.enforce` truncates a
file that grows past its bound, so the restarter's disk use stays bounded too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("llm_health.restarter")


@dataclass
class CommandResult:
    outcome: str  # ok, failed, timeout, error
    exit_code: int | None
    pid: int | None
    output: str
    output_bytes: int  # the file's size when the command ended; `output` is its tail
    truncated: bool
    seconds: float
    detail: str = ""
    output_file: str = ""


def read_tail(path: str, limit: int) -> tuple[str, int]:
    """The last `limit` bytes of a file (decoded, invalid bytes replaced) and its size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError:
        return "", 0
    return data.decode("utf-8", errors="replace"), size


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


async def run_command(
    argv: Sequence[str],
    timeout: float,
    output_file: str | os.PathLike[str],
    kill_grace: float = 5.0,
    max_output_bytes: int = 16384,
    env: dict[str, str] | None = None,
) -> CommandResult:
    """Run argv without a shell in a new session, stdout and stderr appended to
    `output_file` (created 0600). Wait for the command's own exit only; past `timeout`
    SIGTERM the command's process, SIGKILL it after `kill_grace`. Processes it started
    are never signalled: one of them may be the server it was asked to start."""
    start = time.monotonic()
    path = os.fspath(output_file)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return CommandResult("error", None, None, "", 0, False, 0.0, f"cannot open the output file {path}: {exc.strerror or exc}", path)
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True, env=env)
    except OSError as exc:
        return CommandResult("error", None, None, "", 0, False, time.monotonic() - start, f"cannot start {argv[0]!r}: {exc.strerror or exc}", path)
    finally:
        os.close(fd)  # the child has its own copy
    timed_out = False
    how = "SIGTERM"
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
            _signal(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), kill_grace)
            except TimeoutError:
                how = f"SIGTERM, then SIGKILL after {kill_grace:g}s"
                _signal(proc.pid, signal.SIGKILL)
                await proc.wait()
    except asyncio.CancelledError:
        _signal(proc.pid, signal.SIGKILL)
        raise
    seconds = time.monotonic() - start
    output, size = read_tail(path, max_output_bytes)
    truncated = size > max_output_bytes
    if timed_out:
        detail = f"did not exit within {timeout:g}s: killed ({how} to pid {proc.pid}; processes it started were left alone)"
        return CommandResult("timeout", proc.returncode, proc.pid, output, size, truncated, seconds, detail, path)
    if proc.returncode != 0:
        return CommandResult("failed", proc.returncode, proc.pid, output, size, truncated, seconds, f"exited {proc.returncode}", path)
    return CommandResult("ok", 0, proc.pid, output, size, truncated, seconds, "exited 0", path)


class OutputFiles:
    """The restart (and drain) commands' output files in one directory: named per kind and
    action, the newest `keep` of each kind kept, each truncated when something (a server the command left running) grows
    it past `max_bytes`."""

    def __init__(self, directory: str | os.PathLike[str] | None, keep: int = 100, max_bytes: int = 16 * 1024 * 1024):
        self.directory = Path(directory) if directory is not None else None
        self.keep = keep
        self.max_bytes = max_bytes
        self.kinds: dict[str, deque[Path]] = {}  # per kind of command (restart, drain): the newest `keep` of each
        self._warned: set[Path] = set()

    @property
    def files(self) -> list[Path]:
        return [p for q in self.kinds.values() for p in q]

    def prepare(self) -> Path:
        """The directory, made (0700) if missing; without one configured, a new private one
        under the system's temporary directory."""
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="llm-health-restarter-"))
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.directory

    def new(self, backend: str, action: int, kind: str = "restart") -> Path:
        directory = self.prepare()
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in backend)[:64]
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        path = directory / f"{kind}-{safe}-{action}-{stamp}-{os.getpid()}.log"
        files = self.kinds.setdefault(kind, deque())
        files.append(path)
        while len(files) > self.keep:
            old = files.popleft()
            with contextlib.suppress(OSError):
                old.unlink()
            self._warned.discard(old)
        return path

    def enforce(self) -> None:
        """Truncate any file past `max_bytes` (writers open it O_APPEND and go on at its new end)."""
        for path in self.files:
            try:
                if path.stat().st_size <= self.max_bytes:
                    continue
                os.truncate(path, 0)
            except OSError:
                continue
            if path not in self._warned:
                self._warned.add(path)
                log.warning(
                    "%s grew past %d bytes after its restart command ended: a process it left running writes to it; truncated "
                    "(redirect that server's output in the restart script)",
                    path,
                    self.max_bytes,
                )
