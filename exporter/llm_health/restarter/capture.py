"""The stacks of a hung engine's processes, read before the restart destroys them.

Runs only inside an accepted restart whose hang the restarter has confirmed (action.py),
within the backend's `capture.budget`: every step (finding the pids, each dump) gets what
is left of it, and a step past it is killed, so the restart waits no longer than that.

Finding the processes (`config.capture`): a pid file, a command that prints pids (an
argv, no shell), or the process listening on the backend URL's port when the URL is on
this host (/proc/net/tcp{,6} and each process's socket descriptors); then their
descendants (vLLM's EngineCore and workers are children of the API server).

Reading them, argv only, never a shell:

* Python (the executable or a loaded libpython says so): `py-spy dump --nonblocking`,
  which reads the process's memory without stopping it, and so without resuming a
  stopped one (a SIGSTOPped EngineCore stays stopped). `--native` needs py-spy to pause
  the process (it refuses it with `--nonblocking`): only with `capture.native`, and never
  on a stopped process. No `--locals` (they can hold prompts and keys).
* native (an engine that is a compiled binary, no Python): `gdb -batch` (`thread apply all bt`), or `eu-stack` when gdb is
  missing or fails; both attach with ptrace for the length of the dump.

What could not be read is recorded with a bounded reason (FAILURES).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from ..config.capture import Capture

# Bounded reasons, the label values of llm_restarter_capture_failures_total.
FAILURES = (
    "not_local",  # the backend's URL is on another host and no pid_file/pids_command is set
    "no_process",  # no process found (pid file, command or port)
    "pid_lookup_failed",  # the pid file or command failed
    "tool_missing",  # py-spy, gdb or eu-stack is not installed (or not where configured)
    "no_permission",  # ptrace or /proc access refused (another user, no SYS_PTRACE, Yama)
    "traced",  # another tracer (a debugger) holds the process or one of its threads
    "process_exited",  # the process went away before or during the dump
    "timeout",  # the dump ran past what was left of the budget
    "budget_spent",  # nothing of the budget was left for this process
    "failed",  # the tool failed otherwise (its output is kept)
)

MAX_STACK_BYTES = 1024 * 1024  # one dump's output kept, at most
PIDS_OUTPUT_BYTES = 64 * 1024
# A flag on a command line (`--api-key X`, `--token=X`, `-password X`): starts the line or
# follows a space or a quote, so "inter-token latency" in a dump's text is no flag.
# In the index's JSON an argv is a list: `"--api-key", "X"`.
_SECRET_FLAG = re.compile(r"((?:^|(?<=[\s'\"]))--?(?:api[-_]?key|token|password|secret)(?:=|[ ]+|\",\s*\"))[^\s\"']+", re.IGNORECASE | re.MULTILINE)


@dataclass
class ProcessInfo:
    pid: int
    ppid: int
    comm: str
    exe: str
    state: str
    python: bool
    tracer: int  # a tracer of the process or one of its threads (0: none)

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass
class Dump:
    pid: int
    tool: str
    argv: list[str]
    outcome: str  # ok, or a reason of FAILURES
    seconds: float
    text: str = ""
    truncated: bool = False
    detail: str = ""


@dataclass
class CaptureResult:
    processes: list[ProcessInfo] = field(default_factory=list)
    dumps: list[Dump] = field(default_factory=list)
    failures: list[dict[str, object]] = field(default_factory=list)  # {pid, reason, detail}
    maps: dict[int, str] = field(default_factory=dict)  # a native process's executable mappings: addresses to file offsets
    found_by: str = ""
    seconds: float = 0.0
    budget: float = 0.0

    def fail(self, reason: str, detail: str, pid: int | None = None) -> None:
        assert reason in FAILURES, reason
        self.failures.append({"pid": pid, "reason": reason, "detail": detail})


def redact(text: str, secrets: tuple[str, ...], *, flags: bool = True) -> str:
    """Every configured secret replaced, and with ``flags`` the value of any
    --api-key/--token/--password/--secret flag: a dump prints the process's command line.
    A /metrics payload is evidence: only a configured secret is replaced in it
    (``flags=False``), never a word of the engine's own text."""
    for s in secrets:
        if s:
            text = text.replace(s, "<redacted>")
    return _SECRET_FLAG.sub(lambda m: m.group(1) + "<redacted>", text) if flags else text


# --- /proc -----------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


def process_info(pid: int) -> ProcessInfo | None:
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    rest = stat[stat.rfind(")") + 2 :].split()
    state, ppid = rest[0], int(rest[1])
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    python = "python" in os.path.basename(exe) or "libpython" in _read(f"/proc/{pid}/maps")
    tracer = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            m = re.search(r"^TracerPid:\s*(\d+)", _read(f"/proc/{pid}/task/{tid}/status"), re.MULTILINE)
            if m and int(m.group(1)):
                tracer = int(m.group(1))
                break
    return ProcessInfo(pid, ppid, comm, exe, state, python, tracer)


def executable_maps(pid: int) -> str:
    """The executable mappings of /proc/PID/maps (address range, offset, file): what turns a
    stripped binary's `??` frame into an offset for addr2line on an unstripped build."""
    return "".join(line + "\n" for line in _read(f"/proc/{pid}/maps").splitlines() if len(line.split()) > 1 and "x" in line.split()[1])


def descendants(roots: list[int], limit: int) -> list[int]:
    """The roots and their descendants, parents first, at most `limit`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _read(f"/proc/{entry}/stat")
            if stat:
                ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    queue = list(roots)
    while queue and len(out) < limit:
        pid = queue.pop(0)
        if pid not in out:
            out.append(pid)
            queue.extend(sorted(children.get(pid, [])))
    return out


def _listening_inodes(port: int, host: str) -> set[str]:
    """Inodes of sockets listening on `port`, on `host` or on every address."""
    want = ipaddress.ip_address(host)
    inodes = set()
    for name, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in _read(name).splitlines()[1:]:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A: LISTEN
                continue
            addr_hex, port_hex = cols[1].split(":")
            if int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(addr_hex)
            if v6:
                addr = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                bound: ipaddress.IPv4Address | ipaddress.IPv6Address = addr.ipv4_mapped or addr
            else:
                bound = ipaddress.IPv4Address(raw[::-1])
            if bound.is_unspecified or bound == want or (want.is_loopback and bound.is_loopback):
                inodes.add(cols[9])
    return inodes


def listening_pids(url: str) -> tuple[list[int], str | None]:
    """The processes holding the listening socket of the URL's port: (pids, why not)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return [], f"{parts.hostname} is a host name, not this host's address: set capture.pid_file or capture.pids_command"
    inodes = _listening_inodes(port, str(ip))
    if not inodes:
        why = f"no socket of this host listens on {host}:{port}"
        return [], why if ip.is_loopback else why + " (the backend is on another host? set capture.pid_file or capture.pids_command)"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        pids.append(int(entry))
                        break
    # A pre-forked server shares its socket with its children: keep the topmost.
    found = set(pids)
    roots = [p for p in pids if (info := process_info(p)) is None or info.ppid not in found]
    return sorted(roots), None if roots else f"the socket on port {port} belongs to no process this one can see (another pid namespace?)"


# --- running a tool --------------------------------------------------------------------------
async def run_bounded(argv: list[str], timeout: float, limit: int) -> tuple[int | None, str, bool, bool]:
    """(exit code or None on timeout, output (stdout then stderr), truncated, timed out).
    Its own session; past the timeout its whole process group is killed."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True
    )

    async def bounded(stream: asyncio.StreamReader | None) -> tuple[bytes, bool]:
        kept, over = bytearray(), False
        while stream is not None and (chunk := await stream.read(65536)):
            room = limit - len(kept)
            if len(chunk) > room:
                over = True
            kept += chunk[: max(0, room)]
        return bytes(kept), over

    reading = asyncio.gather(bounded(proc.stdout), bounded(proc.stderr))
    try:
        (out, o1), (err, o2) = await asyncio.wait_for(reading, max(0.01, timeout))
        code: int | None = await proc.wait()
        timed_out = False
    except (TimeoutError, asyncio.CancelledError) as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        if isinstance(exc, asyncio.CancelledError):
            raise
        return None, "", False, True
    text = out.decode("utf-8", "replace")
    if err:
        text += ("\n" if text else "") + err.decode("utf-8", "replace")
    return code, text, o1 or o2, timed_out


def resolve_tool(name: str) -> str | None:
    """A tool's path: as configured (a path), on PATH, or beside this Python (py-spy's wheel)."""
    if "/" in name:
        return name if os.access(name, os.X_OK) else None
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if os.access(beside, os.X_OK) else None


def argv_for(tool: str, path: str, pid: int, cfg: Capture, info: ProcessInfo) -> list[str]:
    if tool == "py-spy":
        argv = [path, "dump", "--pid", str(pid)]
        # --native pauses the process (py-spy refuses it with --nonblocking): never a stopped one.
        return argv + (["--native"] if cfg.native and info.state not in ("T", "t") else ["--nonblocking"])
    if tool == "gdb":
        return [path, "-batch", "-nx", "-p", str(pid), "-ex", "set pagination off", "-ex", "info threads", "-ex", "thread apply all bt 40"]
    return [path, "-p", str(pid)]  # eu-stack


_FRAMES = {"py-spy": re.compile(r"^Thread ", re.MULTILINE), "gdb": re.compile(r"^#\d+ ", re.MULTILINE), "eu-stack": re.compile(r"^#\d+ ", re.MULTILINE)}


def classify(tool: str, code: int | None, text: str, pid: int, tracer: int) -> tuple[str, str]:
    """(outcome, detail) of a finished dump."""
    has_frames = bool(_FRAMES[tool].search(text))
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
    if has_frames:
        partial = code not in (0, None) or "Operation not permitted" in text
        return "ok", (f"some threads unread: {last[:300]}" if partial else "")
    gone = process_info(pid)
    if gone is None or gone.state in ("Z", "X"):
        return "process_exited", f"the process exited during the dump ({last[:300]})"
    if "already traced" in text or tracer:
        return "traced", f"another tracer (pid {tracer or '?'}) holds the process: {last[:300]}"
    if re.search(r"permission denied|operation not permitted|EPERM|ptrace_scope", text, re.IGNORECASE):
        return "no_permission", f"{last[:300]} (the restarter needs ptrace rights on the engine: same user or CAP_SYS_PTRACE, and Yama's ptrace_scope)"
    return "failed", f"exit {code}: {last[:300]}"


def tools_for(info: ProcessInfo, cfg: Capture) -> list[str]:
    if cfg.stacks != "auto":
        return [cfg.stacks]
    return ["py-spy"] if info.python else ["gdb", "eu-stack"]


async def dump(info: ProcessInfo, cfg: Capture, deadline: float, result: CaptureResult) -> None:
    """Each tool for the process in turn until one reads it; every failure recorded."""
    paths = {"py-spy": cfg.py_spy, "gdb": cfg.gdb, "eu-stack": cfg.eu_stack}
    for tool in tools_for(info, cfg):
        left = deadline - time.monotonic()
        if left <= 0.05:
            result.fail("budget_spent", f"no time left of the {cfg.budget:g}s budget for {tool}", info.pid)
            return
        path = resolve_tool(paths[tool])
        if path is None:
            result.fail(
                "tool_missing", f"{paths[tool]} not found (install it: pip install 'llm-health[capture]' for py-spy, apt-get install gdb elfutils)", info.pid
            )
            continue
        argv = argv_for(tool, path, info.pid, cfg, info)
        started = time.monotonic()
        try:
            code, text, truncated, timed_out = await run_bounded(argv, left, MAX_STACK_BYTES)
        except OSError as exc:
            result.fail("tool_missing" if isinstance(exc, FileNotFoundError) else "failed", f"{path}: {exc.strerror}", info.pid)
            continue
        seconds = round(time.monotonic() - started, 3)
        if timed_out:
            outcome, detail = "timeout", f"{tool} ran past the {left:.1f}s left of the budget: killed"
        else:
            outcome, detail = classify(tool, code, text, info.pid, info.tracer)
        result.dumps.append(Dump(info.pid, tool, argv, outcome, seconds, text, truncated, detail))
        if outcome == "ok":
            if detail:  # read, but not every thread
                result.fail("traced" if info.tracer else "no_permission", f"{tool}: {detail}", info.pid)
            return
        result.fail(outcome, f"{tool}: {detail}", info.pid)
        if outcome in ("process_exited", "timeout"):
            return


async def find_pids(url: str, cfg: Capture, deadline: float, result: CaptureResult) -> list[int]:
    if cfg.pid_file:
        result.found_by = f"pid_file {cfg.pid_file}"
        text = _read(cfg.pid_file).strip()
        if not text.isdigit():
            result.fail("pid_lookup_failed", f"pid file {cfg.pid_file}: " + ("missing or unreadable" if not text else "not a pid"))
            return []
        return [int(text)]
    if cfg.pids_command:
        result.found_by = f"pids_command {list(cfg.pids_command)}"
        try:
            code, text, _, timed_out = await run_bounded(list(cfg.pids_command), deadline - time.monotonic(), PIDS_OUTPUT_BYTES)
        except OSError as exc:
            result.fail("pid_lookup_failed", f"pids_command: {exc.strerror}")
            return []
        if timed_out or code != 0:
            result.fail("pid_lookup_failed", "pids_command " + ("timed out" if timed_out else f"exited {code}: {text.strip()[-300:]}"))
            return []
        return [int(t) for t in text.split() if t.isdigit() and int(t) > 0]
    result.found_by = "the process listening on the backend's port"
    pids, why = await asyncio.to_thread(listening_pids, url)  # every process's descriptors: off the loop
    if why:
        result.fail("not_local" if "host name" in why or "another host" in why else "no_process", why)
    return pids


async def capture(url: str, cfg: Capture) -> CaptureResult:
    """Find the engine's processes and read their stacks, within `cfg.budget`."""
    started = time.monotonic()
    deadline = started + cfg.budget
    result = CaptureResult(budget=cfg.budget)
    try:
        roots = await find_pids(url, cfg, deadline, result)
        pids = descendants(roots, cfg.max_processes) if cfg.tree else roots[: cfg.max_processes]
        for pid in pids:
            info = process_info(pid)
            if info is None:
                result.fail("process_exited" if pid not in roots else "no_process", f"process {pid} is gone", pid)
                continue
            result.processes.append(info)
        for info in result.processes:
            await dump(info, cfg, deadline, result)
            if not info.python:
                result.maps[info.pid] = executable_maps(info.pid)
    finally:
        result.seconds = round(time.monotonic() - started, 3)
    return result
