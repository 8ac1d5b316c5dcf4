"""`llm-health restarter`: the restart authority, an Alertmanager webhook receiver.

```
Alertmanager ──POST /alerts (webhook v4, Bearer token)──▶ validate ──▶ admit (state) ──▶ 202
                                                                     │ background task
  VLLMEngineHung: hold up to raw_alert_hold for the exporter's ◀─────┘
  LLMBackendHung and its evidence (when the exporter layer runs)
              ▼
  confirm: the alert's evidence (progress digests of the hung engines) against two
  fresh reads `confirm_interval` apart (restarter.confirm; core.confirm decides);
  no usable evidence: the full check, `llm-health check`'s own code (probe.check)
              │ moved, restarted, asleep, answered a probe: refuse `not_hung`
              ▼
  claim the budget (window, cooldown, backoff) ── spent: refuse, budget_exhausted 1
              ▼
  drain: /-/ready?backend=NAME answers 503 from here until the action is done; the
  target's drain_command (argv, no shell, drain_timeout), whatever it does the restart follows
              ▼
  restart argv (no shell; own session; only its own exit waited for; output to a file)
              ▼
  wait for the backend: `restarted`, then `idle` or `busy` (read every recovery_interval)
```

Acts only on `LLMBackendHung` (matched on its `backend` label) and `VLLMEngineHung`
(matched on `instance`). Alertmanager delivers at least once and times webhooks out, so
the request is answered as soon as the body is validated and de-duplicated; the work
runs in the background and its progress is on `/status`.

What the authority remembers (the one action per backend, the alerts acted on, the
budget) is in `state.MemoryState`, or with a `redis:` section in
`shared_state.RedisState`, shared by replicas and kept across restarts. The decision core
(`core.restart_policy`, `core.confirm`, `core.webhook`) is pure. Routes: `POST /alerts`
and `GET /status` (bearer token), `/metrics`, `/-/healthy`, `/-/ready?backend=NAME`
(open, like `/-/healthy`: 503 while a restart of that backend is under way), `/-/reload`,
a landing page.

Series (`restarter.collector`): `llm_restarter_restarts_total{backend,outcome}`
(outcome: recovered, not_recovered, failed, timeout, error, dry_run),
`llm_restarter_refusals_total{reason}`, `llm_restarter_recovery_seconds{backend}` (last),
`llm_restarter_budget_exhausted{backend}`, `llm_restarter_drains_total{backend,outcome}`
(outcome: ok, failed, timeout, error), `llm_restarter_unread_alerts_total`,
`llm_restarter_incidents_total{backend}`, `llm_restarter_capture_failures_total{reason}`.
Before each restart the evidence is kept (restarter.capture, .incidents; GET /incidents).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from ..config.errors import ConfigError
from ..config.restarter import TOKEN_ENV, RestarterConfig, Target, load_config
from ..config.web import WebConfig
from ..core.evidence import BadEvidence, parse_evidence
from ..core.restart_policy import ACTED_ON, OUTCOMES, REFUSALS
from ..core.states import State
from ..core.webhook import MAX_ALERTS, Alert, Malformed, parse_webhook
from ..probe.check import check_with
from ..probe.client import BackendClient
from ..web import OPEN_PATHS, USER_KEY, BearerToken, add_reload, healthy, metrics_handler, secure
from .action import Action, client_for, restart_and_recover
from .capture import FAILURES
from .collector import RestarterCollector
from .confirm import Kept, confirm
from .incident_api import add_routes
from .incidents import IncidentStore, keep_evidence
from .runner import OutputFiles
from .state import MemoryState, RestartState
from .status import status_of

log = logging.getLogger("llm_health.restarter")

# A notification's body: 1,000 alerts (the shipped Alertmanager's max_alerts) of up to
# 8 KiB each. A body past 1 MiB is parsed off the event loop.
MAX_BODY = 8 * 1024 * 1024
PARSE_IN_THREAD_OVER = 1024 * 1024
JANITOR_INTERVAL = 10.0  # seconds between checks of the restart commands' output files

Verifier = Callable[[Target], Awaitable[dict[str, Any]]]


def make_state(config: RestarterConfig, clock: Callable[[], float]) -> RestartState:
    if config.redis is None:
        return MemoryState(config.targets, config.budget, clock)
    from .shared_state import RedisState  # needs the `redis` extra only with a `redis:` section

    return RedisState(config.targets, config.budget, config.redis)


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
        state: RestartState | None = None,
    ):
        if not token:
            raise ValueError("the restarter needs a bearer token")
        self.config = config
        self.config_file = config_file
        self.dry_run = dry_run
        self.clock = clock
        self.state = state or make_state(config, clock)
        self.verifier = verifier or self._check
        self._token = BearerToken(token)
        env = dict(os.environ if child_env is None else child_env)
        env.pop(token_env, None)  # the token is never handed to a restart command
        self.child_env = env
        self.outputs = OutputFiles(config.output_dir, keep=config.history, max_bytes=config.max_output_file_bytes)
        self.incidents = IncidentStore(config.incidents)
        self.incident_counts: dict[str, int] = {t.name: 0 for t in config.targets if t.kind != "proxy"}
        self.capture_failures = dict.fromkeys(FAILURES, 0)
        self._token_text = token  # kept out of every incident record (capture.redact)
        self.refusals = dict.fromkeys(REFUSALS, 0)
        self.outcomes: dict[tuple[str, str], int] = {(t.name, o): 0 for t in config.targets if t.kind != "proxy" for o in OUTCOMES}
        self.recovery_seconds: dict[str, float] = {}
        self.draining: dict[str, int] = {}  # backend -> the action restarting it: /-/ready is 503
        self.drains: dict[tuple[str, str], int] = {}
        self.unread_alerts = 0
        self.actions: deque[Action] = deque(maxlen=config.history)
        self.refused: deque[dict[str, Any]] = deque(maxlen=config.history)
        self.tasks: set[asyncio.Task[None]] = set()
        self._janitor: asyncio.Task[None] | None = None
        self._next_id = 1
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(RestarterCollector(self))

    # --- verification: the alert's evidence, or the same code as `llm-health check` ------------
    async def _check(self, target: Target) -> dict[str, Any]:
        async with aiohttp.ClientSession() as session:
            return await self.full_check(client_for(session, target, self.config), target)

    async def full_check(
        self, client: BackendClient, target: Target, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, clock: Callable[[], float] = time.monotonic
    ) -> dict[str, Any]:
        """`llm-health check`'s rounds with the `verify` settings, on this client (the
        `verify` timeouts); `sleep` and `clock`: the event loop's, or a replay's simulated time."""
        v = self.config.verify
        result = await check_with(client, kind=target.kind, sleep=sleep, clock=clock, **v.rounds_settings())
        return {"method": "full_check", **result}

    async def _confirm(self, target: Target, evidence_text: str, action: Action | None = None) -> dict[str, Any] | None:
        """The quick confirmation against the alert's evidence; None when it cannot tell.
        The reads are kept on the action for its incident record."""
        try:
            evidence = parse_evidence(evidence_text)
        except BadEvidence as exc:
            log.warning("%s: %s; running the full check", target.name, exc)
            return None
        kept = Kept(self.config.incidents.max_payload_bytes)
        async with aiohttp.ClientSession() as session:
            result = await confirm(client_for(session, target, self.config), evidence, self.config.confirm_interval, kept)
        if action is not None:
            action.reads = kept.reads
        if result["state"] is None:
            log.info("%s: evidence gave no answer (%s); running the full check", target.name, result["reason"])
            return None
        return result

    async def _verify(self, action: Action, target: Target, alert: Alert) -> dict[str, Any]:
        evidence = alert.annotations.get("evidence") if alert.alertname == "LLMBackendHung" else None
        if evidence is not None:
            action.evidence = "alert"
        elif alert.alertname == "VLLMEngineHung" and self.config.raw_alert_hold > 0:
            # The raw layer's alert carries no evidence; the exporter's, for the same hang,
            # follows within seconds. Wait for it rather than watch the engine all over again.
            action.phase = "holding"
            evidence = await self.state.wait_evidence(target.name, self.config.raw_alert_hold)
            if evidence is not None:
                action.evidence = "handed over by LLMBackendHung"
        action.phase = "verifying"
        action.evidence_annotation = evidence
        result = await self._confirm(target, evidence, action) if evidence is not None else None
        if result is None:
            result = await self.verifier(target)
        return result

    # --- the background action ----------------------------------------------------------
    def _refuse(self, reason: str, detail: str = "", **about: Any) -> None:
        self.refusals[reason] += 1
        if reason not in ("unauthorised", "malformed"):
            self.refused.appendleft({"reason": reason, "detail": detail, "at": time.time(), **about})

    async def _act(self, action: Action, target: Target, alert: Alert) -> None:
        restarted = False
        about = {"backend": target.name, "action": action.id, "alertname": action.alertname}
        try:
            try:
                result = await self._verify(action, target, alert)
            except Exception as exc:
                log.exception("%s: re-verification failed", target.name)
                result = {"state": State.UNKNOWN, "reason": f"re-verification failed: {type(exc).__name__}: {exc}"}
            action.verified_at = time.time()
            keep = (
                "method",
                "state",
                "reason",
                "running",
                "waiting",
                "rounds",
                "reads",
                "digests",
                "probes_sent",
                "steps_per_second",
                "generation_tokens_per_second",
                "seconds",
            )
            action.verification = {k: result[k] for k in keep if k in result}
            if result.get("state") != State.HUNG:
                action.refusal = "not_hung"
                action.detail = f"re-verified {result.get('state')}: {result.get('reason')}"
                self._refuse("not_hung", action.detail, **about)
                log.info("%s: %s not acted on: %s", target.name, action.alertname, action.detail)
                return
            refusal, wait = await self.state.claim(target.name)
            if refusal:
                action.refusal = refusal
                if refusal == "budget_spent":
                    view = await self.state.budget(target.name)
                    action.detail = (
                        f"hung, but {view.restarts_in_window} restarts in the last {self.config.budget.window:g}s spent the budget "
                        f"({self.config.budget.max_restarts}); not restarting (llm_restarter_budget_exhausted 1), room again in {wait:.0f}s"
                    )
                    log.warning("%s: %s", target.name, action.detail)
                elif refusal == "cooldown":
                    action.detail = f"hung, but in cooldown after the last restart: {wait:.0f}s left"
                    log.info("%s: %s", target.name, action.detail)
                else:
                    action.detail = "hung, but the shared state (Redis) cannot be read or written, or this replica lost the backend's lease"
                    log.warning("%s: %s", target.name, action.detail)
                self._refuse(refusal, action.detail, **about)
                return
            restarted = True
            action.command = list(target.restart)
            if self.dry_run:
                action.outcome = "dry_run"
                drain = f"drain with {list(target.drain_command)} (timeout {target.drain_timeout:g}s), " if target.drain_command else ""
                action.detail = (
                    f"dry run: would {drain}run {list(target.restart)} (no shell, timeout {target.restart_timeout:g}s), "
                    f"then wait up to {self.config.recovery_timeout:g}s for the backend to come back"
                )
                log.info("%s: %s", target.name, action.detail)
                return
            if not await self.state.still_ours(target.name):
                restarted = False
                action.refusal = "state_unavailable"
                action.detail = "hung, but this replica lost the backend's lease before the restart: another one may act"
                self._refuse("state_unavailable", action.detail, **about)
                return
            env = {**self.child_env, "LLM_HEALTH_BACKEND": target.name, "LLM_HEALTH_BACKEND_URL": target.url}
            self.draining[target.name] = action.id  # from here until done: /-/ready says 503
            await restart_and_recover(action, target, self.config, env, self.outputs, capture=lambda v: self._capture(action, target, v))
            if action.recovery_seconds is not None:
                self.recovery_seconds[target.name] = action.recovery_seconds
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
                self._refuse("not_hung", action.detail, **about)
        finally:
            if action.drain_result is not None:
                key = (target.name, action.drain_result["outcome"])
                self.drains[key] = self.drains.get(key, 0) + 1
            if action.outcome:
                self.outcomes[(target.name, action.outcome)] = self.outcomes.get((target.name, action.outcome), 0) + 1
            action.finished_at = time.time()
            try:
                await asyncio.shield(self.state.finish(target.name, alert.key, restarted))
            finally:
                # Done once the shared state knows it: /status never says done while a
                # repeat of this alert could still be judged new. Ready again at that moment.
                action.phase = "done"
                if self.draining.get(target.name) == action.id:
                    del self.draining[target.name]

    async def _capture(self, action: Action, target: Target, baseline: Any) -> None:
        """The incident record (restarter.incidents.keep_evidence: within the capture budget, never raises), counted."""
        index = await keep_evidence(self.incidents, action, target, baseline, (self._token_text,), self.config.verify.hung_after_seconds)
        if index is not None:
            self.incident_counts[target.name] = self.incident_counts.get(target.name, 0) + 1
            for f in index["capture"]["failures"]:
                self.capture_failures[f["reason"]] += 1

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
        body = await request.read()
        try:
            if len(body) > PARSE_IN_THREAD_OVER:
                webhook = await asyncio.to_thread(parse_webhook, body, ACTED_ON)
            else:
                webhook = parse_webhook(body, ACTED_ON)
        except Malformed as exc:
            self._refuse("malformed")
            log.warning("refused a webhook body: %s", exc)
            return web.json_response({"error": f"malformed webhook: {exc}"}, status=400)
        if webhook.truncated_alerts:
            log.warning("Alertmanager truncated %d alerts from this notification (max_alerts)", webhook.truncated_alerts)
        if webhook.unread:
            self.unread_alerts += webhook.unread
            level, w = logging.ERROR if webhook.unread_watched else logging.WARNING, webhook
            log.log(
                level,
                "a notification of %d alerts (over %d): read its %d LLMBackendHung/VLLMEngineHung, left %d unread",
                w.total,
                MAX_ALERTS,
                len(w.alerts),
                w.unread,
            )
            if w.unread_watched:
                log.error(
                    "%d LLMBackendHung/VLLMEngineHung past the first %d of one notification left unread: set max_alerts at most 1000",
                    w.unread_watched,
                    MAX_ALERTS,
                )
        answers = []
        accepted = 0
        for alert in webhook.alerts:
            adm = await self.state.admit(alert)
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
                target = next(t for t in self.config.targets if t.name == adm.backend)
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
                task = asyncio.create_task(self._act(action, target, alert), name=f"restarter-{target.name}-{action.id}")
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif adm.decision == "ignored":
                log.info("ignored %s: %s", alert.alertname, adm.detail)
            else:
                if adm.decision == "duplicate" and adm.backend is not None and "evidence" in alert.annotations and alert.alertname == "LLMBackendHung":
                    # An action for this backend may be holding a VLLMEngineHung for exactly this.
                    await self.state.offer_evidence(adm.backend, alert.annotations["evidence"], self.config.raw_alert_hold)
                    answer["detail"] = f"{adm.detail}; its evidence was handed to that action"
                self._refuse(adm.decision, adm.detail, backend=adm.backend, alertname=alert.alertname, fingerprint=alert.fingerprint, startsAt=alert.starts_at)
                log.info("%s (fingerprint %s) refused: %s: %s", alert.alertname, alert.fingerprint, adm.decision, adm.detail)
            answers.append(answer)
        # 2xx is success to Alertmanager; 202 says the work goes on in the background.
        out: dict[str, Any] = {"accepted": accepted, "alerts": answers, "dry_run": self.dry_run}
        if webhook.unread:
            out.update(unread=webhook.unread, unread_watched=webhook.unread_watched)
        return web.json_response(out, status=202 if accepted else 200)

    async def status(self) -> dict[str, Any]:
        return await status_of(self)

    async def handle_status(self, request: web.Request) -> web.Response:
        if not self.authorised(request):
            return self._unauthorised(request)
        return web.json_response(await self.status(), dumps=lambda o: json.dumps(o, default=str))

    async def handle_ready(self, request: web.Request) -> web.Response:
        """`?backend=NAME`: 503 from the moment this restarter decided to restart that
        backend (re-verified hung, budget claimed) until the action is done (recovered or
        not), 200 otherwise; from memory, nothing sent to the backend. 404 for a backend
        not in the configuration, 400 without `backend`. Open like /-/healthy: it tells
        only whether this replica is restarting the backend."""
        name = request.query.get("backend")
        if name is None:
            return web.Response(status=400, text="give the backend: /-/ready?backend=NAME (a name in this restarter's configuration)\n")
        if not any(t.name == name for t in self.config.targets):
            return web.Response(status=404, text=f"no backend {name[:100]!r} in this restarter's configuration\n")
        action_id = self.draining.get(name)
        if action_id is not None:
            phase = next((a.phase for a in self.actions if a.id == action_id), "restarting")
            return web.Response(status=503, text=f"{name}: not ready: action {action_id} is restarting it ({phase})\n")
        return web.Response(text=f"{name}: ready: no restart under way\n")

    async def handle_index(self, request: web.Request) -> web.Response:
        return web.Response(
            text="llm-health restarter: POST /alerts (Alertmanager webhook v4, bearer token), GET /status and /incidents (bearer token), /metrics, "
            "/-/healthy, /-/ready?backend=NAME\n"
        )

    async def start(self) -> None:
        await self.state.start()
        self._janitor = asyncio.create_task(self._keep_outputs_bounded(), name="restarter-output-janitor")

    async def _keep_outputs_bounded(self) -> None:
        while True:
            await asyncio.sleep(JANITOR_INTERVAL)
            self.outputs.enforce()

    async def stop(self) -> None:
        tasks = list(self.tasks)
        if self._janitor is not None:
            tasks.append(self._janitor)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.state.close()

    async def reload(self) -> str:
        """Re-read the configuration file. Budgets, cooldowns and remembered alerts of
        backends that stay are kept; actions under way finish with the settings they began with."""
        if self.config_file is None:
            return "no configuration file to reload"
        new = load_config(self.config_file)
        if new.redis != self.config.redis:
            raise ConfigError(str(self.config_file), "redis", "changed: the shared state moves only with a restart of the restarter")
        self.state.update(new.targets, new.budget)
        for t in new.targets:
            if t.kind != "proxy":
                for o in OUTCOMES:
                    self.outcomes.setdefault((t.name, o), 0)
        if new.incidents != self.config.incidents:
            self.incidents = IncidentStore(new.incidents)  # new records there; GET /incidents lists that directory
        self.config = new
        return f"{len(new.targets)} backends"

    def app(self, web_config: WebConfig | None = None) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        # /alerts and /status check the bearer token themselves (and accept basic auth users).
        secure(app, web_config or WebConfig(), protected=lambda r: r.path not in OPEN_PATHS and not (_self_checked(r.path) and _bearer(r)))
        app.router.add_get("/", self.handle_index)
        app.router.add_post("/alerts", self.handle_alerts)
        app.router.add_get("/status", self.handle_status)
        add_routes(app, lambda: self.incidents, self.authorised, self._unauthorised)
        app.router.add_get("/metrics", metrics_handler(self.registry))
        app.router.add_get("/-/healthy", healthy)
        app.router.add_get("/-/ready", self.handle_ready)
        add_reload(app, self.reload)

        async def on_startup(_app: web.Application) -> None:
            await self.start()

        async def on_cleanup(_app: web.Application) -> None:
            await self.stop()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app


def _self_checked(path: str) -> bool:
    """The paths whose handlers check the bearer token themselves."""
    return path in ("/alerts", "/status", "/incidents") or path.startswith("/incidents/")


def _bearer(request: web.Request) -> bool:
    return request.headers.get("Authorization", "").lower().startswith("bearer ")
