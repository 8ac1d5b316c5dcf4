"""Reading many leases at once, for the exporter's view of a pool: one short script per
chunk of GPUs (scripts.READ_LEASES_LUA), queued on one pipeline, whatever the pool size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .connection import text
from .keys import LeaseKeys
from .records import LeaseState
from .scripts import READ_LEASES_LUA

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
