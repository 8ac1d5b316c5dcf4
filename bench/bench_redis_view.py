"""Exporter cost of the Redis view: a pool of 10,000 GPUs and 100,000 queued requests.

Per refresh (one exporter round) it reports:

- round trips, counted independently of the view: calls to redis-py's
  `Connection.send_packed_command` (one per pipeline or command sent);
- commands sent by the client, and commands Redis executed (from `INFO commandstats`
  deltas, the INFO calls excluded; these include the GET/PTTL/HMGET run inside the
  read scripts, 500 GPUs per script);
- time per refresh (wall, p50 and max), which includes parsing every reply in Python.

Scenarios vary the number of pools, GPUs and routes: round trips stay constant (1, or 2
with pools or routes read from Redis sets) while commands grow with the GPUs (one
script per 500 GPUs, running 1 GET per GPU and PTTL + HMGET per held lease) and routes
(6 reads + 1 bounded GC script per route), never with the queue length.

    python -m bench.bench_redis_view [--gpus 10000] [--queued 100000] [--refreshes 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import redis
from redis import asyncio as aioredis
from redis.asyncio.connection import Connection
from tests.fixtures.redis_server import RedisServer

from bench._goal import goal_line
from bench._machine import machine_line
from llm_health.config.redis import parse_redis_config
from llm_health.exporter.redis_collector import redis_status
from llm_health.exporter.redis_view import RedisView
from llm_health.store.lease_scripts import CLAIM_LUA
from llm_health.store.leases import LeaseClient
from llm_health.store.queue import AdmissionQueue, now_ms

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "pure-Python parser (no hiredis)"
    return f"machine: {machine_line(f'redis-py {redis.__version__} with {parser}')}\n{server}"


class RoundTrips:
    """Counts what redis-py sends: one call per command or pipeline."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = Connection.send_packed_command

    def __enter__(self) -> RoundTrips:
        counter = self
        orig = self._orig

        async def counting(conn, command, check_health=True):
            counter.count += 1
            return await orig(conn, command, check_health)

        Connection.send_packed_command = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Connection.send_packed_command = self._orig  # type: ignore[method-assign]


async def command_calls(r: aioredis.Redis) -> int:
    stats = await r.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k != "cmdstat_info")


async def populate(url: str, gpus: int, queued: int, routes: list[str]) -> None:
    leases = LeaseClient.from_url(url)
    queue = AdmissionQueue.from_url(url)
    r = leases.redis
    rnd = random.Random(7)
    claim = r.register_script(CLAIM_LUA)  # the lease library's claim script, pipelined here
    try:
        # 60% of the GPUs leased (our claims, with side hash and fencing token).
        for start in range(0, gpus, 1000):
            pipe = r.pipeline(transaction=False)
            for i in range(start, min(gpus, start + 1000)):
                if rnd.random() < 0.6:
                    g = f"gpu{i}"
                    await claim(
                        keys=[leases.keys.lease(g), leases.keys.info(g), leases.keys.fence(g)],
                        args=[f"worker{i}", 600_000, f"job{i}", 0],
                        client=pipe,
                    )
            await pipe.execute()
        await r.sadd("gpu:pool:all", *[f"gpu{i}" for i in range(gpus)])
        wall = now_ms()
        await r.zadd("gpu:waiters:all", {f"waiter{i}": wall + 600_000 for i in range(100)})
        # The queue: ages up to 60 s, deadlines from 30 s ago to 60 s ahead, 10% retried.
        for start in range(0, queued, 2000):
            pipe = r.pipeline(transaction=False)
            for i in range(start, min(queued, start + 2000)):
                route = routes[i % len(routes)]
                rid = f"req{i}"
                enq = wall - rnd.randint(0, 60_000)
                await queue._enqueue(
                    keys=[queue.keys.record(rid), *queue.keys.route_keys(route), queue.keys.routes()],
                    args=[rid, route, f"tenant{i % 7}", wall + rnd.randint(-30_000, 60_000), enq, wall, queue.retention_ms, 200],
                    client=pipe,
                )
                if i % 10 == 0:
                    await queue._attempt(
                        keys=[queue.keys.record(rid), *queue.keys.route_keys(route)],
                        args=[rid, 256, 503, wall, queue.retention_ms, 1],
                        client=pipe,
                    )
            await pipe.execute()
    finally:
        await leases.aclose()
        await queue.aclose()


async def measure(url: str, section: dict, refreshes: int, states: dict[str, str]) -> dict:
    view = RedisView(parse_redis_config(section, "bench"))
    await view.start()
    probe = aioredis.Redis.from_url(url)
    try:
        for _ in range(2):  # warm: connections, discovery
            await view.refresh(states)
        assert view.up, redis_status(view)["error"]
        times = []
        before = await command_calls(probe)
        with RoundTrips() as rt:
            for _ in range(refreshes):
                t = time.perf_counter()
                await view.refresh(states)
                times.append((time.perf_counter() - t) * 1000)
            trips = rt.count
        after = await command_calls(probe)
        stats = await probe.info("commandstats")
        assert "cmdstat_keys" not in stats, "KEYS was used"
        return {
            "round_trips": trips / refreshes,
            "view_round_trips": view.round_trips_last,
            "server_commands": (after - before) / refreshes,
            "client_commands": view.commands_last,
            "ms_p50": statistics.median(times),
            "ms_max": max(times),
            "status": redis_status(view),
        }
    finally:
        await view.stop()
        await probe.aclose()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--queued", type=int, default=100_000)
    ap.add_argument("--routes", type=int, default=4)
    ap.add_argument("--refreshes", type=int, default=20)
    args = ap.parse_args()
    print(machine())
    print(f"load average before the run: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    routes = [f"route{i}" for i in range(args.routes)]
    n = args.gpus
    with RedisServer() as server:
        url = server.url
        t = time.perf_counter()
        await populate(url, n, args.queued, routes)
        print(f"populated {n} GPUs (60% leased), {args.queued} queued requests on {len(routes)} routes in {time.perf_counter() - t:.1f} s")
        gpu_ids = [f"gpu{i}" for i in range(n)]
        states = {f"backend{i}": ("busy" if i % 3 else "idle") for i in range(n)}

        def pools(k: int) -> list[dict]:
            size = n // k
            return [
                {
                    "name": f"pool{j}",
                    "gpus": gpu_ids[j * size : (j + 1) * size],
                    "backends": {g: f"backend{j * size + x}" for x, g in enumerate(gpu_ids[j * size : (j + 1) * size])},
                }
                for j in range(k)
            ]

        scenarios = [
            ("1 pool of 100 GPUs, 1 route", [{"name": "small", "gpus": gpu_ids[:100]}], routes[:1]),
            (f"1 pool of {n} GPUs, {len(routes)} routes", pools(1), routes),
            (f"10 pools of {n // 10} GPUs, {len(routes)} routes", pools(10), routes),
            (f"100 pools of {n // 100} GPUs, {len(routes)} routes", pools(100), routes),
            (f"1 pool of {n} GPUs, {4 * len(routes)} routes", pools(1), routes + [f"empty{i}" for i in range(3 * len(routes))]),
            (f"1 pool from a Redis set ({n}), routes from set", [{"name": "all", "set_key": "gpu:pool:all"}], None),
        ]
        print()
        print(f"per refresh, mean of {args.refreshes} (after 2 warm-up refreshes)")
        print(f"{'scenario':<48} {'round trips':>11} {'sent':>6} {'executed':>9} {'ms p50':>8} {'ms max':>8}")
        trips: dict[str, float] = {}
        for name, pool_specs, route_list in scenarios:
            section: dict = {"url": url, "pools": pool_specs}
            if route_list is not None:
                section["routes"] = route_list
            r = await measure(url, section, args.refreshes, states)
            assert r["round_trips"] == r["view_round_trips"], r
            print(f"{name:<48} {r['round_trips']:>11g} {r['client_commands']:>6} {r['server_commands']:>9.0f} {r['ms_p50']:>8.1f} {r['ms_max']:>8.1f}")
            last = r["status"]
            trips[name] = r["round_trips"]
        print(
            "round trips: redis-py sends (one per pipeline); sent: commands in them; executed: commands "
            "Redis ran, from INFO commandstats, including those inside the read scripts. KEYS calls: 0"
        )
        print()
        print("last scenario's /status (routes):")
        for route, s in sorted(last["routes"].items()):
            print(f"  {route}: {s}")
        listed = max(v for k, v in trips.items() if "from a Redis set" not in k)
        from_sets = max(v for k, v in trips.items() if "from a Redis set" in k)
        print(f"scenarios: {len(trips)}; most round trips per refresh: {listed:g} with pools and routes listed, {from_sets:g} from Redis sets")
        print(
            goal_line(
                "Redis round trips per refresh constant in pools, routes and queue length: 1 with pools and routes listed, 2 when both come from Redis sets",
                f"at most {listed:g} with them listed, {from_sets:g} from sets, over {len(trips)} scenarios",
                listed <= 1 and from_sets <= 2,
            )
        )
        print(f"load average after the run: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    asyncio.run(main())
