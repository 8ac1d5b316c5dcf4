"""Running a restart command: an argv without a shell, in its own process group, with a
timeout, its output's tail kept."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class CommandResult:
    outcome: str  # ok, failed, timeout, error
    exit_code: int | None
    pid: int | None
    output: str
    output_bytes: int  # all the command wrote; `output` is its tail
    truncated: bool
    seconds: float
    detail: str = ""


class _Tail:
    def __init__(self, limit: int):
        self.limit = limit
        self.buf = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        self.buf += chunk
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def run_command(
    argv: Sequence[str], timeout: float, kill_grace: float = 5.0, max_output_bytes: int = 16384, env: dict[str, str] | None = None
) -> CommandResult:
    """Run argv without a shell in its own process group; past `timeout`, SIGTERM the
    group, then SIGKILL it after `kill_grace`. stdout and stderr together, the tail kept."""
    start = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True, env=env
        )
    except OSError as exc:
        return CommandResult("error", None, None, "", 0, False, time.monotonic() - start, f"cannot start {argv[0]!r}: {exc.strerror or exc}")
    tail = _Tail(max_output_bytes)

    stdout = proc.stdout
    assert stdout is not None  # PIPE

    async def pump() -> None:
        while chunk := await stdout.read(65536):
            tail.add(chunk)

    reader = asyncio.create_task(pump())
    timed_out = False
    how = "SIGTERM"
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
            _killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), kill_grace)
            except TimeoutError:
                how = f"SIGTERM, then SIGKILL after {kill_grace:g}s"
            # Whatever is left of the group (the leader, or children that ignored SIGTERM).
            _killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    except asyncio.CancelledError:
        _killpg(proc.pid, signal.SIGKILL)
        reader.cancel()
        raise
    # A child that outlived the command may still hold the pipe: take what came, then stop.
    try:
        await asyncio.wait_for(reader, 1.0)
    except TimeoutError:
        pass
    seconds = time.monotonic() - start
    output = tail.buf.decode("utf-8", errors="replace")
    truncated = tail.total > len(tail.buf)
    if timed_out:
        return CommandResult(
            "timeout", proc.returncode, proc.pid, output, tail.total, truncated, seconds, f"killed after {timeout:g}s ({how} to process group {proc.pid})"
        )
    if proc.returncode != 0:
        return CommandResult("failed", proc.returncode, proc.pid, output, tail.total, truncated, seconds, f"exited {proc.returncode}")
    return CommandResult("ok", 0, proc.pid, output, tail.total, truncated, seconds, "exited 0")
