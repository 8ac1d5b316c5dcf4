"""The alert-to-restart loop around simulated servers, for the demo and the tests:
real Prometheus with the shipped rules, real Alertmanager with the shipped routing
(rules/alertmanager.example.yml: the restarter gets the hung alerts, the pager and ticket
receivers a local sink here), and `llm-health restarter` whose restart command for each
simulated backend is a real process that appends a line to that backend's marker file;
`RestartEffect` restarts the simulated server for each line (the restart a systemd unit
or `docker restart` would make).

Prometheus and Alertmanager are processes (sim.launch); the restarter, the sink and the
effects run on the caller's event loop, and every blocking call to Prometheus goes
through a thread so the loop that Prometheus scrapes never waits on it.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from ..config.restarter import RestarterConfig, Target, Verify, default_instance
from ..restarter.app import Restarter
from . import launch
from . import servers as sim
from .servers import serve_app

REPO = Path(__file__).resolve().parents[3]
FAST_RULES = REPO / "rules" / "fast"  # rendered for short scrape intervals (rules/config.yaml, `variants: fast`)
ALERTMANAGER_CONFIG = REPO / "rules" / "alertmanager.example.yml"
# A restart command: appends a line to the marker file (argv[1]) and says what it did, as systemctl would.
MARK = "import os, sys; open(sys.argv[1], 'a').write('restart\\n'); print('restarting', os.environ.get('LLM_HEALTH_BACKEND'))"


def marker_command(marker: Path) -> tuple[str, ...]:
    return (sys.executable, "-c", MARK, str(marker))


@dataclass
class Restarted:
    at: float  # monotonic
    was_hung: bool  # the simulator's own truth at that moment: an engine in mode `hung`


class RestartEffect:
    """Applies each restart the marker file records to a simulated server: a new process
    (counters from zero, a new start time), answering again, then `scenario` (idle)."""

    def __init__(self, marker: Path, server: sim.SimServer, scenario: Callable[[sim.SimServer], None] = sim.idle):
        self.marker, self.server, self.scenario, self.applied = marker, server, scenario, 0
        self.restarts: list[Restarted] = []
        self.task = asyncio.create_task(self._run())

    def lines(self) -> int:
        return len(self.marker.read_text().splitlines()) if self.marker.exists() else 0

    async def _run(self) -> None:
        while True:
            while self.applied < self.lines():
                self.applied += 1
                self.restarts.append(Restarted(time.monotonic(), any(e.mode == "hung" for e in self.server.engines)))
                self.server.restart()
                self.server.probe_hangs = False  # a fresh process answers
                self.scenario(self.server)
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def missing() -> str | None:
    """Why the loop cannot run here, or None."""
    absent = [name for name, path in (("prometheus", launch.PROMETHEUS), ("prometheus-alertmanager", launch.ALERTMANAGER)) if not path]
    if absent:
        return f"{' and '.join(absent)} not installed: `sudo apt-get install prometheus prometheus-alertmanager` (what `make demo` does as root or with sudo)"
    if not FAST_RULES.is_dir() or not ALERTMANAGER_CONFIG.is_file():
        return f"the shipped rules were not found at {FAST_RULES} (run the demo from a checkout of the repository)"
    return None


@dataclass
class AlertFigures:
    firing: dict[tuple[str, str], float] = field(default_factory=dict)  # (alertname, backend) -> first seen firing (monotonic)
    firing_now: set[tuple[str, str]] = field(default_factory=set)
    paged: list[str] = field(default_factory=list)  # what reached the pager and ticket receivers
    actions: list[dict[str, Any]] = field(default_factory=list)  # the restarter's, from its /status
    refused: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


class AlertLoop:
    """`targets`: the simulated backends the restarter may restart, by the exporter's
    backend names; `scrape`: Prometheus jobs ({job: ["127.0.0.1:port"]})."""

    def __init__(self, targets: dict[str, sim.SimServer], scrape: dict[str, list[str]]):
        self.targets, self.scrape = targets, scrape
        self.figures = AlertFigures()
        self.effects: dict[str, RestartEffect] = {}
        self.prom: launch.Prometheus | None = None
        self.am: launch.Alertmanager | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="llm-health-demo-")
        self.workdir = Path(self._tmp.name)
        self._runners: list[web.AppRunner] = []
        self._poller: asyncio.Task[None] | None = None

    async def _sink(self, request: web.Request) -> web.Response:
        body = await request.json()
        for a in body.get("alerts", []):
            labels = a.get("labels", {})
            self.figures.paged.append(f"{request.match_info['receiver']}: {labels.get('alertname')} {labels.get('backend') or labels.get('instance', '')}")
        return web.Response(text="ok")

    async def start(self) -> None:
        token = secrets.token_hex(16)
        token_file = self.workdir / "restarter-token"
        token_file.touch(mode=0o600)
        token_file.write_text(token + "\n")
        targets = []
        for name, server in self.targets.items():
            marker = self.workdir / f"restart-{name}"
            targets.append(Target(name, server.url, default_instance(server.url), restart=marker_command(marker), restart_timeout=30.0))
            self.effects[name] = RestartEffect(marker, server)
        config = RestarterConfig(
            targets=tuple(targets),
            verify=Verify(interval=0.5, hung_after_seconds=1.0, probe_timeout=1.0, metrics_timeout=2.0),
            confirm_interval=0.5,
            recovery_interval=0.25,
            recovery_timeout=30.0,
            kill_grace=1.0,
            output_dir=str(self.workdir / "restart-output"),
            source="<demo>",
        )
        self.restarter = Restarter(config, token)
        rrunner, rport = await serve_app(self.restarter.app())
        self._runners.append(rrunner)
        sink = web.Application()
        sink.router.add_post("/{receiver}", self._sink)
        srunner, sport = await serve_app(sink)
        self._runners.append(srunner)
        restarter_url, sink_url = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{sport}"

        def url_for(receiver: str) -> str:
            return f"{restarter_url}/alerts" if receiver == "restarter" else f"{sink_url}/{receiver}"

        am_config = launch.route_alertmanager_config(ALERTMANAGER_CONFIG.read_text(), url_for, token_file, group_wait="1s")
        self.am = await asyncio.to_thread(launch.start_alertmanager, self.workdir, am_config)
        rules = sorted(FAST_RULES.glob("*.rules.yml"))
        self.prom = await asyncio.to_thread(launch.start_prometheus, self.workdir, self.scrape, rules, alertmanagers=[self.am.url])
        self._poller = asyncio.create_task(self._poll())

    def pids(self) -> dict[str, int]:
        return {p.name: p.pid for p in (self.prom, self.am) if p is not None}

    async def refresh(self) -> None:
        """Prometheus' alerts and the restarter's actions, now."""
        try:
            assert self.prom is not None
            alerts = await asyncio.to_thread(self.prom.alerts)
            now = time.monotonic()
            firing = {(a["labels"]["alertname"], a["labels"].get("backend") or a["labels"].get("instance", "")) for a in alerts if a["state"] == "firing"}
            for key in firing:
                self.figures.firing.setdefault(key, now)
            self.figures.firing_now = firing
            st = await self.restarter.status()
            self.figures.actions, self.figures.refused = st["actions"], st["refused"]
            self.figures.error = None
        except Exception as exc:  # Prometheus busy or starting: say so, keep going
            self.figures.error = f"{type(exc).__name__}: {exc}"

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
        for p in (self.prom, self.am):
            if p is not None:
                await asyncio.to_thread(p.stop)
        for e in self.effects.values():
            await e.stop()
        for r in reversed(self._runners):
            await r.cleanup()
        self._tmp.cleanup()
