"""The drain: stop new traffic to a backend whose restart is decided, before anything
else is done to it.

Two ways, both from the moment the hang is re-verified and the budget claimed (never for
an alert that is still being judged, so a busy server is never drained):

* the restarter's own `/-/ready?backend=NAME` answers 503 until the action is done
  (restarter.app), for a load balancer that asks the restarter;
* the target's optional `drain_command` is run here: an argv without a shell, with the
  restart command's rules (restarter.runner: its own session, only its own exit waited
  for, its output to a 0600 file, the restarter's token not in its environment), bounded
  by `drain_timeout`: SIGTERM then, SIGKILL one second later.

A drain that fails, times out or cannot start is recorded on the action and logged, and
the restart goes on: a hung server serves nobody, so a broken drain must not keep it hung.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config.restarter import RestarterConfig, Target
from .runner import CommandResult, OutputFiles, run_command

log = logging.getLogger("llm_health.restarter")

KILL_GRACE = 1.0  # seconds from SIGTERM to SIGKILL for a drain past its timeout


def result_record(result: CommandResult) -> dict[str, Any]:
    """A command's result as the action record (and /status) show it."""
    return {
        "outcome": result.outcome,
        "exit_code": result.exit_code,
        "pid": result.pid,
        "seconds": round(result.seconds, 3),
        "output": result.output,
        "output_bytes": result.output_bytes,
        "output_truncated": result.truncated,
        "output_file": result.output_file,
        "detail": result.detail,
    }


async def drain(target: Target, action_id: int, config: RestarterConfig, env: dict[str, str], outputs: OutputFiles) -> dict[str, Any] | None:
    """Run the target's drain_command; its result record, or None without one."""
    if not target.drain_command:
        return None
    log.warning("%s: draining: %s (timeout %gs)", target.name, list(target.drain_command), target.drain_timeout)
    output_file = outputs.new(target.name, action_id, kind="drain")
    result = await run_command(target.drain_command, target.drain_timeout, output_file, min(KILL_GRACE, config.kill_grace), config.max_output_bytes, env)
    if result.outcome != "ok":
        log.error("%s: drain command %s; restarting anyway; output tail: %s", target.name, result.detail, result.output[-2000:])
    return result_record(result)
