"""Process and port helpers the engine harnesses share. Standard library only."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_logged(argv: list[str], log_path: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A server in its own process group (so a test can signal all of it), stdout and
    stderr to `log_path`, no stdin."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=str(cwd))


def proc_state(pid: int) -> str:
    """One-letter state of a process ('T' when stopped, 'Z' a zombie), '' if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return stat[stat.rfind(")") + 2 :].split()[0]


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot, /proc/PID/stat field 22), None if
    gone: with its pid, what tells this process from a later one given the same pid (pid
    numbers wrap: 32768 by default, and a test run spawns that many processes and threads)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[19])


def listener_pids(port: int) -> list[int]:
    """The pids holding a listening TCP socket on `port` (IPv4, any address), from /proc:
    who answers there when the process a test started there is gone."""
    inodes = set()
    try:
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    except OSError:
        return []
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.append(int(pid))
        except OSError:
            continue
    return sorted(pids)


def signal_same(pid: int, started: int | None, sig: int) -> bool:
    """Send `sig` to pid only while it is still the process that started at `started`;
    whether it was sent. A harness that outlives its engine must not stop a stranger."""
    if started is None or start_time(pid) != started:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_port_free(host: str, port: int, timeout: float, pause: float = 0.2) -> bool:
    """Until `port` can be bound again (it lingers a moment after its server exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return True
            except OSError:
                time.sleep(pause)
    return False


class Adopted:
    """A process something else started (a restart script), taken over by its pid: what a
    harness's `close()` and `wait_ready()` need of a Popen. Not this process's child, so
    it cannot be waited for: gone is gone from /proc (or a zombie)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if proc_state(self.pid) in ("", "Z"):
            self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.1)
        return -1


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, comm) for every process we can read."""
    table: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        # comm is in parentheses and may contain spaces or ')'
        lpar, rpar = stat.find("("), stat.rfind(")")
        comm = stat[lpar + 1 : rpar]
        rest = stat[rpar + 2 :].split()
        table[int(entry)] = (int(rest[1]), comm)
    return table


def descendants(pid: int) -> list[tuple[int, str]]:
    """All descendants of pid as (pid, comm), breadth first."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (pp, _) in table.items():
        children.setdefault(pp, []).append(p)
    out: list[tuple[int, str]] = []
    queue = list(children.get(pid, []))
    while queue:
        p = queue.pop(0)
        out.append((p, table[p][1]))
        queue.extend(children.get(p, []))
    return out
