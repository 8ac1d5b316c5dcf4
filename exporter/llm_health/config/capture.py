"""The restarter's evidence capture: `capture:` per backend and `incidents:` for the
records (docs/restarts.md, "The incident record").

```yaml
restarter:
  incidents: {dir: /var/lib/llm-health/incidents, keep: 50, max_bytes: 8388608}
backends:
  - name: gpu0
    url: http://127.0.0.1:8000
    restart: [systemctl, restart, vllm@gpu0]
    capture:
      pid_file: /run/vllm/gpu0.pid      # or pids_command: [systemctl, show, -p, MainPID, --value, vllm@gpu0]
      budget: 10s                       # per backend, inside the 90 s hang-to-restart goal
      stacks: auto                      # py-spy for Python processes, gdb (or eu-stack) for native ones
```

Neither `pid_file` nor `pids_command`: the process listening on the URL's port, when the
URL is on this host. `capture: false` records the incident without stacks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import Section

STACK_TOOLS = ("auto", "py-spy", "gdb", "eu-stack")


@dataclass(frozen=True)
class Capture:
    """How the restarter finds a backend's processes and reads their stacks."""

    enabled: bool = True
    pid_file: str | None = None
    pids_command: tuple[str, ...] = ()
    budget: float = 10.0  # seconds, all of the capture of one backend
    stacks: str = "auto"
    tree: bool = True  # the found processes' descendants too (vLLM's engine core, workers)
    max_processes: int = 16
    native: bool = False  # py-spy --native (it pauses the process: never on a stopped one)
    py_spy: str = "py-spy"
    gdb: str = "gdb"
    eu_stack: str = "eu-stack"


@dataclass(frozen=True)
class Incidents:
    """Where incident records are kept, how many and how large."""

    dir: str | None = None  # None: a private directory under the system's temp dir
    keep: int = 50
    max_bytes: int = 8 * 1024 * 1024  # one incident's files, all together
    max_payload_bytes: int = 256 * 1024  # each /metrics payload kept


def parse_capture(entry: Section) -> Capture:
    raw = entry.raw("capture", None)
    if raw is False:
        return Capture(enabled=False)
    if raw is True or raw is None:
        return Capture()
    c = entry.section("capture")
    d = Capture()
    pid_file = c.string("pid_file", None)
    pids_command = c.argv("pids_command") if "pids_command" in c else ()
    if pid_file and pids_command:
        raise c.error("pids_command", "give pid_file or pids_command, not both")
    out = Capture(
        enabled=c.boolean("enabled", True),
        pid_file=pid_file,
        pids_command=pids_command,
        budget=c.duration("budget", d.budget, maximum=60.0),
        stacks=c.choice("stacks", STACK_TOOLS, d.stacks),
        tree=c.boolean("tree", d.tree),
        max_processes=c.integer("max_processes", d.max_processes, maximum=256),
        native=c.boolean("native", d.native),
        py_spy=c.string("py_spy", d.py_spy),
        gdb=c.string("gdb", d.gdb),
        eu_stack=c.string("eu_stack", d.eu_stack),
    )
    c.done()
    return out


def parse_incidents(section: Section) -> Incidents:
    s = section.section("incidents")
    d = Incidents()
    out = Incidents(
        dir=s.string("dir", None),
        keep=s.integer("keep", d.keep, maximum=100_000),
        max_bytes=s.integer("max_bytes", d.max_bytes, minimum=64 * 1024, maximum=1 << 34),
        max_payload_bytes=s.integer("max_payload_bytes", d.max_payload_bytes, minimum=1024, maximum=16 * 1024 * 1024),
    )
    s.done()
    if out.max_payload_bytes * 2 > out.max_bytes:
        raise s.error("max_payload_bytes", f"two payloads of {out.max_payload_bytes} bytes do not fit in max_bytes ({out.max_bytes})")
    return out
