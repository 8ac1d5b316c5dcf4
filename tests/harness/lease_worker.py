"""A GPU worker for the lease chaos test: claim a GPU of the pool, act on it through the
fencing-checked resource while the lease holds, release, again, until killed.

    python -m tests.harness.lease_worker --redis URL --pool g0,g1 --worker w1 --resource URL --log FILE

Every event is one JSON line in FILE, written as it happens (line-buffered, so a worker
killed with SIGKILL loses nothing it already did): `claim` (gpu, token), `act` (gpu,
token, accepted), `lost` (reason), `release`. Times are CLOCK_MONOTONIC, the same clock
for every process of the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from llm_health.store.leases import LeaseClient
from llm_health.store.records import Lease, LeaseLost, Pool


class Log:
    def __init__(self, path: str, worker: str):
        self.file = open(path, "a", buffering=1)
        self.worker = worker

    def __call__(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"t": time.monotonic(), "worker": self.worker, "event": event, **fields}) + "\n")


async def act(http: aiohttp.ClientSession, resource: str, lease: Lease, log: Log, steps: tuple[int, int]) -> None:
    """Work on the GPU: each step is a write the resource accepts only for the newest token."""
    for _ in range(random.randint(*steps)):
        async with http.post(resource, json={"gpu": lease.gpu, "token": lease.token, "worker": log.worker}) as r:
            accepted = (await r.json())["accepted"]
        log("act", gpu=lease.gpu, token=lease.token, accepted=accepted)
        await asyncio.sleep(0.05)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--resource", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--ttl-ms", type=int, default=3000)
    p.add_argument("--steps", default="3,12", help="writes per job, at least and at most (50 ms apart)")
    args = p.parse_args()
    log = Log(args.log, args.worker)
    client = LeaseClient.from_url(args.redis, ttl_ms=args.ttl_ms, socket_timeout=1.0, fallback_interval_s=0.2)
    pool = Pool("chaos", args.pool.split(","))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            try:
                lease = await client.wait_for_gpu(pool, args.worker, timeout=2.0)
            except Exception as exc:  # Redis down or restarting: try again
                log("error", error=repr(exc))
                await asyncio.sleep(0.1)
                continue
            if lease is None:
                continue
            log("claim", gpu=lease.gpu, token=lease.token)
            try:
                low, high = (int(x) for x in args.steps.split(","))
                await client.run_leased(lease, act(http, args.resource, lease, log, (low, high)), interval_s=0.5)
                log("release", gpu=lease.gpu, token=lease.token)
            except LeaseLost as exc:
                log("lost", gpu=lease.gpu, token=lease.token, reason=exc.reason)
            except Exception as exc:  # the resource or Redis failed mid-job: the lease was released or lost
                log("error", gpu=lease.gpu, token=lease.token, error=repr(exc))
            await asyncio.sleep(random.uniform(0, 0.1))


if __name__ == "__main__":
    asyncio.run(main())
