"""docs/limits.md's claims about `/probe`, each on a real `llm-health serve` process and
targets on loopback:

* a target's own connection pool, "4 connections at most": six concurrent slow `/probe`
  reads of one target never hold more than four connections to it;
* "the least recently used target's state is dropped" past `global.max_probe_targets`;
* "Two scrapers probing the same target at once ... share one round": the target is read
  once for both.

(The targets `/probe` refuses, with a 400 that says why, are in test_backends.py.)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.hostile import models_ok, vllm_payload

DEADLINE = 60.0  # a failure bound for polls, never a measured time


def config(tmp_path, global_extra: str = "") -> str:
    path = tmp_path / "llm-health.yml"
    path.write_text(
        "global: {interval: 10s, hung_after_seconds: 3600, probe_interval: 600s, probe_timeout: 5s, "
        f"metrics_timeout: 30s, models_timeout: 10s, connect_timeout: 5s{global_extra}}}\nbackends: []\n"
    )
    return str(path)


async def probe(exporter, target: str) -> str:
    """The state `/probe` answers for `target`."""
    async with aiohttp.ClientSession() as http:
        async with http.get(exporter.url + "/probe", params={"target": target}, timeout=aiohttp.ClientTimeout(total=120)) as r:
            text = await r.text()
            assert r.status == 200, (r.status, text)
    hot = [s.labels["state"] for f in text_string_to_metric_families(text) for s in f.samples if s.name == "llm_backend_state" and s.value == 1]
    assert len(hot) == 1, text[:500]
    return hot[0]


async def probe_status(exporter) -> dict:
    async with aiohttp.ClientSession() as http, http.get(exporter.url + "/status") as r:
        return json.loads(await r.text())["probe"]


class Silent:
    """A TCP server that reads requests and never answers them, and counts the
    connections open to it at once (accepted and not yet closed by the client)."""

    def __init__(self) -> None:
        self.open = self.peak = self.requests = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                self.requests += 1
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # the client gave up and closed the connection
        finally:
            self.open -= 1
            writer.close()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self.url


@pytest.fixture
async def silent() -> AsyncIterator[Silent]:
    server = Silent()
    await server.start()
    yield server
    assert server.server is not None
    server.server.close()


async def test_one_target_holds_at_most_four_connections(tmp_path, silent, llm_health):
    """Six concurrent `/probe` reads of a target that never answers: every read waits out its
    timeout, and the target never sees more than four connections open at once."""
    exporter = llm_health("serve", "--config.file", config(tmp_path, ", metrics_timeout: 1s, models_timeout: 1s")).wait_ready()
    states = await asyncio.gather(*(probe(exporter, silent.url) for _ in range(6)))
    assert states == ["down"] * 6, states
    assert silent.requests >= 2  # /metrics, then /v1/models: the target was read
    assert 1 <= silent.peak <= 4, silent.peak


async def test_the_least_recently_used_target_is_the_one_dropped(tmp_path, hostile, llm_health):
    """max_probe_targets 2: probe A, B, A again, then C. B (used least recently) is dropped,
    not A (made first): A's memory is kept (a second reading that stood still: `stalled`),
    B starts over (a first reading: `unknown`)."""
    servers = {}
    for name in "ABC":
        server = await hostile()
        server.text("GET", "/metrics", vllm_payload(running=4, steps=10))  # work in flight, never moving
        models_ok(server)
        servers[name] = server.url
    exporter = llm_health("serve", "--config.file", config(tmp_path, ", max_probe_targets: 2")).wait_ready()
    assert [await probe(exporter, servers[n]) for n in "ABA"] == ["unknown", "unknown", "stalled"]
    assert await probe(exporter, servers["C"]) == "unknown"
    assert (await probe_status(exporter))["evicted"] == 1
    assert await probe(exporter, servers["A"]) == "stalled"  # kept
    assert await probe(exporter, servers["B"]) == "unknown"  # dropped: its state is gone
    status = await probe_status(exporter)
    assert (status["targets"], status["evicted"]) == (2, 2), status


async def test_two_scrapers_probing_one_target_at_once_share_one_round(tmp_path, hostile, llm_health):
    """An HA pair of Prometheus servers: the second `/probe` arrives while the first one's
    read of the target is under way. The target is read once; both get its answer."""
    server = await hostile()
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text=vllm_payload(running=2, steps=5), content_type="text/plain")

    server.on("GET", "/metrics", held)
    models_ok(server)
    exporter = llm_health("serve", "--config.file", config(tmp_path)).wait_ready()
    first = asyncio.ensure_future(probe(exporter, server.url))
    deadline = time.monotonic() + DEADLINE
    while ("GET", "/metrics") not in server.requests:
        assert time.monotonic() < deadline and not first.done(), "the first /probe never read the target"
        await asyncio.sleep(0.05)
    second = asyncio.ensure_future(probe(exporter, server.url))
    # Time for the second call to reach the exporter and wait on the round under way (it
    # has no I/O to do before that): a margin, not a measurement.
    await asyncio.sleep(2.0)
    assert not second.done()
    release.set()
    assert await asyncio.gather(first, second) == ["unknown", "unknown"]
    assert server.requests.count(("GET", "/metrics")) == 1, server.requests
