"""Reading many leases at once, for the exporter's view of a pool, in one batch whatever
the pool size: on one server (or Sentinel's primary) one short script per chunk of GPUs
(lease_scripts.READ_LEASES_LUA); on Cluster, where a script may only touch its own slot, plain
commands per GPU on the cluster pipeline. `BulkReads` is the one interface the view uses;
`Deployment.bulk_reads` picks the kind's, so nothing outside store/ asks which kind it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .connection import text
from .keys import LeaseKeys
from .lease_scripts import READ_LEASES_LUA
from .records import LeaseState

READ_CHUNK = 500


def read_leases_chunks(gpus: Sequence[str]) -> list[tuple[Sequence[str], str]]:
    """The GPUs in chunks, each with its ids joined for READ_LEASES_LUA."""
    out = []
    for i in range(0, len(gpus), READ_CHUNK):
        chunk = gpus[i : i + READ_CHUNK]
        out.append((chunk, "\n".join(chunk)))
    return out


def add_read_leases(pipe: Any, keys: LeaseKeys, joined: str) -> None:
    """Queue the read of one chunk of GPUs (see READ_LEASES_LUA) on a pipeline."""
    pipe.eval(READ_LEASES_LUA, 0, keys.lease_prefix, keys.info_prefix, joined)


def parse_read_leases(chunk: Sequence[str], reply: Sequence[Any]) -> dict[str, LeaseState]:
    """The held leases of one chunk, by GPU id."""
    out: dict[str, LeaseState] = {}
    if reply and isinstance(reply[1], bytes):
        reply = [text(x) for x in reply]
    for j in range(0, len(reply), 6):
        gpu = chunk[int(reply[j]) - 1]
        holder, pttl, info_holder, token, claimed = reply[j + 1 : j + 6]
        ttl_ms = int(pttl) if int(pttl) >= 0 else None
        if info_holder != holder:  # old-style lease, or a leftover side hash of someone else
            out[gpu] = LeaseState(gpu, holder, ttl_ms)
        else:
            out[gpu] = LeaseState(gpu, holder, ttl_ms, int(token) if token else None, int(claimed) if claimed else None)
    return out


def add_cluster_reads(pipe: Any, keys: LeaseKeys, gpus: Sequence[str]) -> None:
    """Redis Cluster: a script may only touch its own slot, so each GPU is read with
    GET, PTTL and HMGET on a cluster pipeline (one batch per node, sent in parallel)."""
    for g in gpus:
        pipe.get(keys.lease(g))
        pipe.pttl(keys.lease(g))
        pipe.hmget(keys.info(g), "holder", "token", "claimed_ms")


def parse_cluster_reads(gpus: Sequence[str], replies: Sequence[Any]) -> dict[str, LeaseState]:
    """The held leases of ``gpus`` from the replies of add_cluster_reads."""
    out: dict[str, LeaseState] = {}
    for i, g in enumerate(gpus):
        holder, pttl, info = replies[3 * i], replies[3 * i + 1], replies[3 * i + 2]
        if holder is None:
            continue
        holder = text(holder)
        info_holder, token, claimed = (text(x) if x is not None else None for x in info)
        ttl_ms = int(pttl) if int(pttl) >= 0 else None
        if info_holder != holder:
            out[g] = LeaseState(g, holder, ttl_ms)
        else:
            out[g] = LeaseState(g, holder, ttl_ms, int(token) if token else None, int(claimed) if claimed else None)
    return out


class BulkReads:
    """The reads of the exporter's Redis view, for one server or Sentinel's primary."""

    def __init__(self, keys: LeaseKeys, client: Any):
        self.keys = keys
        self.client = client
        self._chunks: dict[str, tuple[Sequence[str], list[tuple[Sequence[str], str]]]] = {}

    async def prepare(self) -> None:
        """Before a batch is queued (Cluster: the slot map)."""

    def add_time(self, pipe: Any) -> None:
        """Queue TIME: lease times are the Redis clock (written by the claim script)."""
        pipe.time()

    def _chunked(self, pool: str, gpus: Sequence[str]) -> list[tuple[Sequence[str], str]]:
        cached = self._chunks.get(pool)
        if cached is None or cached[0] is not gpus:  # rebuilt only when the pool's list changes
            cached = (gpus, read_leases_chunks(gpus))
            self._chunks[pool] = cached
        return cached[1]

    def add_leases(self, pipe: Any, pool: str, gpus: Sequence[str]) -> int:
        """Queue the read of a pool's leases; returns how many replies it adds."""
        chunks = self._chunked(pool, gpus)
        for _chunk, joined in chunks:
            add_read_leases(pipe, self.keys, joined)
        return len(chunks)

    def parse_leases(self, pool: str, gpus: Sequence[str], replies: Sequence[Any]) -> dict[str, LeaseState]:
        """The held leases of a pool, from the replies add_leases queued."""
        out: dict[str, LeaseState] = {}
        for (chunk, _joined), reply in zip(self._chunked(pool, gpus), replies):
            out.update(parse_read_leases(chunk, reply))
        return out

    async def scan_ids(self, match: str, to_id: Callable[[str], str | None], limit: int) -> tuple[set[str], int]:
        """The ids of the keys matching `match` (to_id: a key's id, or None to skip it),
        at most about `limit`; and how many round trips that took."""
        found: set[str] = set()
        cursor, trips = 0, 0
        while True:
            cursor, batch = await self.client.scan(cursor, match=match, count=1000)
            trips += 1
            found.update(i for i in (to_id(text(k)) for k in batch) if i is not None)
            if not cursor or len(found) >= limit:
                return found, trips


class ClusterBulkReads(BulkReads):
    """Redis Cluster: per-GPU commands (one batch per node, sent in parallel by the cluster
    pipeline), TIME sent to one primary, SCAN over every primary."""

    async def prepare(self) -> None:
        await self.client.initialize()  # the slot map (once; again after a failover)

    def add_time(self, pipe: Any) -> None:
        # TIME has no key to route by: sent to one primary, in the same batch
        pipe.execute_command("TIME", target_nodes=self.client.get_primaries()[0])

    def add_leases(self, pipe: Any, pool: str, gpus: Sequence[str]) -> int:
        add_cluster_reads(pipe, self.keys, gpus)
        return 3 * len(gpus)

    def parse_leases(self, pool: str, gpus: Sequence[str], replies: Sequence[Any]) -> dict[str, LeaseState]:
        return parse_cluster_reads(gpus, replies)

    async def scan_ids(self, match: str, to_id: Callable[[str], str | None], limit: int) -> tuple[set[str], int]:
        found: set[str] = set()
        async for k in self.client.scan_iter(match=match, count=1000):  # every primary, bounded the same way
            i = to_id(text(k))
            if i is not None:
                found.add(i)
            if len(found) >= limit:
                break
        return found, 1
