"""The benchmarks' server processes: `llm-health` as a subprocess (with `decide`'s arguments),
the CPUs split between the load generator and the servers, an engine process stopped with
the run, a process tree, its CPU time (precise where the kernel shows it), pinning to
CPUs, and waiting for a port (bench_admission, lua_door_profile and bench_goodput)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.harness.processes import descendants

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def llm_health(*args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`llm-health ARGS` (this checkout's) for the run, in ``env`` (default: this process's);
    one that exited before the end says so on stderr, with its exit status and the last
    lines of its own stderr (its requests failed: the tables count them)."""
    env = {**(os.environ if env is None else env)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "exporter"), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "llm_health", *args], env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            yield proc
        finally:
            if proc.poll() is not None:
                log.seek(0)
                tail = b"\n".join(log.read().splitlines()[-15:]).decode(errors="replace")
                print(f"llm-health {args[0]} exited {proc.returncode} during the run; its stderr ends:\n{tail}", file=sys.stderr)
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def decide_args(config: Path, port: int, syslog_port: int) -> list[str]:
    """`llm-health decide`'s arguments: its configuration, its port and its syslog port."""
    return ["decide", "--config.file", str(config), "--web.listen-address", f"127.0.0.1:{port}", "--syslog.listen-address", f"127.0.0.1:{syslog_port}"]


def gate_config(tmp: Path, redis_url: str, engine_port: int, *, models: bool = False) -> Path:
    """The benchmarks' gate configuration in ``tmp``: route `chat` to the engine on
    ``engine_port`` (for model `llama` where ``models``), queue prefix `bench:`."""
    route = f"upstream: 'http://127.0.0.1:{engine_port}', " + ("models: [llama], " if models else "") + "default_deadline_ms: 30000"
    path = tmp / "gate.yml"
    path.write_text(f"gate:\n  redis: {redis_url}\n  queue_prefix: 'bench:'\n  routes:\n    chat: {{{route}}}\n")
    return path


def split_cpus() -> tuple[set[int], set[int]]:
    """(the load generator's CPUs, the servers'): the first CPU and the rest, or all of them
    for both on one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    return ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))


def engine_process(stack: contextlib.ExitStack, target: Callable[[int], None], port: int) -> mp.Process:
    """``target(port)`` in a process of its own, stopped when ``stack`` closes."""
    engine = mp.Process(target=target, args=(port,), daemon=True)
    engine.start()
    stack.callback(lambda: (engine.terminate(), engine.join(5)))
    return engine


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
