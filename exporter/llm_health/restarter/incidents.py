"""The incident record: what the restarter knew of a hang at the moment it restarted it.

One directory per incident (mode 0700) under `incidents.dir`, its files 0600:

    20261202T141503Z-gpu0-1/
      index.json          the alert, the confirming reads, the timeline, the processes,
                          the stacks' outcomes, what could not be captured and why
      metrics-1.txt       the /metrics payloads of the two confirming reads (bounded)
      metrics-2.txt
      stacks-<pid>-<tool>.txt   each process's dump, as the tool printed it
      maps-<pid>.txt      a native process's executable mappings (a stripped binary's
                          frame addresses to offsets, for addr2line on an unstripped build)

Nothing in it holds a secret: the reads are the engine's /metrics bodies (no request
headers), and every text is passed through `capture.redact` (the backend's API key, the
restarter's token and any `--api-key`-like flag on a dumped command line). The newest
`incidents.keep` are kept; one incident's files stay under `incidents.max_bytes`.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..config.capture import Incidents
from ..config.restarter import Target
from ..core.evidence import progress_digest
from ..core.health import Verdict
from ..core.incident import INCIDENT_ID, engine_fields, unmoved
from .capture import CaptureResult, capture, redact

log = logging.getLogger("llm_health.restarter")


def rfc3339(ts: str) -> float | None:
    """Alertmanager's startsAt as Unix seconds (None when it is not one)."""
    try:
        whole, _, frac = ts.rstrip("Z").partition(".")
        whole = whole.split("+")[0]
        return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + (float("0." + "".join(c for c in frac if c.isdigit())) if frac else 0.0)
    except (ValueError, AttributeError):
        return None


class IncidentStore:
    def __init__(self, cfg: Incidents):
        self.cfg = cfg
        self.directory = Path(cfg.dir) if cfg.dir else None

    def prepare(self) -> Path:
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="llm-health-incidents-"))
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return self.directory

    def new_id(self, backend: str, action: int) -> str:
        safe = "".join(c if c.isalnum() or c in "-_.:" else "_" for c in backend)[:128]
        return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{safe}-{action}"

    def ids(self) -> list[str]:
        """Incident ids, newest first."""
        if self.directory is None or not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if INCIDENT_ID.match(p.name) and (p / "index.json").is_file()]
        return [p.name for p in sorted(found, key=lambda p: (p.stat().st_mtime, p.name), reverse=True)]

    def _dir(self, incident_id: str) -> Path | None:
        if self.directory is None or not INCIDENT_ID.match(incident_id):
            return None
        d = self.directory / incident_id
        return d if (d / "index.json").is_file() else None

    def index(self, incident_id: str) -> dict[str, Any] | None:
        d = self._dir(incident_id)
        if d is None:
            return None
        try:
            data: dict[str, Any] = json.loads((d / "index.json").read_text())
        except (OSError, ValueError):
            return None
        return data

    def file(self, incident_id: str, name: str) -> bytes | None:
        d = self._dir(incident_id)
        index = self.index(incident_id)
        if d is None or index is None or name not in index.get("files", {}):
            return None  # only the files the index names: no path from the request is opened
        with contextlib.suppress(OSError):
            return (d / name).read_bytes()
        return None

    def write(self, incident_id: str, index: dict[str, Any], files: list[tuple[str, str]]) -> Path:
        """Write the raw files (each cut to what is left of max_bytes) and the index."""
        d = self.prepare() / incident_id
        d.mkdir(mode=0o700)
        left = self.cfg.max_bytes - 64 * 1024  # room kept for the index
        listed: dict[str, dict[str, Any]] = {}
        for name, text in files:
            data = text.encode("utf-8", "replace")
            keep = data[: max(0, left)]
            left -= len(keep)
            _write(d / name, keep)
            listed[name] = {"bytes": len(keep), "truncated": len(keep) < len(data)}
        index["files"] = listed
        _write(d / "index.json", json.dumps(index, indent=1, default=str).encode()[: 64 * 1024 + max(0, left)])
        self.enforce()
        return d

    def enforce(self) -> None:
        for old in self.ids()[self.cfg.keep :]:
            assert self.directory is not None
            shutil.rmtree(self.directory / old, ignore_errors=True)


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def read_entry(n: int, read: dict[str, Any], evidence: frozenset[int]) -> dict[str, Any]:
    """One confirming read in the index (its payload goes to metrics-N.txt)."""
    out: dict[str, Any] = {"read": n, "at": read["at"], "payload_file": f"metrics-{n}.txt" if read.get("payload") else None, "bytes": read.get("size")}
    reading = read.get("reading")
    if reading is None:
        out["error"] = read.get("error")
        return out
    out["profile"] = reading.profile
    out["start_time"] = reading.start_time
    engines = []
    for e in reading.engines.values():
        d = progress_digest(reading.profile, reading.start_time, e)
        engines.append({"digest": d, "in_evidence": d in evidence, **engine_fields(reading.profile, e)})
    out["engines"] = engines
    return out


def build_index(
    incident_id: str,
    action: Any,
    target: Target,
    reads: list[dict[str, Any]],
    baseline: Verdict | None,
    result: CaptureResult,
    captured_at: float,
    hung_after: float | None = None,
) -> dict[str, Any]:
    """The index. `hung_after`: how long without progress the exporter's proof of an
    LLMBackendHung took (the restarter's verify.hung_after_seconds, the exporter's default)."""
    evidence_text = getattr(action, "evidence_annotation", None)
    digests: frozenset[int] = frozenset()
    if evidence_text:
        digests = frozenset(int(t) for t in evidence_text.replace(",", " ").split() if t.isdigit())
    entries = [read_entry(i + 1, r, digests) for i, r in enumerate(reads)]
    if len(entries) >= 2 and entries[0].get("engines") and entries[1].get("engines"):
        second = {e["digest"]: e for e in entries[1]["engines"]}
        for e in entries[1]["engines"]:
            first = next((f for f in entries[0]["engines"] if f["digest"] == e["digest"]), None)
            e["unmoved"] = unmoved(first, e) if first is not None else []
        for e in entries[0]["engines"]:
            e["unmoved"] = second[e["digest"]]["unmoved"] if e["digest"] in second else []
    starts = rfc3339(action.starts_at)
    timeline: list[dict[str, Any]] = []
    if starts is not None:
        timeline.append({"at": starts, "event": f"{action.alertname} started (its rule had proven the hang)"})
    timeline.append({"at": action.received_at, "event": "webhook received, action accepted"})
    for e in entries:
        state = "error: " + str(e.get("error")) if "error" in e else ", ".join(f"{x['running']} running, {x['waiting']} waiting" for x in e.get("engines", []))
        timeline.append({"at": e["at"], "event": f"confirming read {e['read']}", "state": state})
    if action.verified_at:
        timeline.append({"at": action.verified_at, "event": "hang confirmed", "state": (action.verification or {}).get("state")})
    if baseline is not None:
        timeline.append({"at": captured_at, "event": "last read before the restart", "state": str(baseline.state), "reason": baseline.reason})
    timeline.append({"at": captured_at, "event": "capture started"})
    no_progress: dict[str, Any] = {"at_least_seconds": None, "how": "the alert's startsAt is not a time"}
    if starts is not None:
        since = round(captured_at - starts, 1)
        no_progress = {
            "at_least_seconds": since,
            "since_alert_seconds": since,
            "how": "since the alert started (its rule had proven no progress before it fired); the confirming reads show the same digests",
        }
        if action.alertname == "LLMBackendHung" and hung_after:
            no_progress["at_least_seconds"] = round(since + hung_after, 1)
            no_progress["how"] = (
                f"{since:g}s since the alert started, plus the {hung_after:g}s without progress the exporter's proof takes "
                "(its hung_after_seconds, taken to be the restarter's verify.hung_after_seconds)"
            )
    stacks = []
    comm = {p.pid: p.comm for p in result.processes}
    for dump in result.dumps:
        stacks.append(
            {
                "pid": dump.pid,
                "comm": comm.get(dump.pid, ""),
                "tool": dump.tool,
                "argv": dump.argv,
                "outcome": dump.outcome,
                "seconds": dump.seconds,
                "file": f"stacks-{dump.pid}-{dump.tool}.txt",
                "truncated": dump.truncated,
                "detail": dump.detail,
            }
        )
    profile = next((e["profile"] for e in entries if "profile" in e), None)
    return {
        "id": incident_id,
        "backend": target.name,
        "url": target.url,
        "action": action.id,
        "created_at": time.time(),
        "alert": {
            "alertname": action.alertname,
            "labels": action.labels,
            "startsAt": action.starts_at,
            "fingerprint": action.fingerprint,
            "evidence": evidence_text,
            "evidence_from": action.evidence,
        },
        "verification": action.verification,
        "engine": {"profile": profile, "kind": target.kind},
        "no_progress": no_progress,
        "reads": entries,
        "reads_note": "the restarter's two confirming reads, with their payloads"
        if entries
        else "no payload kept: the hang was re-verified by the full check (its rounds are not kept)",
        "timeline": timeline,
        "timeline_note": "what the restarter saw; the exporter's rounds before the alert are in Prometheus (llm_backend_state, llm_backend_seconds_since_progress)",
        "processes": [p.as_dict() for p in result.processes],
        "stacks": stacks,
        "capture": {"found_by": result.found_by, "budget_seconds": result.budget, "seconds": result.seconds, "failures": result.failures},
    }


async def record_incident(
    action: Any,
    target: Target,
    store: IncidentStore,
    reads: list[dict[str, Any]],
    baseline: Verdict | None,
    secrets: tuple[str, ...],
    hung_after: float | None = None,
) -> tuple[str, dict[str, Any]]:
    """Capture the stacks (within the target's budget) and write the record. (id, index)."""
    captured_at = time.time()
    cfg = target.capture
    if cfg.enabled:
        result = await capture(target.url, cfg)
    else:
        result = CaptureResult(found_by="capture: false (no stacks read)")
    incident_id = store.new_id(target.name, action.id)
    secrets = tuple(s for s in (*secrets, target.api_key) if s)
    index = build_index(incident_id, action, target, reads, baseline, result, captured_at, hung_after)
    files = [(f"metrics-{i + 1}.txt", redact(r["payload"], secrets, flags=False)) for i, r in enumerate(reads) if r.get("payload")]
    files += [(s["file"], redact(d.text, secrets)) for s, d in zip(index["stacks"], result.dumps, strict=True)]
    files += [(f"maps-{pid}.txt", text) for pid, text in result.maps.items() if text]
    index = json.loads(redact(json.dumps(index, default=str), secrets))
    await asyncio.to_thread(store.write, incident_id, index, files)
    return incident_id, index


async def keep_evidence(
    store: IncidentStore, action: Any, target: Target, baseline: Verdict | None, secrets: tuple[str, ...], hung_after: float | None = None
) -> dict[str, Any] | None:
    """The record, within the target's capture budget (and a little more for writing it);
    the action learns its id and how long it took. Whatever fails is logged and None
    returned: the restart goes on."""
    started = time.monotonic()
    try:
        incident_id, index = await asyncio.wait_for(
            record_incident(action, target, store, action.reads, baseline, secrets, hung_after), target.capture.budget + 5.0
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("%s: the incident record failed (%s); restarting anyway", target.name, type(exc).__name__)
        return None
    finally:
        action.capture_seconds = round(time.monotonic() - started, 3)
    action.incident = incident_id
    failures = index["capture"]["failures"]
    read = [f"{s['pid']} ({s['tool']})" for s in index["stacks"] if s["outcome"] == "ok"]
    log.warning(
        "%s: incident %s recorded in %.1fs: stacks of %s%s; GET /incidents/%s, or: llm-health incident show %s --dir %s",
        target.name,
        incident_id,
        action.capture_seconds,
        ", ".join(read) or "no process",
        f"; not captured: {', '.join(sorted({f['reason'] for f in failures}))}" if failures else "",
        incident_id,
        incident_id,
        store.directory,
    )
    return index
