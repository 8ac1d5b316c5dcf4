"""Confirming an alert's evidence against the backend itself: two reads, `interval` apart
(`core.confirm` decides; this module only reads).

The reads are the exporter's own: `/metrics` parsed with the same limits, and vLLM's
sleep and pause endpoints. Nothing is sent to an engine with work in flight; an engine
that is idle (the alert proved it hung through failed probes) gets one probe.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..core import engines
from ..core.confirm import ConfirmRead, against_evidence, idle
from ..core.engines import Limits, OverLimits, UnknownEngine
from ..core.evidence import Evidence
from ..core.exposition import ParseError
from ..probe.client import BackendClient
from ..probe.pieces import read_fetched


class Kept:
    """The reads, kept for the incident record: each payload (its first `max_bytes`), when
    it was read and what it said."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.reads: list[dict[str, Any]] = []

    def add(self, at: float, parts: tuple[str, ...] | None, size: int, read: ConfirmRead) -> None:
        text, n = [], 0
        for p in parts or ():
            if n >= self.max_bytes:
                break
            text.append(p[: self.max_bytes - n])
            n += len(text[-1])
        self.reads.append({"at": at, "payload": "".join(text), "size": size, "reading": read.reading, "error": read.error})


async def read_once(client: BackendClient, limits: Limits | None = None, kept: Kept | None = None) -> ConfirmRead:
    at = time.time()
    fetched = await client.metrics()
    read = await _parse(fetched.parts, fetched.start_header, fetched.error, client, limits)
    if kept is not None:
        kept.add(at, fetched.parts, fetched.size, read)
    return read


async def _parse(parts: tuple[str, ...] | None, start_header: Any, error: str | None, client: BackendClient, limits: Limits | None) -> ConfirmRead:
    if parts is None:
        return ConfirmRead(None, error)
    try:
        reading = await read_fetched(parts, start_header, limits or Limits())
    except (OverLimits, ParseError, UnknownEngine) as exc:
        return ConfirmRead(None, f"/metrics unusable: {exc}")
    sleeping = paused = False
    profile = engines.BY_NAME[reading.profile]
    if profile.sleep_path and profile.pause_path:
        sleeping, paused = await asyncio.gather(client.flag(profile.sleep_path), client.flag(profile.pause_path))
    elif profile.sleep_path or profile.pause_path:
        flag = await client.flag(profile.sleep_path or profile.pause_path or "")
        sleeping, paused = (flag, False) if profile.sleep_path else (False, flag)
    return ConfirmRead(reading, None, sleeping, paused)


async def confirm(client: BackendClient, evidence: Evidence, interval: float, kept: Kept | None = None) -> dict[str, Any]:
    """`state`: `hung` (confirmed), `not_hung` (something moved, or an idle engine answered
    its probe) or None (the reads cannot tell: the caller runs the full check).
    `reads`: how many reads were made; `probes_sent`."""
    started = time.monotonic()
    out: dict[str, Any] = {"method": "evidence", "digests": len(evidence.digests), "reads": 1, "probes_sent": 0}
    first = await read_once(client, kept=kept)
    if first.reading is None:
        return {**out, "state": None, "reason": f"first read: {first.error}"}
    if not evidence.digests:
        # Proven hung while idle (failed probes): idle still, and one more probe fails.
        if not idle(first):
            return {**out, "state": None, "reason": "the alert proved an idle engine hung, but work is in flight now"}
        _, model, err = await client.models()
        if model is None:
            return {**out, "state": None, "reason": f"idle, but no model to probe (/v1/models: {err or 'none listed'})"}
        result = await client.probe(model)
        out["probes_sent"] = 1
        if result.ok is None:
            return {**out, "state": None, "reason": f"probe gave no evidence: {result.detail}"}
        if result.ok:
            return {**out, "state": "not_hung", "reason": f"idle and the probe answered ({result.detail})"}
        return {**out, "state": "hung", "reason": f"idle and the probe failed too ({result.detail})", "seconds": round(time.monotonic() - started, 3)}
    why = against_evidence(evidence, first)
    if why is not None:
        return {**out, "state": "not_hung", "reason": f"first read: {why}"}
    await asyncio.sleep(interval)
    second = await read_once(client, kept=kept)
    out["reads"] = 2
    if second.reading is None:
        return {**out, "state": None, "reason": f"second read: {second.error}"}
    why = against_evidence(evidence, second)
    if why is not None:
        return {**out, "state": "not_hung", "reason": f"second read: {why}"}
    e = first.reading.engines
    running = sum(x.running for x in e.values())
    waiting = sum(x.waiting for x in e.values())
    reason = (
        f"{len(evidence.digests)} engine(s) unchanged since the alert's evidence over two reads {interval:g}s apart "
        f"({running:g} running, {waiting:g} waiting): no progress since the exporter proved the hang"
    )
    return {**out, "state": "hung", "reason": reason, "running": running, "waiting": waiting, "seconds": round(time.monotonic() - started, 3)}
