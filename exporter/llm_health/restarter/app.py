"""`llm-health restarter`: the restart authority, an Alertmanager webhook receiver.

```
Alertmanager ──POST /alerts (webhook v4, Bearer token)──▶ validate ──▶ admit (Policy: pure) ──▶ 202
                                                                         │ background task
         re-verify: `llm-health check`'s own code (probe.check) ◀────────┘
              │ still `hung`?  no: refuse `not_hung`
              ▼
         claim the budget (Policy: window, cooldown, backoff) ── spent: refuse, budget_exhausted 1
              ▼
         restart argv (no shell; own process group; killed at its timeout; output kept)
              ▼
         wait for the backend: `restarted`, then `idle` or `busy` (BackendMonitor rounds)
```

Acts only on `LLMBackendHung` (matched on its `backend` label) and `VLLMEngineHung`
(matched on `instance`). Alertmanager delivers at least once and times webhooks out, so
the request is answered as soon as the body is validated and de-duplicated; the work
runs in the background and its progress is on `/status`.

The decision core (`core.restart_policy`, `core.webhook`) is pure: no I/O, time passed
in. The I/O around it (`Restarter`: HTTP, the check, the subprocess) is thin. Routes:
`POST /alerts` and `GET /status` (bearer token), `/metrics`, `/-/healthy`, `/-/reload`,
a landing page.

Series (`restarter.collector`): `llm_restarter_restarts_total{backend,outcome}`
(outcome: recovered, not_recovered, failed, timeout, error, dry_run),
`llm_restarter_refusals_total{reason}`, `llm_restarter_recovery_seconds{backend}` (last),
`llm_restarter_budget_exhausted{backend}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from ..config.restarter import TOKEN_ENV, RestarterConfig, Target, load_config
from ..config.web import WebConfig
from ..core.health import Settings
from ..core.restart_policy import OUTCOMES, REFUSALS, Policy
from ..core.states import State
from ..core.webhook import Malformed, parse_webhook
from ..probe.check import run_check
from ..probe.client import BackendClient
from ..probe.monitor import BackendMonitor
from ..web import OPEN_PATHS, USER_KEY, BearerToken, add_reload, healthy, metrics_handler, secure
from .collector import RestarterCollector
from .runner import run_command

log = logging.getLogger("llm_health.restarter")

MAX_BODY = 1024 * 1024


@dataclass
class Action:
    """One accepted alert and what became of it, for /status."""

    id: int
    backend: str
    alertname: str
    fingerprint: str
    starts_at: str
    received_at: float  # wall clock
    labels: dict[str, str]
    dry_run: bool = False
    phase: str = "queued"  # queued, verifying, restarting, recovering, done
    verification: dict[str, Any] | None = None
    refusal: str | None = None
    outcome: str | None = None
    detail: str = ""
    command: list[str] = field(default_factory=list)
    command_result: dict[str, Any] | None = None
    recovery_seconds: float | None = None
    recovery_state: str | None = None
    restart_seen: bool | None = None
    finished_at: float | None = None

    def status(self) -> dict[str, Any]:
        return dict(self.__dict__)


Verifier = Callable[[Target], Awaitable[dict[str, Any]]]


class Restarter:
    def __init__(
        self,
        config: RestarterConfig,
        token: str,
        *,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
        verifier: Verifier | None = None,
        child_env: dict[str, str] | None = None,
        token_env: str = TOKEN_ENV,
        config_file: str | os.PathLike[str] | None = None,
    ):
        if not token:
            raise ValueError("the restarter needs a bearer token")
        self.config = config
        self.config_file = config_file
        self.dry_run = dry_run
        self.clock = clock
        self.policy: Policy[Target] = Policy(config.targets, config.budget)
        self.verifier = verifier or self._check
        self._token = BearerToken(token)
        env = dict(os.environ if child_env is None else child_env)
        env.pop(token_env, None)  # the token is never handed to a restart command
        self.child_env = env
        self.refusals = dict.fromkeys(REFUSALS, 0)
        self.outcomes: dict[tuple[str, str], int] = {(t.name, o): 0 for t in config.targets if t.kind != "proxy" for o in OUTCOMES}
        self.recovery_seconds: dict[str, float] = {}
        self.actions: deque[Action] = deque(maxlen=config.history)
        self.refused: deque[dict[str, Any]] = deque(maxlen=config.history)
        self.tasks: set[asyncio.Task[None]] = set()
        self._next_id = 1
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(RestarterCollector(self))

    # --- verification and recovery: the same code as `llm-health check` ------------------
    async def _check(self, target: Target) -> dict[str, Any]:
        v = self.config.verify
        return await run_check(
            target.url,
            kind=target.kind,
            interval=v.interval,
            rounds=v.rounds,
            hung_after=v.hung_after_seconds,
            probe_timeout=v.probe_timeout,
            metrics_timeout=v.metrics_timeout,
            api_key=target.api_key,
        )

    def _monitor(self, session: aiohttp.ClientSession, target: Target) -> BackendMonitor:
        v = self.config.verify
        client = BackendClient(
            session,
            target.url,
            api_key=target.api_key,
            probe_timeout=v.probe_timeout,
            metrics_timeout=v.metrics_timeout,
            models_timeout=min(10.0, v.metrics_timeout),
        )
        # As in `check`, each idle round may probe: the recovery wait is short and ends at idle.
        return BackendMonitor(client, kind=target.kind, settings=Settings(hung_after_seconds=v.hung_after_seconds, probe_interval=0.0))

    # --- the background action ----------------------------------------------------------
    def _refuse(self, reason: str, detail: str = "", **about: Any) -> None:
        self.refusals[reason] += 1
        if reason not in ("unauthorised", "malformed"):
            self.refused.appendleft({"reason": reason, "detail": detail, "at": time.time(), **about})

    async def _act(self, action: Action, target: Target, key: tuple[str, str]) -> None:
        restarted = False
        try:
            action.phase = "verifying"
            try:
                result = await self.verifier(target)
            except Exception as exc:
                log.exception("%s: re-verification failed", target.name)
                result = {"state": State.UNKNOWN, "reason": f"re-verification failed: {type(exc).__name__}: {exc}"}
            action.verification = {
                k: result.get(k) for k in ("state", "reason", "running", "waiting", "rounds", "probes_sent", "steps_per_second", "generation_tokens_per_second")
            }
            if result.get("state") != State.HUNG:
                action.refusal = "not_hung"
                action.detail = f"re-verified {result.get('state')}: {result.get('reason')}"
                self._refuse("not_hung", action.detail, backend=target.name, action=action.id)
                log.info("%s: %s not acted on: %s", target.name, action.alertname, action.detail)
                return
            refusal, wait = self.policy.claim(target.name, self.clock())
            if refusal:
                action.refusal = refusal
                done = self.policy.restarts_in_window(target.name, self.clock())
                if refusal == "budget_spent":
                    action.detail = (
                        f"hung, but {done} restarts in the last {self.config.budget.window:g}s spent the budget "
                        f"({self.config.budget.max_restarts}); not restarting (llm_restarter_budget_exhausted 1), room again in {wait:.0f}s"
                    )
                    log.warning("%s: %s", target.name, action.detail)
                else:
                    action.detail = f"hung, but in cooldown after the last restart: {wait:.0f}s left"
                    log.info("%s: %s", target.name, action.detail)
                self._refuse(refusal, action.detail, backend=target.name, action=action.id)
                return
            restarted = True
            action.command = list(target.restart)
            if self.dry_run:
                action.outcome = "dry_run"
                action.detail = (
                    f"dry run: would run {list(target.restart)} (no shell, timeout {target.restart_timeout:g}s), "
                    f"then wait up to {self.config.recovery_timeout:g}s for the backend to come back"
                )
                log.info("%s: %s", target.name, action.detail)
                return
            await self._restart(action, target)
        except asyncio.CancelledError:
            action.outcome = action.outcome or ("error" if restarted else None)
            action.detail = action.detail or "cancelled (the restarter is stopping)"
            raise
        except Exception as exc:
            log.exception("%s: action failed", target.name)
            action.detail = f"{type(exc).__name__}: {exc}"
            if restarted:
                action.outcome = "error"
            else:
                action.refusal = "not_hung"
                self._refuse("not_hung", action.detail, backend=target.name, action=action.id)
        finally:
            if action.outcome:
                self.outcomes[(target.name, action.outcome)] = self.outcomes.get((target.name, action.outcome), 0) + 1
            self.policy.finish(target.name, key, restarted, self.clock())
            action.phase = "done"
            action.finished_at = time.time()

    async def _restart(self, action: Action, target: Target) -> None:

        async with aiohttp.ClientSession() as session:
            monitor = self._monitor(session, target)
            # A baseline of the old process, so its successor shows as `restarted`.
            await monitor.round()
            action.phase = "restarting"
            log.warning("%s: restarting: %s (timeout %gs)", target.name, list(target.restart), target.restart_timeout)
            started = time.monotonic()
            env = {**self.child_env, "LLM_HEALTH_BACKEND": target.name, "LLM_HEALTH_BACKEND_URL": target.url}
            result = await run_command(target.restart, target.restart_timeout, self.config.kill_grace, self.config.max_output_bytes, env)
            action.command_result = {
                "outcome": result.outcome,
                "exit_code": result.exit_code,
                "pid": result.pid,
                "seconds": round(result.seconds, 3),
                "output": result.output,
                "output_bytes": result.output_bytes,
                "output_truncated": result.truncated,
                "detail": result.detail,
            }
            if result.outcome != "ok":
                action.outcome = result.outcome
                action.detail = f"restart command {result.detail}"
                log.error("%s: restart command %s; output tail: %s", target.name, result.detail, result.output[-2000:])
                return
            action.phase = "recovering"
            interval = self.config.recovery_interval or self.config.verify.interval
            deadline = time.monotonic() + self.config.recovery_timeout
            seen = False
            state, reason = None, ""
            while True:
                verdict = await monitor.round()
                state, reason = verdict.state, verdict.reason
                seen = seen or state in (State.RESTARTED, State.DOWN)
                if state in (State.IDLE, State.BUSY):
                    action.recovery_seconds = time.monotonic() - started
                    break
                if time.monotonic() + interval > deadline:
                    break
                await asyncio.sleep(interval)
            action.recovery_state, action.restart_seen = state, seen
            if action.recovery_seconds is not None:
                action.outcome = "recovered"
                self.recovery_seconds[target.name] = action.recovery_seconds
                action.detail = f"back {state} {action.recovery_seconds:.1f}s after the restart began" + (
                    "" if seen else " (no new process seen: the engine moved again)"
                )
                log.info("%s: %s", target.name, action.detail)
            else:
                action.outcome = "not_recovered"
                action.detail = f"not back after {self.config.recovery_timeout:g}s: last {state} ({reason})"
                log.error("%s: %s", target.name, action.detail)

    # --- HTTP -----------------------------------------------------------------------------
    def authorised(self, request: web.Request) -> bool:
        """The bearer token Alertmanager sends, or a user of the web config's basic_auth_users."""
        return self._token.check(request) or bool(request.get(USER_KEY))

    def _unauthorised(self, request: web.Request) -> web.Response:
        self._refuse("unauthorised")
        log.warning("refused %s %s from %s: missing or wrong bearer token", request.method, request.path, request.remote)
        return web.json_response({"error": "unauthorised"}, status=401, headers={"WWW-Authenticate": 'Bearer realm="llm-health restarter"'})

    async def handle_alerts(self, request: web.Request) -> web.Response:
        if not self.authorised(request):
            return self._unauthorised(request)
        try:
            webhook = parse_webhook(await request.read())
        except Malformed as exc:
            self._refuse("malformed")
            log.warning("refused a webhook body: %s", exc)
            return web.json_response({"error": f"malformed webhook: {exc}"}, status=400)
        if webhook.truncated_alerts:
            log.warning("Alertmanager truncated %d alerts from this notification (max_alerts)", webhook.truncated_alerts)
        now = self.clock()
        answers = []
        accepted = 0
        for alert in webhook.alerts:
            adm = self.policy.admit(alert, now)
            answer: dict[str, Any] = {
                "alertname": alert.alertname,
                "fingerprint": alert.fingerprint,
                "startsAt": alert.starts_at,
                "backend": adm.backend,
                "decision": adm.decision,
            }
            if adm.detail:
                answer["detail"] = adm.detail
            if adm.decision == "accepted":
                accepted += 1
                assert adm.backend is not None  # accepted alerts name their backend
                target = self.policy.targets[adm.backend]
                action = Action(
                    self._next_id, target.name, alert.alertname, alert.fingerprint, alert.starts_at, time.time(), alert.labels, dry_run=self.dry_run
                )
                self._next_id += 1
                self.actions.appendleft(action)
                answer["action"] = action.id
                log.info(
                    "%s: %s (fingerprint %s, startsAt %s) accepted as action %d; re-verifying",
                    target.name,
                    alert.alertname,
                    alert.fingerprint,
                    alert.starts_at,
                    action.id,
                )
                task = asyncio.create_task(self._act(action, target, alert.key), name=f"restarter-{target.name}-{action.id}")
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif adm.decision == "ignored":
                log.info("ignored %s: %s", alert.alertname, adm.detail)
            else:
                self._refuse(adm.decision, adm.detail, backend=adm.backend, alertname=alert.alertname, fingerprint=alert.fingerprint, startsAt=alert.starts_at)
                log.info("%s (fingerprint %s) refused: %s: %s", alert.alertname, alert.fingerprint, adm.decision, adm.detail)
            answers.append(answer)
        # 2xx is success to Alertmanager; 202 says the work goes on in the background.
        return web.json_response({"accepted": accepted, "alerts": answers, "dry_run": self.dry_run}, status=202 if accepted else 200)

    def status(self) -> dict[str, Any]:
        now = self.clock()
        backends = []
        for t in self.config.targets:
            entry: dict[str, Any] = {"backend": t.name, "url": t.url, "instance": t.instance, "kind": t.kind}
            if t.kind != "proxy":
                refusal, wait = self.policy.verdict(t.name, now)
                entry.update(
                    restart=list(t.restart),
                    restart_timeout=t.restart_timeout,
                    restarts_in_window=self.policy.restarts_in_window(t.name, now),
                    next_restart_allowed_in=round(wait, 3),
                    budget=refusal or "ok",
                    budget_exhausted=self.policy.exhausted(t.name, now),
                    in_progress=next((a.id for a in self.actions if a.backend == t.name and a.phase != "done"), None),
                    last_recovery_seconds=self.recovery_seconds.get(t.name),
                )
            backends.append(entry)
        b = self.config.budget
        return {
            "dry_run": self.dry_run,
            "budget": {"max_restarts": b.max_restarts, "window": b.window, "cooldown": b.cooldown, "backoff": b.backoff},
            "backends": backends,
            "actions": [a.status() for a in self.actions],
            "refused": list(self.refused),
            "refusals": dict(self.refusals),
        }

    async def handle_status(self, request: web.Request) -> web.Response:
        if not self.authorised(request):
            return self._unauthorised(request)
        return web.json_response(self.status(), dumps=lambda o: json.dumps(o, default=str))

    async def handle_index(self, request: web.Request) -> web.Response:
        return web.Response(
            text="llm-health restarter: POST /alerts (Alertmanager webhook v4, bearer token), GET /status (bearer token), /metrics, /-/healthy\n"
        )

    async def stop(self) -> None:
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def reload(self) -> str:
        """Re-read the configuration file. Budgets, cooldowns and remembered alerts of
        backends that stay are kept; actions under way finish with the settings they began with."""
        if self.config_file is None:
            return "no configuration file to reload"
        new = load_config(self.config_file)
        self.policy.update(new.targets, new.budget)
        for t in new.targets:
            if t.kind != "proxy":
                for o in OUTCOMES:
                    self.outcomes.setdefault((t.name, o), 0)
        self.config = new
        return f"{len(new.targets)} backends"

    def app(self, web_config: WebConfig | None = None) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        # /alerts and /status check the bearer token themselves (and accept basic auth users).
        secure(app, web_config or WebConfig(), protected=lambda r: r.path not in OPEN_PATHS and not (r.path in ("/alerts", "/status") and _bearer(r)))
        app.router.add_get("/", self.handle_index)
        app.router.add_post("/alerts", self.handle_alerts)
        app.router.add_get("/status", self.handle_status)
        app.router.add_get("/metrics", metrics_handler(self.registry))
        app.router.add_get("/-/healthy", healthy)
        add_reload(app, self.reload)

        async def on_cleanup(_app: web.Application) -> None:
            await self.stop()

        app.on_cleanup.append(on_cleanup)
        return app


def _bearer(request: web.Request) -> bool:
    return request.headers.get("Authorization", "").lower().startswith("bearer ")
