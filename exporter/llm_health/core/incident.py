"""An incident record read back: the engine fields of a read, the threads and top frames
of a stack dump, and the readable summary `llm-health incident show` prints. Pure: no I/O.

The record itself (a directory with `index.json` and raw files) is written by
`restarter.incidents`; its index is plain JSON, described there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .engines import BY_NAME, EngineReading

INCIDENT_ID = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[A-Za-z0-9_.:-]{1,128}-[0-9]{1,12}$")


def _num(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def engine_fields(profile: str, e: EngineReading) -> dict[str, Any]:
    """One engine of a read, with the profile's names for its counters and gauges."""
    p = BY_NAME[profile]
    return {
        "model_name": e.model_name,
        "engine": e.engine,
        "running": _num(e.running),
        "waiting": _num(e.waiting),
        "sleeping": e.sleeping,
        "counters": {name: _num(v) for name, v in zip(p.counters, e.counters, strict=False)},
        "gauges": {name: _num(v) for name, v in zip(p.gauges, e.gauges, strict=False)},
    }


def unmoved(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """The counters and gauges equal in two reads of one engine (engine_fields)."""
    out = []
    for group in ("counters", "gauges"):
        for name, v in first[group].items():
            if v is not None and second[group].get(name) == v:
                out.append(name)
    return out


@dataclass(frozen=True)
class Thread:
    name: str
    frames: tuple[str, ...]


_PYSPY_THREAD = re.compile(r'^Thread (\S+) \(([^)]*)\)(?:: "(.*)")?\s*$')
_GDB_THREAD = re.compile(r"^Thread (\d+) \((.*)\):?\s*$")
_EU_THREAD = re.compile(r"^TID (\d+):")
_FRAME = re.compile(r"^#\d+\s+(?:(0x[0-9a-f]+) in |(0x[0-9a-f]+) )?(.*)$")


def parse_maps(text: str) -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of each mapping in a /proc/PID/maps text."""
    out = []
    for line in text.splitlines():
        cols = line.split(maxsplit=5)
        if len(cols) == 6 and "-" in cols[0]:
            start, end = (int(x, 16) for x in cols[0].split("-"))
            out.append((start, end, int(cols[2], 16), cols[5].strip()))
    return out


def locate(address: int, maps: list[tuple[int, int, int, str]]) -> str | None:
    """`binary+0xOFFSET` (the file offset `addr2line -e` wants) of an address, or None."""
    for start, end, offset, path in maps:
        if start <= address < end:
            return f"{path.rsplit('/', 1)[-1]}+{address - start + offset:#x}"
    return None


def threads(tool: str, text: str, maps: str = "") -> list[Thread]:
    """The threads of a dump (py-spy, gdb, eu-stack) and their frames, innermost first.
    A native frame without a symbol (`??`, a stripped binary) is named by its file offset
    where the process's mappings (`maps`) are given."""
    mapped = parse_maps(maps)
    out: list[Thread] = []
    name: str | None = None
    frames: list[str] = []

    def flush() -> None:
        if name is not None:
            out.append(Thread(name, tuple(frames)))

    for line in text.splitlines():
        if tool == "py-spy":
            m = _PYSPY_THREAD.match(line)
            if m:
                flush()
                name, frames = f"{m.group(3) or '?'} (tid {m.group(1)}, {m.group(2)})", []
            elif name is not None and line.startswith("    ") and line.strip():
                frames.append(line.strip())
            continue
        m = (_GDB_THREAD if tool == "gdb" else _EU_THREAD).match(line)
        if m:
            flush()
            name, frames = (f"{m.group(2)}" if tool == "gdb" else f"tid {m.group(1)}"), []
            continue
        f = _FRAME.match(line)
        if f and name is not None:
            frame = re.sub(r"\s*\(.*?\)\s*at\s+", " at ", f.group(3)).strip()[:200]
            address = f.group(1) or f.group(2)
            if address and mapped and (frame.startswith("??") or not frame):
                frame = locate(int(address, 16), mapped) or frame
            frames.append(frame)
    flush()
    return out


STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped by a tracer", "Z": "exited"}


def _seconds(x: float | None) -> str:
    if x is None:
        return "unknown"
    return f"{x:.0f}s" if x < 120 else f"{x / 60:.1f} min"


def summary(index: dict[str, Any], stacks: dict[str, str], top: int = 5) -> str:
    """What `llm-health incident show` prints: the engine, how long without progress, what
    was in flight, the top frames of each thread, and what the capture could not read."""
    lines = [f"incident {index.get('id')}: backend {index.get('backend')} ({index.get('url')}), action {index.get('action')}"]
    alert = index.get("alert") or {}
    evidence = (alert.get("evidence") or "").strip() or "none"
    lines.append(f"  alert      {alert.get('alertname')} startsAt {alert.get('startsAt')}, evidence {evidence} ({alert.get('evidence_from') or 'none'})")
    eng = index.get("engine") or {}
    lines.append(f"  engine     {eng.get('profile', 'unknown')} (pid {', '.join(str(p['pid']) for p in index.get('processes', [])) or 'none found'})")
    np = index.get("no_progress") or {}
    lines.append(f"  no progress for at least {_seconds(np.get('at_least_seconds'))} ({np.get('how', 'unknown')})")
    reads = index.get("reads") or []
    for r in reads[-1:]:
        for e in r.get("engines", []):
            lines.append(
                f"  in flight  {e.get('model_name') or '-'}/{e.get('engine') or '-'}: {e.get('running')} running, {e.get('waiting')} waiting"
                f"; unchanged over both reads: {', '.join(e.get('unmoved', [])) or 'n/a'}"
            )
    v = index.get("verification") or {}
    lines.append(f"  confirmed  {v.get('method')} {v.get('state')}: {v.get('reason')}")
    states = {p.get("pid"): p.get("state") for p in index.get("processes", [])}
    for s in index.get("stacks", []):
        state = STATES.get(states.get(s["pid"]) or "", states.get(s["pid"]) or "?")
        head = f"  stacks of pid {s['pid']} ({s.get('comm', '')}, {state}) by {s['tool']}: {s['outcome']}"
        lines.append(head + (f" ({s['detail']})" if s.get("detail") else ""))
        if s["outcome"] != "ok":
            continue
        for t in threads(s["tool"], stacks.get(s["file"], ""), stacks.get(f"maps-{s['pid']}.txt", "")):
            lines.append(f"    thread {t.name}")
            lines.extend(f"      {f}" for f in t.frames[:top])
            if len(t.frames) > top:
                lines.append(f"      ... {len(t.frames) - top} more")
    for f in index.get("capture", {}).get("failures", []):
        lines.append(f"  not captured: {f['reason']}" + (f" (pid {f['pid']})" if f.get("pid") else "") + f": {f['detail']}")
    lines.append(f"  files      {', '.join(sorted(index.get('files', {})))}")
    return "\n".join(lines)
