"""A real Prometheus + Alertmanager + webhook sink on loopback, from Debian's packages.

Reusable by any test that needs the monitoring stack:

    prom = start_prometheus(tmp_path, {"vllm": ["127.0.0.1:8001"]}, rule_files,
                            alertmanagers=[am.url])
    prom.query('up')            # -> the result list of /api/v1/query
    prom.alerts()               # -> the alerts list of /api/v1/alerts
    am = start_alertmanager(tmp_path, config_text)
    am.alerts(inhibited=True)   # -> /api/v2/alerts
    sink = start_sink()         # sink.url, sink.received (one dict per webhook call)

To watch the real exporter instead of a fake target, start it on a free port and scrape
it under the job the rules select (rules/config.yaml, `selectors.exporter`):

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llm_health", "serve", "--config.file", cfg,
                             "--web.listen-address", f"127.0.0.1:{port}"])
    prom = start_prometheus(tmp_path, {"llm-health": [f"127.0.0.1:{port}"]}, rule_files, ...)

Every start waits until the process is ready; every handle has .stop(). The pytest
fixtures at the bottom (`prometheus_factory`, `alertmanager_factory`, `sink`,
`target_factory`) stop what they started. Ports are free ports on 127.0.0.1, storage is
under tmp_path. Binaries: prometheus, prometheus-alertmanager (or alertmanager).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "rules"
SHARED = ROOT.parent / "shared" / "real-world"

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")


def run_tool(*argv: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a command without a shell; the result carries stdout and stderr as text."""
    return subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, data: bytes | None = None, timeout: float = 5) -> object:
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def wait_until(check: Callable[[], object], timeout: float = 60, interval: float = 0.25, what: str = "condition"):
    """Poll check() until it returns something truthy; return that, or fail after timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the process may not be up yet
            last_error = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_error})" if last_error else ""))


class _Process:
    name = "process"

    def __init__(self, argv: list[str], workdir: Path, url: str):
        self.url = url
        self.log_path = workdir / f"{self.name}.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir)

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
        with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
            return resp.status == 200

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
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self._log.close()


class Prometheus(_Process):
    name = "prometheus"

    def query(self, expr: str) -> list:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        body = http_json(url)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alerts(self) -> list:
        return http_json(self.url + "/api/v1/alerts")["data"]["alerts"]

    def rules(self) -> list:
        return http_json(self.url + "/api/v1/rules")["data"]["groups"]

    def targets(self) -> list:
        return http_json(self.url + "/api/v1/targets")["data"]["activeTargets"]


class Alertmanager(_Process):
    name = "alertmanager"

    def alerts(self, inhibited: bool = True, silenced: bool = True, active: bool = True) -> list:
        query = urllib.parse.urlencode(
            {"inhibited": str(inhibited).lower(), "silenced": str(silenced).lower(), "active": str(active).lower()}
        )
        return http_json(f"{self.url}/api/v2/alerts?{query}")

    def post_alerts(self, alerts: list[dict]) -> None:
        """Send alerts as Prometheus would (labels, annotations; startsAt defaults to now)."""
        http_json(self.url + "/api/v2/alerts", data=json.dumps(alerts).encode())


def start_prometheus(
    tmp_path: Path,
    scrape_targets: dict[str, list[str]],
    rule_files: list[Path] | tuple[Path, ...] = (),
    *,
    alertmanagers: list[str] | tuple[str, ...] = (),
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    extra_args: tuple[str, ...] = ("--rules.alert.resend-delay=1s",),
) -> Prometheus:
    """Prometheus scraping `scrape_targets` ({job: ["host:port", ...]}), loading the rule files.

    `alertmanagers` are base URLs (http://127.0.0.1:P). Fast intervals by default so
    rules evaluate every second."""
    if not PROMETHEUS:
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    workdir = Path(tmp_path) / f"prometheus-{free_port()}"
    workdir.mkdir(parents=True)
    config = {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                   "evaluation_interval": evaluation_interval},
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]}
            for job, targets in scrape_targets.items()
        ],
    }
    if alertmanagers:
        config["alerting"] = {"alertmanagers": [{"static_configs": [
            {"targets": [urllib.parse.urlparse(u).netloc for u in alertmanagers]}]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
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


def start_alertmanager(tmp_path: Path, config_text: str) -> Alertmanager:
    """Alertmanager with this configuration, clustering off, storage under tmp_path."""
    if not ALERTMANAGER:
        pytest.skip("alertmanager is not installed (apt-get install prometheus-alertmanager)")
    workdir = Path(tmp_path) / f"alertmanager-{free_port()}"
    workdir.mkdir(parents=True)
    (workdir / "alertmanager.yml").write_text(config_text)
    port = free_port()
    argv = [
        ALERTMANAGER,
        f"--config.file={workdir / 'alertmanager.yml'}",
        f"--storage.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",
    ]
    am = Alertmanager(argv, workdir, f"http://127.0.0.1:{port}")
    am.wait_ready()
    return am


def rewrite_alertmanager_config(config_text: str, sink_url: str, token_file: Path, group_wait: str = "1s") -> str:
    """The shipped config, every webhook pointed at sink_url/<receiver>, short timers.

    A receiver without a webhook (blackhole) stays without one. Credentials files point
    at token_file so the sink can check the Authorization header."""
    config = yaml.safe_load(config_text)
    for receiver in config.get("receivers", []):
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{sink_url}/{receiver['name']}"
            auth = hook.get("http_config", {}).get("authorization")
            if auth and "credentials_file" in auth:
                auth["credentials_file"] = str(token_file)

    def shorten(route: dict) -> None:
        for key in ("group_wait", "group_interval"):
            if key in route or route is config["route"]:
                route[key] = group_wait
        for child in route.get("routes", []):
            shorten(child)

    shorten(config["route"])
    return yaml.safe_dump(config, sort_keys=False)


@dataclass
class Sink:
    """A webhook receiver on 127.0.0.1: records every POST (path, headers, JSON body)."""

    server: ThreadingHTTPServer
    received: list[dict] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def alerts(self, path: str | None = None) -> list[dict]:
        """Every alert delivered (to one receiver path, e.g. "/restarter", if given)."""
        return [a for call in list(self.received) if path in (None, call["path"]) for a in call["body"].get("alerts", [])]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_sink() -> Sink:
    received: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                body = {"raw": raw.decode(errors="replace")}
            received.append({"path": self.path, "headers": dict(self.headers), "body": body})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return Sink(server, received)


@dataclass
class Target:
    """An HTTP server on 127.0.0.1 serving text you control, e.g. a fake /metrics.

    routes maps a path to a string or to a callable returning the string (called on
    every request: advance counters there)."""

    server: ThreadingHTTPServer
    routes: dict

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_target(routes: dict[str, str | Callable[[], str]]) -> Target:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            path = self.path.split("?", 1)[0]
            body = self.server.routes.get(path)
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            text = (body() if callable(body) else body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.routes = routes
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return Target(server, routes)


def render_rules(out_dir: Path, overrides: dict[str, str]) -> list[Path]:
    """A test copy of the rule files from the same generator, with some values overridden
    (e.g. {"vllm.progress_window": "6s"}). Returns the rule files written."""
    argv = [sys.executable, str(RULES / "generate.py"), "--out", str(out_dir)]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    result = run_tool(*argv)
    assert result.returncode == 0, result.stderr
    return sorted(Path(out_dir).glob("*.rules.yml"))


class _Started(list):
    def stop_all(self) -> None:
        while self:
            try:
                self.pop().stop()
            except Exception as exc:  # noqa: BLE001 - stop the rest regardless
                print(f"stack: stopping failed: {exc}", file=sys.stderr)


@pytest.fixture
def prometheus_factory(tmp_path):
    """start(scrape_targets, rule_files, **kw) -> Prometheus; all stopped at teardown."""
    started = _Started()

    def start(scrape_targets, rule_files=(), **kw):
        prom = start_prometheus(tmp_path, scrape_targets, rule_files, **kw)
        started.append(prom)
        return prom

    yield start
    started.stop_all()


@pytest.fixture
def alertmanager_factory(tmp_path):
    """start(config_text) -> Alertmanager; all stopped at teardown."""
    started = _Started()

    def start(config_text):
        am = start_alertmanager(tmp_path, config_text)
        started.append(am)
        return am

    yield start
    started.stop_all()


@pytest.fixture
def sink():
    s = start_sink()
    yield s
    s.stop()


@pytest.fixture
def target_factory():
    """start(routes) -> Target; all stopped at teardown."""
    started = _Started()

    def start(routes):
        t = start_target(routes)
        started.append(t)
        return t

    yield start
    started.stop_all()


# --- PromQL helpers shared by the rule and dashboard tests -----------------------------

_KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan", "atan2"}
_STRING = r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`'
_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads: bare selectors and __name__="..." matchers.

    Strings, label matchers, grouping label lists, ranges, numbers, function names and
    keywords are taken out first; what is left that looks like a name is a metric."""
    names = set(re.findall(r'__name__\s*=\s*"([^"]+)"', expr))
    text = re.sub(_STRING, '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(_GROUPING, " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    for m in re.finditer(r"(?<![\w:.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def exporter_series() -> set[str]:
    """Every series name the exporter, gate and restarter export (docs/architecture.md),
    with _bucket/_sum/_count for the histograms."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    doc = doc[doc.index("## Exported series"):]
    names = set(re.findall(r"\b(llm_[a-z0-9_]+)", doc))
    for name in re.findall(r"\b(llm_[a-z0-9_]+)(?:\{[^}]*\})?`\s*\(histogram\)", doc):
        names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
    return names


def payload_series(path: Path) -> set[str]:
    """Sample names in a Prometheus text payload."""
    names = set()
    for line in path.read_text(errors="replace").splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)", line)
            if m:
                names.add(m.group(1))
    return names
