"""The machine line every benchmark prints: which CPU the figures come from."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def machine_line(*software: str) -> str:
    """CPU, cores, memory, kernel, Python, the software measured, and the load average
    when the run began (these machines are shared)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    parts = [cpu_model(), f"{os.cpu_count()} cores", f"{mem:.0f} GiB", f"Linux {platform.release()}", f"Python {platform.python_version()}", *software]
    return ", ".join(parts) + f", loadavg at start {os.getloadavg()[0]:.2f}"
