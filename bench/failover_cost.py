"""What each `wait_replicas` setting costs claims across a failover, measured on the test
topologies (tests/fixtures/redis_topology.py: real redis-server and redis-sentinel on
loopback), with ``min-replicas-to-write 1`` (and ``min-replicas-max-lag 10``) on every
data node, as docs/redis-schema.md advises.

One prober per setting claims one GPU (its own, on the primary that fails over) and
releases it, every 50 ms, through `LeaseClient.claim_any`; the settings run side by
side on one topology, so they meet the same fault. Per fault and setting it prints how
long after the fault claims were refused (the last refused claim's end, from the
fault's start), how many were refused and what refused them:

- Sentinel (a primary, 2 replicas, 3 sentinels; wait_replicas 0, 1, all): an
  unforced failover (the primary SIGKILLed, sentinels elect a replica after
  down-after-milliseconds 2000; the killed node restarted after the election, a
  replica) and a forced one (``SENTINEL FAILOVER``);
- Cluster (3 primaries, 1 replica each; wait_replicas 0, 1): ``CLUSTER FAILOVER`` (the
  primary agrees and hands over) and ``CLUSTER FAILOVER FORCE`` on the replica.

    PYTHONPATH=exporter python -m bench.failover_cost [--kind sentinel|cluster|both]

The figures vary from run to run (sentinel's timers, the machine's load); docs quote a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tests.fixtures.redis_topology import ClusterTopology, SentinelTopology

from llm_health.store.errors import code
from llm_health.store.leases import LeaseClient

PERIOD_S = 0.05
OBSERVE_S = 25.0  # after the fault's start


class Prober:
    def __init__(self, url: str, gpu: str, label: str):
        self.client = LeaseClient.from_url(url, socket_timeout=1.0, ttl_ms=3000)
        self.gpu, self.label = gpu, label
        self.log: list[tuple[float, float, str]] = []  # (sent, back, "ok" or what refused it)
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                lease = await asyncio.wait_for(self.client.claim_any([self.gpu], f"probe-{self.label}"), 3.0)
                result = "ok" if lease is not None else "held"
                if lease is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.client.release(lease), 1.0)
            except Exception as exc:
                result = code(exc) or type(exc).__name__
            self.log.append((t0, time.monotonic(), result))
            await asyncio.sleep(PERIOD_S)

    def window(self, start: float, end: float) -> str:
        refused = [(a, b, r) for a, b, r in self.log if a >= start and b <= end and r != "ok"]
        if not refused:
            return "no claim refused"
        kinds = Counter(r for _, _, r in refused)
        return (
            f"refused until {refused[-1][1] - start:.1f} s after the fault ({len(refused)} claims: "
            + ", ".join(f"{k} {n}" for k, n in kinds.most_common())
            + ")"
        )

    async def stop(self) -> None:
        self._stop.set()


async def measure(url: str, gpus: dict[str, str], faults: list[tuple[str, Callable[[], Any], Callable[[], Any]]]) -> None:
    probers = [Prober(f"{url}{'&' if '?' in url else '?'}wait_replicas={w}", gpu, w) for w, gpu in gpus.items()]
    tasks = [asyncio.create_task(p.run()) for p in probers]
    try:
        await asyncio.sleep(2.0)
        for what, fault, after in faults:
            start = time.monotonic()
            await asyncio.to_thread(fault)
            await asyncio.to_thread(after)
            await asyncio.sleep(max(0.0, start + OBSERVE_S - time.monotonic()))
            for p in probers:
                print(f"{what}; wait_replicas={p.label}: {p.window(start, start + OBSERVE_S)}", flush=True)
    finally:
        for p in probers:
            await p.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in probers:
            await p.client.aclose()


async def sentinel() -> None:
    topology = SentinelTopology()
    topology.min_replicas_to_write = 1
    with topology as topo:
        old = topo.primary_port()

        def kill() -> None:
            topo.kill(old)
            topo.wait_new_primary(old)

        faults = [
            ("Sentinel, unforced failover (primary SIGKILLed, restarted after the election)", kill, lambda: topo.restart(old)),
            ("Sentinel, forced failover (SENTINEL FAILOVER)", lambda: topo.failover(settle=False), lambda: None),
        ]
        await measure(topo.url, {"0": "s0", "1": "s1", "all": "s2"}, faults)


async def cluster() -> None:
    topology = ClusterTopology()
    topology.min_replicas_to_write = 1
    with topology as topo:
        primary = topo.primary_for_slot(topo.keyslot("{c0}"))
        names = (f"c{i}" for i in range(10_000))
        gpus = [g for g in names if topo.primary_for_slot(topo.keyslot("{" + g + "}")) == primary][:2]
        replica = next(n["port"] for n in topo.nodes() if n["primary_id"] == topo.node_id(primary))
        faults = [
            ("Cluster, CLUSTER FAILOVER (unforced) on the replica", lambda: topo.failover(replica, force=False), lambda: None),
            ("Cluster, CLUSTER FAILOVER FORCE on the replica", lambda: topo.failover(primary, force=True), lambda: None),
        ]
        await measure(topo.url, {"0": gpus[0], "1": gpus[1]}, faults)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("sentinel", "cluster", "both"), default="both")
    args = p.parse_args()
    if args.kind in ("sentinel", "both"):
        asyncio.run(sentinel())
    if args.kind in ("cluster", "both"):
        asyncio.run(cluster())


if __name__ == "__main__":
    main()
