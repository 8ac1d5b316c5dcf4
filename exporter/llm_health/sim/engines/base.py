"""What a simulated engine does that differs from one engine to another: `SimFlavor`, the
base each engine's simulation fills (its engines, its `/metrics` body and headers, its
`/v1/models`, completions and health answers), with the core profile it simulates.
`sim.servers.SimServer` serves it and keeps the state every engine shares."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from ...core.engines import Profile
from ..render import SimEngine

# An admission door's stamp on a request it forwards (gate.decision.DECISION_HEADER): the
# demo's traffic, not a health check; a lifecycle engine serves it in its turn.
ADMITTED_HEADER = "X-LLM-Health-Decision"


class Served(Protocol):
    """What a flavor reads and changes on its server (sim.servers.SimServer)."""

    model: str
    engines: list[SimEngine]
    start_time: float
    start_us: int
    loading: bool
    loop_stuck: bool
    multiprocess: bool
    probe_hangs: bool

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def authorised(self, request: web.Request) -> bool: ...


class SimFlavor:
    """One engine's simulation. `kind` is the name `SimServer(kind=...)` takes; `profile`
    the core profile its payload must be read as (its sleep and pause paths are served)."""

    kind: str
    profile: Profile
    one_engine = False  # the server has one inference loop: engines=1 only

    def make_engines(self, count: int, max_model_len: int) -> list[SimEngine]:
        raise NotImplementedError

    def payload(self, server: Served) -> str:
        raise NotImplementedError

    def metrics_headers(self, server: Served) -> dict[str, str]:
        return {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}

    def after_metrics_read(self, server: Served) -> None:
        """What a `/metrics` read changes on the server (nothing, for most engines)."""

    def loading_response(self) -> web.Response:
        """`/metrics`, `/health` and completions while the model loads."""
        return web.Response(status=503, text="loading")

    async def models(self, server: Served, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def completion(self, server: Served, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def health(self, server: Served, request: web.Request) -> web.Response:
        return web.Response(status=200)
