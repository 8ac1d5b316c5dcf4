"""The restarter's `/status` body, from its state at the time of the call (the shared
state's budget view included)."""

from __future__ import annotations

from typing import Any


async def status_of(self: Any) -> dict[str, Any]:
    """`GET /status` of a Restarter: per backend its restart, drain, budget, action in
    progress, last recovery and incident; the recent actions and refusals."""
    backends = []
    for t in self.config.targets:
        entry: dict[str, Any] = {"backend": t.name, "url": t.url, "instance": t.instance, "kind": t.kind}
        if t.kind != "proxy":
            entry.update(restart=list(t.restart), restart_timeout=t.restart_timeout, ready=t.name not in self.draining)
            if t.drain_command:
                entry.update(drain_command=list(t.drain_command), drain_timeout=t.drain_timeout)
            try:
                view = await self.state.budget(t.name)
                entry.update(
                    restarts_in_window=view.restarts_in_window,
                    next_restart_allowed_in=round(view.wait, 3),
                    budget=view.refusal or "ok",
                    budget_exhausted=view.exhausted,
                )
            except Exception as exc:  # the shared state is down: say so, show the rest
                entry.update(budget="unknown", budget_error=f"shared state unavailable: {type(exc).__name__}")
            entry.update(
                in_progress=next((a.id for a in self.actions if a.backend == t.name and a.phase != "done"), None),
                last_recovery_seconds=self.recovery_seconds.get(t.name),
                last_incident=next((f"/incidents/{a.incident}" for a in self.actions if a.backend == t.name and a.incident), None),
            )
        backends.append(entry)
    b = self.config.budget
    return {
        "dry_run": self.dry_run,
        "state": self.state.mode,
        "output_dir": str(self.outputs.directory) if self.outputs.directory else None,
        "incidents_dir": str(self.incidents.directory) if self.incidents.directory else None,
        "incidents": "/incidents",
        "budget": {"max_restarts": b.max_restarts, "window": b.window, "cooldown": b.cooldown, "backoff": b.backoff},
        "backends": backends,
        "actions": [a.status() for a in self.actions],
        "refused": list(self.refused),
        "refusals": dict(self.refusals),
    }
