"""The gate keeps no queue of its own between admission and the upstream: every admitted
request is at the engine at once, so the engine's queue (the one `queue_age_ms` reads) is
the only place a request waits. Real HTTP on loopback, a real redis-server."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.integration.test_gate import stack  # noqa: F401  (the fixture)

N = 150  # more than aiohttp's default pool of 100 connections


async def test_every_admitted_request_is_at_the_upstream_at_once(stack):  # noqa: F811
    url, up, _ = await stack()
    up.delay = 60.0  # each held at the upstream until the test lets go of it
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:

        async def one(i: int) -> tuple[int, bytes]:
            async with client.post(url + "/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"X-Request-Id": f"held-{i}"}) as r:
                return r.status, await r.read()

        tasks = [asyncio.create_task(one(i)) for i in range(N)]
        deadline = time.monotonic() + 30  # generous: on a correct gate all arrive within a second
        while len(up.calls) < N and time.monotonic() < deadline and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        arrived, ended = len(up.calls), [t for t in tasks if t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert not ended, f"{len(ended)} requests ended before all arrived: {ended[0].result()!r}"
    assert arrived == N, f"{arrived} of {N} admitted requests reached the upstream; the rest waited in the gate"
