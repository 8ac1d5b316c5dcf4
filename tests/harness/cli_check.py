"""`llm-health check` run as a watchdog runs it, for the real-engine tests of every harness
(tests/harness/vllm.py, tests/harness/llamacpp.py)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys


def llm_health_check(url: str, *args: str, timeout: float = 300, python: str | None = None) -> tuple[int, dict | None, str]:
    """Run `python -m llm_health check URL ARGS --json`; (rc, parsed JSON, output)."""
    cmd = [python or sys.executable, "-m", "llm_health", "check", url, *args, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    parsed = None
    for line in reversed(proc.stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                parsed = json.loads(line)
                break
    return proc.returncode, parsed, proc.stdout + proc.stderr
