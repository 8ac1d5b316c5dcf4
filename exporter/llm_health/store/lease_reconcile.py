"""The lease library's reconcile pass (`LeaseClient.reconcile`, whose docstring says what
it does): the workers asked, then the leases read, each GPU judged, a lease deleted only
if it still holds the holder read."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from .deployment import Deployment
from .keys import LeaseKeys
from .lease_scripts import DELETE_IF_HOLDER_LUA
from .records import LeaseState, Pool, ReconcileReport

log = logging.getLogger("llm_health.store.leases")


async def reconcile(
    read_many: Callable[[Sequence[str]], Awaitable[dict[str, LeaseState | None]]],
    deployment: Deployment,
    keys: LeaseKeys,
    pool: Pool,
    ask_worker: Callable[[str], Awaitable[str | None]],
    *,
    grace_ms: int,
    worker_timeout_s: float,
    concurrency: int,
) -> ReconcileReport:
    report = ReconcileReport()
    sem = asyncio.Semaphore(concurrency)

    async def ask(gpu: str) -> tuple[str, str | None, str | None]:
        async with sem:
            try:
                doing = await asyncio.wait_for(ask_worker(gpu), worker_timeout_s)
                return gpu, doing, None
            except Exception as e:  # a worker's failure is data here, not a crash
                return gpu, None, repr(e)

    answers = await asyncio.gather(*(ask(g) for g in pool.gpus))
    # Read the leases after the answers: a lease claimed while we asked is then seen.
    states = await read_many(pool.gpus)
    server_now = await deployment.server_ms()
    for gpu, doing, error in answers:
        state = states[gpu]
        if error is not None:
            report.unreachable.append((gpu, error))
            continue
        if state is None:
            if doing:
                report.busy_without_lease.append((gpu, doing))
            else:
                report.consistent += 1
            continue
        if doing is None:
            if state.claimed_ms is not None and server_now - state.claimed_ms < grace_ms:
                report.kept_young.append((gpu, state.holder))
                continue
            deleted = await deployment.script(DELETE_IF_HOLDER_LUA, [keys.lease(gpu), keys.info(gpu)], [state.holder], confirm=False)
            if deleted:
                report.deleted.append((gpu, state.holder))
                log.warning("reconcile: deleted lease on %s held by %s; the worker is idle", gpu, state.holder)
            continue
        if doing in (state.holder, state.job_id):
            report.consistent += 1
        else:
            report.mismatched.append((gpu, state.holder, doing))
    return report
