"""A day with a batch job and one real hang, replayed in simulated time (`sim.replay`),
with every restart request of every watchdog going through the restarter's decision core
and its re-verification: the naive watchdogs still ask, nothing busy is restarted."""

from __future__ import annotations

import math
from collections import Counter

from llm_health.config.restarter import Target, Verify
from llm_health.core import engines
from llm_health.core.health import Observation, Settings, after_probe, decide
from llm_health.core.restart_policy import Budget, Policy
from llm_health.core.states import FINAL
from llm_health.core.webhook import Alert, fingerprint
from llm_health.sim import replay as rp
from llm_health.sim.replay import DayPlan, replay


def replay_through_restarter(plan, with_cascade: bool = True, tick: float = 1.0) -> dict:
    """The day in simulated time. The naive watchdog, the 500-counting one and the
    exporter's LLMBackendHung alert (for: 1m, each notification delivered twice, repeated
    every 5 minutes) no longer restart anything: each sends its restart request to the
    restarter's decision core (`Policy`), which re-verifies against the server with the
    same rounds as `llm-health check` (health.decide on the server's payloads, simulated
    time) and restarts only a server still `hung`, within the budget."""
    day = rp.DAY
    server = rp._Server(plan)
    target = Target("day", "http://day.invalid:8000", "day.invalid:8000", restart=("systemctl", "restart", "vllm@day"))
    verify = Verify(interval=plan.check_interval, hung_after_seconds=plan.hung_after_seconds)
    policy = Policy([target], Budget())
    rounds = max(3, math.ceil(verify.hung_after_seconds / verify.interval) + 1)
    check_settings = Settings(hung_after_seconds=verify.hung_after_seconds, probe_interval=0.0)
    exporter_settings = Settings(hung_after_seconds=plan.hung_after_seconds, probe_interval=plan.probe_interval)

    restarts: list[tuple[float, str, bool]] = []
    decisions: Counter = Counter()
    requests: Counter = Counter()
    probes = {"sent": 0, "to_busy": 0}
    verifying: list[dict] = []
    recovering: list[dict] = []
    cascade_seen = cascade_restarts = 0

    def request(t: float, by: str, starts_at: str, fp_labels: dict) -> None:
        requests[by] += 1
        labels = {"alertname": "LLMBackendHung", "backend": "day", **fp_labels}
        alert = Alert("LLMBackendHung", "firing", labels, starts_at, fingerprint(labels))
        adm = policy.admit(alert, t)
        decisions[adm.decision] += 1
        if adm.decision == "accepted":
            verifying.append({"key": alert.key, "by": by, "memory": None, "reads": 0, "next": t})

    def read(memory, t, settings):
        up = t >= server.up_at
        if not up:
            obs = Observation(now=t, metrics_error="connection refused", metrics_refused=True, models_ok=False, models_error="connection refused")
        else:
            obs = Observation(now=t, reading=engines.read(server.sim.payload()))
        v = decide(memory, obs, settings)
        if v.probe_wanted:  # only ever wanted for an idle engine
            probes["sent"] += 1
            probes["to_busy"] += server.busy
            v = after_probe(v, up and not server.hung, t, settings)
        return v

    naive_failures, naive_pending = 0, None
    exporter_memory, exporter_next, hung_since, next_delivery = None, 0.0, None, 0.0
    t = 0.0
    while t < day:
        server.step(t, tick)
        up = t >= server.up_at

        # The naive watchdog: a real request every 5 minutes, 45 s timeout, 5 failures.
        if naive_pending is None and t % plan.naive_period < tick:
            ok = up and not server.busy and not server.hung
            naive_pending = t + (0.5 if ok else plan.naive_timeout)
            naive_failures = 0 if ok else naive_failures + 1
        if naive_pending is not None and t >= naive_pending:
            naive_pending = None
            if naive_failures >= plan.naive_failures:
                naive_failures = 0
                request(t, "naive watchdog", f"naive-{t:.0f}", {"source": "naive"})

        # The 500-counting watchdog: restart requests after enough failed requests.
        if with_cascade and t % plan.cascade_period < tick and t > 0:
            if cascade_seen >= max(1, plan.cascade_threshold - cascade_restarts):
                cascade_restarts += 1
                request(t, "500-counting watchdog", f"cascade-{t:.0f}", {"source": "cascade"})
            cascade_seen = 0

        # The exporter's continuous rounds and LLMBackendHung (for: 1m), delivered at least once.
        if up and t >= exporter_next:
            v = read(exporter_memory, t, exporter_settings)
            exporter_memory, exporter_next = v.memory, t + plan.check_interval
            hung_since = (hung_since if hung_since is not None else t) if v.state == "hung" else None
        if hung_since is not None and t - hung_since >= 60 and t >= next_delivery:
            for _ in range(2):  # a duplicate, as during a partition
                request(t, "LLMBackendHung", f"exporter-{hung_since:.0f}", {"source": "exporter"})
            next_delivery = t + 300  # repeat_interval of the restarter route
        if hung_since is None:
            next_delivery = 0.0

        # The restarter: re-verification rounds, then the budget, then the restart.
        for job in list(verifying):
            if t < job["next"]:
                continue
            v = read(job["memory"], t, check_settings)
            job.update(memory=v.memory, reads=job["reads"] + 1, next=t + verify.interval)
            if not (v.state in FINAL or job["reads"] >= rounds):  # the rule that ends a `check`
                continue
            verifying.remove(job)
            if v.state != "hung":
                decisions["not_hung"] += 1
                policy.finish("day", job["key"], False, t)
                continue
            refusal, _ = policy.claim("day", t)
            if refusal:
                decisions[refusal] += 1
                policy.finish("day", job["key"], False, t)
                continue
            hung = server.hung
            failed = server.restart(t)
            cascade_seen += failed
            restarts.append((t, job["by"], hung))
            recovering.append(job)
        for job in list(recovering):
            if t >= server.up_at and not server.busy:
                recovering.remove(job)
                policy.finish("day", job["key"], True, t)
        t += tick

    return {
        "false_restarts": sum(1 for _, _, hung in restarts if not hung),
        "true_restarts": sum(1 for _, _, hung in restarts if hung),
        "restarts": restarts,
        "decisions": decisions,
        "requests": requests,
        "probes": probes,
    }


def test_day_through_the_restarter_has_no_false_restart():
    plan = DayPlan()
    naive_alone = replay(plan, ("naive", "cascade"))
    assert naive_alone.false_restarts >= 3  # what the same watchdogs did on their own

    out = replay_through_restarter(plan)
    assert (out["false_restarts"], out["true_restarts"]) == (0, 1), out["restarts"]
    assert out["requests"]["naive watchdog"] >= 3  # the naive watchdog still asked, every time...
    assert out["decisions"]["not_hung"] >= 3  # ...and the re-verification found the server busy
    assert out["decisions"]["duplicate"] >= 1  # the second copy of each notification did nothing
    assert out["probes"]["to_busy"] == 0  # no request ever went to a server with work in flight
    (when, _, hung) = out["restarts"][0]
    assert hung and plan.hang_at < when <= plan.hang_at + 3 * 60
