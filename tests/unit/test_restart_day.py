"""A day with a batch job and one real hang, replayed in simulated time (`sim.replay`),
with every restart request of every watchdog sent to the restarter itself: a
`restarter.app.Restarter` whose webhook handler admits each alert, whose background
action verifies it with `llm-health check`'s own rounds (`Restarter.full_check`, the
`verify` settings) and claims the budget from its own state (`MemoryState`,
`core.restart_policy`). The naive watchdogs still ask; nothing busy is restarted.

What is simulated: the server (`sim.replay`'s, read through `SimClient` instead of a
socket), the clock and the sleeps of the restarter's coroutines (`SimTime`), and the one
part that needs a process, the restart command and the wait for the backend to come back
(`restarter.action.restart_and_recover`, tested with real processes in
tests/integration/test_restarter.py): here the restart is applied to the simulated server
and the action ends when the monitor reads the backend idle or busy again."""

from __future__ import annotations

import asyncio
import heapq
import json
from collections import Counter
from unittest import mock

from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from llm_health.config.restarter import RestarterConfig, Target, Verify
from llm_health.core.health import Settings
from llm_health.core.restart_policy import OUTCOMES, Budget
from llm_health.core.states import State
from llm_health.probe.client import Fetched, ProbeResult
from llm_health.probe.monitor import BackendMonitor
from llm_health.restarter import app as restarter_app
from llm_health.restarter.app import Restarter
from llm_health.sim import replay as rp
from llm_health.sim.replay import DayPlan, replay

TOKEN = "day-token-0b7e55c1"
URL = "http://day.invalid:8000"


class SimTime:
    """The replay's clock for the restarter's coroutines: `sleep` parks the calling task
    until `advance` passes its deadline; `settle` lets every task run until it is done or
    parked again (one waiting on anything else fails the test, not hangs it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._due: list[tuple[float, int, asyncio.Future, asyncio.Task]] = []
        self._parked: set[asyncio.Task] = set()
        self._seq = 0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        task = asyncio.current_task()
        assert task is not None
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._due, (self.now + seconds, self._seq, fut, task))
        self._seq += 1
        self._parked.add(task)
        await fut

    async def advance(self, t: float, tasks: set[asyncio.Task]) -> None:
        self.now = t
        while self._due and self._due[0][0] <= t:
            _, _, fut, task = heapq.heappop(self._due)
            self._parked.discard(task)
            fut.set_result(None)
        await self.settle(tasks)

    async def settle(self, tasks: set[asyncio.Task]) -> None:
        for _ in range(10_000):
            if all(task.done() or task in self._parked for task in list(tasks)):
                return
            await asyncio.sleep(0)
        raise AssertionError("a restarter task waits on something outside simulated time")


class SimClient:
    """The day's server as `probe.client.BackendClient` answers for it, at the replay's
    time: refused while it restarts; a probe answers unless the engine is hung. Counts the
    probes, and those sent to a server with work in flight."""

    url = URL

    def __init__(self, server: rp._Server, time: SimTime):
        self.server, self.time = server, time
        self.probes = {"sent": 0, "to_busy": 0}

    def _up(self) -> bool:
        return self.time.now >= self.server.up_at

    async def metrics(self) -> Fetched:
        if not self._up():
            return Fetched(error="connection refused", refused=True)
        text = self.server.sim.payload()
        return Fetched(parts=(text,), size=len(text))

    async def models(self) -> tuple[bool, str | None, str | None]:
        return (True, self.server.sim.model, None) if self._up() else (False, None, "connection refused")

    health = models

    async def flag(self, path: str) -> bool:
        return False  # never asleep, never paused

    async def probe(self, model: str | None) -> ProbeResult:
        self.probes["sent"] += 1
        self.probes["to_busy"] += self.server.busy
        ok = self._up() and not self.server.hung
        return ProbeResult(ok, 0.5, "answered" if ok else "timed out", timed_out=not ok)


async def deliver(restarter: Restarter, labels: dict[str, str], starts_at: str) -> dict:
    """One webhook notification (Alertmanager v4) to the restarter's own handler."""
    body = {"version": "4", "status": "firing", "receiver": "restarter", "alerts": [{"status": "firing", "labels": labels, "startsAt": starts_at}]}
    payload = StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(json.dumps(body).encode())
    payload.feed_eof()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    resp = await restarter.handle_alerts(make_mocked_request("POST", "/alerts", headers=headers, payload=payload))
    assert resp.status in (200, 202), resp.text
    return json.loads(resp.text or "{}")


async def replay_through_restarter(plan: DayPlan, monkeypatch, output_dir: str, with_cascade: bool = True, tick: float = 1.0) -> dict:
    """The day in simulated time. The naive watchdog, the 500-counting one and the
    exporter's LLMBackendHung alert (for: 1m, each notification delivered twice, repeated
    every 5 minutes) no longer restart anything: each sends its restart request to the
    restarter, which re-verifies (its full check: no evidence in these alerts) and
    restarts only a server still `hung`, within the budget."""
    clock = SimTime()
    server = rp._Server(plan)
    client = SimClient(server, clock)
    target = Target("day", URL, "day.invalid:8000", restart=("systemctl", "restart", "vllm@day"))
    verify = Verify(interval=plan.check_interval, hung_after_seconds=plan.hung_after_seconds)
    config = RestarterConfig(targets=(target,), budget=Budget(), verify=verify, output_dir=output_dir)

    restarts: list[tuple[float, str, bool]] = []
    failed_by_restarts = [0]

    async def restart_and_recover(action, target, config, env, outputs, capture=None) -> None:  # the replay captures nothing
        """The process's part: the restart applied to the simulated server, then the
        backend read every recovery_interval until it is idle or busy."""
        action.phase = "restarting"
        restarts.append((clock.now, action.labels["source"], server.hung))
        failed_by_restarts[0] += server.restart(clock.now)
        action.phase = "recovering"
        started = clock.now
        monitor = BackendMonitor(client, kind=target.kind, settings=Settings(hung_after_seconds=config.verify.hung_after_seconds, probe_interval=0.0))
        while (await monitor.round(clock.now)).state not in (State.IDLE, State.BUSY):
            await clock.sleep(config.recovery_interval)
        action.recovery_seconds = clock.now - started
        action.outcome = "recovered"

    async def verifier(target: Target) -> dict:
        return await restarter.full_check(client, target, sleep=clock.sleep, clock=clock.clock)

    monkeypatch.setattr(restarter_app, "restart_and_recover", restart_and_recover)
    restarter = Restarter(config, TOKEN, clock=clock.clock, verifier=verifier)
    answers: Counter = Counter()
    requests: Counter = Counter()

    async def request(by: str, starts_at: str, source: str) -> None:
        requests[by] += 1
        labels = {"alertname": "LLMBackendHung", "backend": "day", "source": source}
        for answer in (await deliver(restarter, labels, starts_at))["alerts"]:
            answers[answer["decision"]] += 1

    # The exporter's continuous rounds: the same monitor, every check_interval, probing an idle engine at most every probe_interval.
    exporter = BackendMonitor(client, settings=Settings(hung_after_seconds=plan.hung_after_seconds, probe_interval=plan.probe_interval))
    naive_failures, naive_pending = 0, None
    exporter_next, hung_since, next_delivery = 0.0, None, 0.0
    cascade_restarts = 0
    t = 0.0
    while t < rp.DAY:
        server.step(t, tick)
        await clock.advance(t, restarter.tasks)  # the restarter's actions due now
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
                await request("naive watchdog", f"naive-{t:.0f}", "naive")

        # The 500-counting watchdog: restart requests after enough failed requests.
        if with_cascade and t % plan.cascade_period < tick and t > 0:
            if failed_by_restarts[0] >= max(1, plan.cascade_threshold - cascade_restarts):
                cascade_restarts += 1
                await request("500-counting watchdog", f"cascade-{t:.0f}", "cascade")
            failed_by_restarts[0] = 0

        # The exporter's rounds and LLMBackendHung (for: 1m), delivered at least once.
        if t >= exporter_next:
            v = await exporter.round(t)
            exporter_next = t + plan.check_interval
            hung_since = (hung_since if hung_since is not None else t) if v.state == State.HUNG else None
        if hung_since is not None and t - hung_since >= 60 and t >= next_delivery:
            for _ in range(2):  # a duplicate, as during a partition
                await request("LLMBackendHung", f"exporter-{hung_since:.0f}", "exporter")
            next_delivery = t + 300  # repeat_interval of the restarter route
        if hung_since is None:
            next_delivery = 0.0

        await clock.settle(restarter.tasks)  # the actions just accepted: their first read
        t += tick
    await restarter.stop()

    return {
        "false_restarts": sum(1 for _, _, hung in restarts if not hung),
        "true_restarts": sum(1 for _, _, hung in restarts if hung),
        "restarts": restarts,
        "answers": answers,  # what the webhook handler answered, per alert
        "refusals": dict(restarter.refusals),  # the restarter's own counts (llm_restarter_refusals_total)
        "outcomes": dict(restarter.outcomes),
        "actions": [a.status() for a in restarter.actions],
        "requests": requests,
        "probes": client.probes,
    }


async def test_day_through_the_restarter_has_no_false_restart(monkeypatch, tmp_path):
    plan = DayPlan()
    naive_alone = replay(plan, ("naive", "cascade"))
    assert naive_alone.false_restarts == 11  # what the same watchdogs did on their own (docs/restarts.md)

    out = await replay_through_restarter(plan, monkeypatch, str(tmp_path))
    assert (out["false_restarts"], out["true_restarts"]) == (0, 1), out["restarts"]
    ((at, source, _),) = out["restarts"]
    assert (at - plan.hang_at, source) == (100, "exporter"), out["restarts"]  # docs/restarts.md: 100 s, the exporter's alert
    assert out["requests"]["naive watchdog"] >= 3  # the naive watchdog still asked, every time...
    assert out["refusals"]["not_hung"] >= 3  # ...and the restarter's re-verification found the server busy
    assert out["answers"]["duplicate"] == out["refusals"]["duplicate"] >= 1  # the second copy of each notification did nothing
    assert out["answers"]["accepted"] == len(out["actions"]) == out["refusals"]["not_hung"] + 1  # every other request was verified
    assert out["outcomes"] == {("day", o): int(o == "recovered") for o in OUTCOMES}  # one restart, and it recovered
    assert out["probes"]["to_busy"] == 0  # no request ever went to a server with work in flight
    (when, by, hung) = out["restarts"][0]
    assert hung and by == "exporter" and plan.hang_at < when <= plan.hang_at + 3 * 60
