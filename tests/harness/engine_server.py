"""What every real engine server the tests run shares: one subprocess in its own process
group on 127.0.0.1, its log file, readiness polled on an HTTP path, a stop that takes the
whole group down (SIGCONT, SIGTERM, SIGKILL after a grace), a restart on the same port,
adoption of a server a restart script started, and every live server closed at exit.

`tests/harness/vllm.py` and `tests/harness/llamacpp.py` are thin subclasses: their argv,
environment, install check, readiness path and faults. Stdlib only; nothing here imports
`llm_health`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import ClassVar

from tests.harness.processes import Adopted, free_port, launch_logged, wait_port_free


class ServerNotReady(RuntimeError):
    pass


_LIVE: set[EngineServer] = set()


def _close_all() -> None:
    for srv in list(_LIVE):
        with contextlib.suppress(Exception):
            srv.close()


atexit.register(_close_all)


class EngineServer:
    """One engine server subprocess in its own process group (start_new_session)."""

    name: ClassVar[str] = "engine server"  # in messages
    log_prefix: ClassVar[str] = "engine"  # log files: {log_prefix}-{port}-{generation}.log
    log_dir_env: ClassVar[str] = ""  # an environment variable naming the log directory
    temp_prefix: ClassVar[str] = "engine"  # else a temporary one: llm-health-{temp_prefix}-*
    ready_path: ClassVar[str] = "/health"  # polled until it answers 200
    ready_poll: ClassVar[float] = 0.5  # seconds between polls
    ready_timeout: ClassVar[float] = 120.0
    port_free_timeout: ClassVar[float] = 30.0  # the port lingers a moment after the old server exits
    port_free_pause: ClassVar[float] = 0.2

    def __init__(self, port: int | None = None, log_dir: Path | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        ld = log_dir or (os.environ.get(self.log_dir_env) if self.log_dir_env else None)
        self.log_dir = Path(ld) if ld else Path(tempfile.mkdtemp(prefix=f"llm-health-{self.temp_prefix}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.generation = 0
        self.ready_seconds: float | None = None
        self._launched = 0.0

    # -- what a subclass says ------------------------------------------------

    def argv(self) -> list[str]:
        raise NotImplementedError

    def launch_env(self) -> dict[str, str]:
        return dict(os.environ)

    def install_problem(self) -> str | None:
        """Why the server cannot be started here, or None."""
        return None

    def prepare(self) -> None:
        """Before a launch (or a launch spec): fetch or build what the argv names."""

    def answers_ready(self) -> bool:
        """The readiness poll: `ready_path` answered 200."""
        raise NotImplementedError

    def before_close(self) -> None:
        """Before the process group is signalled (thaw what the faults froze)."""

    def stop_group(self, proc: subprocess.Popen, grace: float) -> None:
        """SIGCONT and SIGTERM the process group (SIGKILL at once with grace 0: a crash),
        SIGKILL what is left after `grace` seconds."""
        for sig in (signal.SIGCONT, signal.SIGTERM if grace > 0 else signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=max(grace, 0.01))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    # -- the life of the server ----------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self.proc.pid

    @classmethod
    def start(cls, ready_timeout: float | None = None, **kw):  # type: ignore[no-untyped-def]
        srv = cls(**kw)
        srv.launch()
        try:
            srv.wait_ready(ready_timeout or cls.ready_timeout)
        except BaseException:
            srv.close()
            raise
        return srv

    def launch(self) -> None:
        problem = self.install_problem()
        if problem:
            raise RuntimeError(problem)
        self.prepare()
        self.generation += 1
        self.log_path = self.log_dir / f"{self.log_prefix}-{self.port}-{self.generation}.log"
        self.proc = launch_logged(self.argv(), self.log_path, self.log_dir, self.launch_env())
        self._launched = time.monotonic()
        _LIVE.add(self)

    def launch_spec(self) -> dict:
        """What a restart script needs to start this server again the same way."""
        self.prepare()
        return {"argv": self.argv(), "env": self.launch_env(), "cwd": str(self.log_dir), "host": self.host, "port": self.port}

    def adopt(self, pid: int) -> None:
        """Take over a server that something else started (a restart script) in its own
        session: `close()` and the fault controls act on it from now on."""
        self.proc = Adopted(pid)  # type: ignore[assignment]
        self._launched = time.monotonic()
        _LIVE.add(self)

    def log_text(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:]) or "(no log)"

    def wait_ready(self, timeout: float | None = None) -> float:
        """Poll until ready; seconds since launch."""
        timeout = timeout or self.ready_timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                rc = None if self.proc is None else self.proc.returncode
                raise ServerNotReady(f"{self.name} exited (rc {rc}) before ready; log {self.log_path}:\n{self.log_tail()}")
            if self.answers_ready():
                self.ready_seconds = time.monotonic() - self._launched
                return self.ready_seconds
            time.sleep(self.ready_poll)
        raise ServerNotReady(f"{self.name} not ready after {timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def close(self, grace: float = 5) -> None:
        """Stop the whole process group (`stop_group`); nothing to do when not running."""
        self.before_close()
        proc = self.proc
        if proc is not None:
            self.stop_group(proc, grace)
        self.proc = None
        _LIVE.discard(self)

    def restart(self, ready_timeout: float | None = None, grace: float = 5) -> float:
        """Stop (see `close`) and start again on the same port; seconds from launch to ready."""
        self.close(grace)
        wait_port_free(self.host, self.port, self.port_free_timeout, self.port_free_pause)
        self.launch()
        try:
            return self.wait_ready(ready_timeout)
        except BaseException:
            self.close()
            raise

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
