"""A GPU worker for the lease chaos tests: claim a GPU of the pool, act on it through the
fencing-checked resource while the lease holds, release, again, until killed.

    python -m tests.harness.lease_worker --redis URL --pool g0,g1 --worker w1 --resource URL --log FILE

Every event is one JSON line in FILE, written as it happens (line-buffered, so a worker
killed with SIGKILL loses nothing it already did): `claim` (gpu, token), `act` (gpu,
token, accepted), `lost` (reason), `release`. Times are CLOCK_MONOTONIC, the same clock
for every process of the machine.

With ``--detail`` (the HA chaos test) it also logs what the test needs to judge each
claim against the Redis deployment: `claim` with the claim's send time (`sent`), `via`,
`ttl_ms`, `claimed_ms` (Redis clock) and `acked` (replicas WAIT required: a claim only
comes back once they had it); every claim script sent (`claim_try`, then `claim_done`
with `result` ok / none / not_replicated / error); `not_replicated` (gpu, token of a
claim Redis applied and no replica acknowledged, undone); every renewal (`renew`, its
`sent` time and `result` ok / refused / not_replicated / error); `release_start` just
before the release is sent; `timeout` (`start`, `deadline`) for a wait that returned
None; `waiting` when a wait begins. `error` with `where: wait_for_gpu` is an exception
wait_for_gpu raised to the worker (a waiter must outlive every failover: none expected).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from llm_health.store.deployment import NotReplicated
from llm_health.store.lease_scripts import CLAIM_LUA
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


def log_details(client: LeaseClient, log: Log) -> None:
    """Wrap the client's claim script, renewal and release so each is logged (--detail)."""
    dep, script, renew, release = client.deployment, client.deployment.script, client.renew, client.release

    async def logged_script(lua: str, keys: Any, args: Any, *, confirm: bool = True) -> Any:
        if lua != CLAIM_LUA:
            return await script(lua, keys, args, confirm=confirm)
        n = len(keys) // 3
        gpus = [client.keys.gpu_of(k) for k in keys[:n]]
        sent = time.monotonic()
        log("claim_try", gpus=gpus, sent=sent)
        try:
            got = await script(lua, keys, args, confirm=confirm)
        except NotReplicated as e:
            reply = e.replies[0] if e.replies else None
            gpu, token = (gpus[int(reply[0])], int(reply[1])) if reply else (None, None)
            log("not_replicated", gpu=gpu, token=token, acked=e.acked, sent=sent)
            log("claim_done", sent=sent, result="not_replicated", gpu=gpu, token=token)
            raise
        except BaseException as e:
            log("claim_done", sent=sent, result="error", error=f"{type(e).__name__}: {e}")
            raise
        log("claim_done", sent=sent, result="ok" if got else "none", gpu=gpus[int(got[0])] if got else None, token=int(got[1]) if got else None)
        return got

    async def logged_renew(lease: Lease, ttl_ms: int | None = None) -> bool:
        sent, result = time.monotonic(), "error"
        try:
            ok = await renew(lease, ttl_ms)
            result = "ok" if ok else "refused"
            return ok
        except NotReplicated:
            result = "not_replicated"
            raise
        finally:
            log("renew", gpu=lease.gpu, token=lease.token, sent=sent, result=result)

    async def logged_release(lease: Lease) -> bool:
        log("release_start", gpu=lease.gpu, token=lease.token)
        return await release(lease)

    dep.script, client.renew, client.release = logged_script, logged_renew, logged_release  # type: ignore[method-assign]


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--redis", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--resource", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--ttl-ms", type=int, default=3000)
    p.add_argument("--steps", default="3,12", help="writes per job, at least and at most (50 ms apart)")
    p.add_argument("--wait-timeout-s", type=float, default=2.0, help="timeout of each wait_for_gpu")
    p.add_argument("--fallback-s", type=float, default=0.2, help="wait_for_gpu's fallback re-check interval")
    p.add_argument("--detail", action="store_true", help="log every claim try, renewal, release and timeout")
    args = p.parse_args()
    log = Log(args.log, args.worker)
    client = LeaseClient.from_url(args.redis, ttl_ms=args.ttl_ms, socket_timeout=1.0, fallback_interval_s=args.fallback_s)
    if args.detail:
        log_details(client, log)
    pool = Pool("chaos", args.pool.split(","))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            start = time.monotonic()
            if args.detail:
                log("waiting", start=start)
            try:
                lease = await client.wait_for_gpu(pool, args.worker, timeout=args.wait_timeout_s)
            except Exception as exc:  # Redis down or restarting: try again
                log("error", where="wait_for_gpu", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.1)
                continue
            if lease is None:
                if args.detail:
                    log("timeout", start=start, deadline=start + args.wait_timeout_s)
                continue
            if args.detail:
                acked = client.deployment.wait_replicas
                log("claim", gpu=lease.gpu, token=lease.token, sent=lease.sent_at, via=lease.via, ttl_ms=lease.ttl_ms, claimed_ms=lease.claimed_ms, acked=acked)
            else:
                log("claim", gpu=lease.gpu, token=lease.token)
            try:
                low, high = (int(x) for x in args.steps.split(","))
                await client.run_leased(lease, act(http, args.resource, lease, log, (low, high)), interval_s=0.5)
                log("release", gpu=lease.gpu, token=lease.token)
            except LeaseLost as exc:
                log("lost", gpu=lease.gpu, token=lease.token, reason=exc.reason)
            except Exception as exc:  # the resource or Redis failed mid-job: the lease was released or lost
                log("error", gpu=lease.gpu, token=lease.token, error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(random.uniform(0, 0.1))


if __name__ == "__main__":
    asyncio.run(main())
