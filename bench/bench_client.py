"""What one read of a backend's /metrics costs the exporter's process, by HTTP client.

A real vLLM closes a connection idle for 5 s, so at 10 s rounds every read opens a new
connection; bench_scale shows that the read is most of a round. The exporter reads
`/metrics` with its own fast path (probe.fast_http), the other calls with aiohttp. This
compares, side by side in one run against the same simulated busy vLLM backends (~36 KB
payloads, served by another process), the CPU time of this process per read:

- the exporter's read, `BackendClient.metrics()` on probe.fast_http, a new connection per read
  (what a round's read costs against a real vLLM, every check included: timeouts, caps,
  encodings);
- the exporter's read on the connection it kept (what a round's read costs against a
  server that keeps connections longer than the interval: nginx by default, a vLLM with
  VLLM_HTTP_TIMEOUT_KEEP_ALIVE raised);
- aiohttp, the connection reused (what a read cost before, against a server that keeps it);
- aiohttp, a new connection per read (what a read cost before, against a real vLLM);
- a minimal HTTP/1.1 GET on an asyncio protocol, a new connection per read (a floor:
  Content-Length bodies only, none of the checks the exporter's reads need).

    python -m bench.bench_client [--reads 1500] [--backends 5] [--passes 2]

Goal: the exporter's read against a real vLLM (a new connection) under 1/40 of
prometheus_client's parse of the same payload, half of the 1/20 a whole round may cost
(bench_scale), the rest being the parse, the decision and the render. Passes alternate so
that a change in the machine's speed lands on every client.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import statistics
from collections.abc import Awaitable, Callable

import aiohttp

from bench._goal import goal_line
from bench._machine import machine_line, prometheus_parse_ms
from bench._raw_get import raw_get
from bench.bench_scale import CachedServer, fleet_process, loop_factory
from llm_health.probe.client import BackendClient
from llm_health.sim import servers as sim

GOAL_PARSE_FRACTION = 40.0
PRODUCT = "llm-health's read (probe.fast_http), new connection"
PRODUCT_KEPT = "llm-health's read (probe.fast_http), connection kept"


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run(urls: list[str], reads: int, passes: int) -> dict[str, list[float]]:
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4), cookie_jar=aiohttp.DummyCookieJar()) for _ in urls]

    async def reused(k: int) -> int:
        async with sessions[k].get(urls[k] + "/metrics") as r:
            return len(await r.read())

    async def fresh(k: int) -> int:
        async with sessions[k].get(urls[k] + "/metrics", headers={"Connection": "close"}) as r:
            return len(await r.read())

    async def raw(k: int) -> int:
        return await raw_get(ports[k])

    readers = [BackendClient(sessions[k], urls[k]) for k in range(len(urls))]
    keepers = [BackendClient(sessions[k], urls[k], keepalive=True) for k in range(len(urls))]

    async def read_with(client: BackendClient) -> int:
        fetched = await client.metrics()
        if fetched.error:
            raise AssertionError(f"llm-health's read: {fetched.error}")
        return fetched.size

    async def product(k: int) -> int:
        return await read_with(readers[k])

    async def product_kept(k: int) -> int:
        return await read_with(keepers[k])

    clients: dict[str, Callable[[int], Awaitable[int]]] = {
        PRODUCT: product,
        PRODUCT_KEPT: product_kept,
        "aiohttp, connection reused": reused,
        "aiohttp, new connection per read": fresh,
        "minimal asyncio GET, new connection per read": raw,
    }
    out: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for k in range(len(urls)):  # warm-up: connections open, code paths taken
            await reused(k)
        for _ in range(passes):
            for name, get in clients.items():
                c0 = cpu()
                for i in range(reads):
                    if await get(i % len(urls)) < 10_000:
                        raise AssertionError(f"{name}: a short body")
                out[name].append((cpu() - c0) / reads * 1000)
    finally:
        for c in keepers:
            c.close()
        for s in sessions:
            await s.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=1500, help="reads per client per pass")
    ap.add_argument("--backends", type=int, default=5)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    payload = CachedServer("p")
    sim.saturated(payload, running=8, waiting=0)
    parse_before = prometheus_parse_ms(payload.payload())
    parent, child = mp.Pipe()
    # busy backends only (fleet_process makes every fourth one, from b1, busy)
    proc = mp.Process(target=fleet_process, args=(0, 4 * args.backends, child, 75.0), daemon=True)
    proc.start()
    urls = [u for i, u in enumerate(parent.recv()) if i % 4 == 1]
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            out = runner.run(run(urls, args.reads, args.passes))
    finally:
        parent.send("stop")
        proc.join(10)
    parse_after = prometheus_parse_ms(payload.payload())
    parse_ms = min(parse_before, parse_after)  # the faster parse judges: the harder ratio
    print(f"{args.reads} reads of /metrics per client per pass, {args.passes} passes, {len(urls)} busy backends (~36 KiB each)")
    base = statistics.median(out["aiohttp, connection reused"])
    for name, ms in out.items():
        per_pass = ", ".join(f"{x:.3f}" for x in ms)
        print(
            f"{name:48s} median {statistics.median(ms):.3f} ms CPU per read ({per_pass}); {statistics.median(ms) / base:.2f}x reused aiohttp, "
            f"1/{parse_ms / statistics.median(ms):.1f} of the parse"
        )
    print(
        f"prometheus_client parses that payload in {parse_before:.2f} ms before the reads and {parse_after:.2f} ms after them (best of 7 each; the lower judges)"
    )
    fraction = parse_ms / statistics.median(out[PRODUCT])
    print(
        goal_line(
            f"the exporter's read as against a real vLLM (a new connection) under 1/{GOAL_PARSE_FRACTION:g} of prometheus_client's parse of its payload",
            f"1/{fraction:.1f}",
            fraction > GOAL_PARSE_FRACTION,
        )
    )


if __name__ == "__main__":
    main()
