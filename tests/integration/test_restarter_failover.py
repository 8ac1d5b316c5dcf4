"""The restart authority's shared state through Redis failovers: two restarter replicas
(apps on loopback) sharing one real Sentinel or Cluster topology of their own, a
simulated backend that hangs, restart commands that are real processes (a marker file).

- the done key of an alert acted on survives a forced failover: the same alert
  (fingerprint, startsAt) delivered again after it is a duplicate on both replicas;
- the budget survives a forced failover and a SIGKILL of the primary holding the
  backend's keys: a new hang of the same backend is refused for budget;
- a budget claim no replica acknowledged (WAIT) never leads to a restart, and does not
  spend the budget either.

Faults are aimed at the primary that holds the backend's keys: on Cluster the one owning
the slot of the backend's hash tag (the key names of restarter/shared_state.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from pathlib import Path

import pytest

from llm_health.config.restarter import SharedState
from llm_health.core.restart_policy import Budget
from llm_health.sim import servers as sim
from tests.fixtures.redis_topology import ClusterTopology, SentinelTopology, poll
from tests.fixtures.restarter import RestartEffect, make_config, marker_target, post_json, status, wait_done
from tests.fixtures.summary import show
from tests.integration.test_restarter_evidence import evidence_of, hung_alert

BACKEND = "gpu0"


@pytest.fixture(params=("sentinel", "cluster"))
def topo(request: pytest.FixtureRequest) -> SentinelTopology | ClusterTopology:
    """A topology of this test's own (it kills, pauses and fails over)."""
    return request.getfixturevalue(f"own_redis_{request.param}")


class Faults:
    """The faults of a test, aimed at the primary holding one key (and its replicas).
    Blocking (the topology polls): called in a thread, so the restarters keep running."""

    def __init__(self, topo: SentinelTopology | ClusterTopology, key: str):
        self.topo, self.key = topo, key
        self.cluster = isinstance(topo, ClusterTopology)

    @property
    def kind(self) -> str:
        return "cluster" if self.cluster else "sentinel"

    def primary(self) -> int:
        if isinstance(self.topo, ClusterTopology):
            return self.topo.primary_for_slot(self.topo.keyslot(self.key))
        return self.topo.primary_port()

    def replicas(self) -> list[int]:
        primary = self.primary()
        if isinstance(self.topo, ClusterTopology):
            pid = self.topo.node_id(primary)
            return [n["port"] for n in self.topo.nodes() if n["primary_id"] == pid and n["port"] in self.topo.running()]
        return self.topo.replica_ports()

    def failover(self) -> int:
        """A commanded failover (Cluster: FORCE, no handshake with the primary); the new primary."""
        if isinstance(self.topo, ClusterTopology):
            (replica,) = self.replicas()
            self.topo.failover(replica, force=True)
            return replica
        return self.topo.failover()

    def kill_primary(self) -> int:
        """SIGKILL the primary, until a replica took its place; then the killed one back (a
        replica now: WAIT has a replica to count again). The port killed."""
        old = self.primary()
        if isinstance(self.topo, ClusterTopology):
            (replica,) = self.replicas()
            self.topo.kill(old)
            self.topo.wait_primary(replica)
        else:
            self.topo.kill(old)
            self.topo.wait_new_primary(old)
        self.topo.restart(old)
        return old

    def pause_replicas(self) -> list[int]:
        """SIGSTOP every replica of the primary, until each is stopped (state T)."""
        ports = self.replicas()
        for p in ports:
            self.topo.pause(p)
        for p in ports:
            proc = self.topo.procs[p].proc
            assert proc is not None
            poll(lambda pid=proc.pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", 10, f"{p} stopped")
        return ports

    def resume(self, ports: list[int]) -> None:
        for p in ports:
            if p in self.topo.paused:
                self.topo.resume(p)
        self.topo.wait_ready()


def shared(url: str) -> SharedState:
    return SharedState(url=url, lease_ttl=5.0, timeout=2.0)


async def deliver(client, body: dict, seen: collections.Counter, timeout: float = 90.0) -> dict:
    """The alert of `body` delivered as Alertmanager does: again while the answer is
    state_unavailable (Redis failing over: it repeats the notification). The first other answer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        (answer,) = (await post_json(client, body))["alerts"]
        seen[answer["decision"]] += 1
        if answer["decision"] != "state_unavailable":
            return answer
        if loop.time() > deadline:
            raise AssertionError(f"still state_unavailable after {timeout:.0f} s: {answer}")
        await asyncio.sleep(0.2)


async def deliver_to_both(clients, body: dict, seen: collections.Counter) -> list[dict]:
    return list(await asyncio.gather(*(deliver(c, body, seen) for c in clients)))


async def idle(*restarters) -> None:
    """Until no replica holds the backend: the action's end (done key, restart end) is written."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while any(r.state.held for r in restarters) or any(r.tasks for r in restarters):
        assert loop.time() < deadline, "an action did not finish"
        await asyncio.sleep(0.05)


async def restarts_seen(client) -> int:
    """restarts_in_window on /status, asked again while the budget reads as unknown."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        entry = (await status(client))["backends"][0]
        if "restarts_in_window" in entry or loop.time() > deadline:
            return entry["restarts_in_window"]
        await asyncio.sleep(0.2)


async def acted(clients, answers: list[dict]) -> dict:
    """The one action started by `answers` (one per client), once done."""
    (action,) = await all_acted(clients, answers)
    return action


async def all_acted(clients, answers: list[dict]) -> list[dict]:
    """The actions started by `answers` (one per client), once done. One, unless it was
    refused and left no done key before the other delivery came (a retried one)."""
    started = [(c, x["action"]) for c, x in zip(clients, answers, strict=True) if x["decision"] == "accepted"]
    assert started, answers
    return [await wait_done(c, action, timeout=60) for c, action in started]


ONE_RESTART = Budget(max_restarts=1, window=3600, cooldown=60)  # a second restart is refused for budget


async def hung_pair(sim_server, ticker, restarter_client, tmp_path, topo, **config_kw):
    """A hung simulated server, the marker file its restart command writes, and two
    restarter replicas sharing `topo`: (server, marker, (restarters), (clients))."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    config = make_config(marker_target(BACKEND, s, marker), redis=shared(topo.url), confirm_interval=0.3, **config_kw)
    (ra, a), (rb, b) = await restarter_client(config), await restarter_client(config)
    return s, marker, (ra, rb), (a, b)


async def test_same_alert_after_a_failover_is_a_duplicate(sim_server, ticker, restarter_client, tmp_path, topo):
    s, marker, restarters, clients = await hung_pair(sim_server, ticker, restarter_client, tmp_path, topo)
    faults = Faults(topo, restarters[0].state._done_key(BACKEND, ("fp", "startsAt")))
    body = hung_alert(BACKEND, evidence_of(s))
    before, after = collections.Counter(), collections.Counter()
    effect = RestartEffect(marker, s)
    try:
        first = await deliver_to_both(clients, body, before)
        assert sorted(x["decision"] for x in first) == ["accepted", "duplicate"], first
        assert (await acted(clients, first))["outcome"] == "recovered"
        await idle(*restarters)
        assert effect.lines() == 1

        promoted = await asyncio.to_thread(faults.failover)
        sim.hang(s)  # hung again: a delivery taken for a new one would restart it
        again = await deliver_to_both(clients, body, after)
        again += await deliver_to_both(clients, body, after)
        assert all(x["decision"] == "duplicate" and "already acted on" in x["detail"] for x in again), again
        await idle(*restarters)
        assert effect.lines() == 1
        assert [await restarts_seen(c) for c in clients] == [1, 1]
    finally:
        await effect.stop()
    show(
        f"failover ({faults.kind}, new primary {promoted}): one alert delivered {sum(before.values())} times before a forced failover "
        f"and {sum(after.values())} times after it ({after['state_unavailable']} refused as state_unavailable while it settled), "
        f"restarts: {effect.lines()}"
    )


async def test_budget_survives_a_failover_and_a_killed_primary(sim_server, ticker, restarter_client, tmp_path, topo):
    s, marker, restarters, clients = await hung_pair(sim_server, ticker, restarter_client, tmp_path, topo, budget=ONE_RESTART)
    faults = Faults(topo, restarters[0].state._k("restarts", BACKEND))
    seen = collections.Counter()
    effect = RestartEffect(marker, s)
    try:
        first = await deliver_to_both(clients, hung_alert(BACKEND, evidence_of(s)), seen)
        assert (await acted(clients, first))["outcome"] == "recovered"
        await idle(*restarters)
        assert effect.lines() == 1

        promoted = await asyncio.to_thread(faults.failover)
        killed = await asyncio.to_thread(faults.kill_primary)
        assert [await restarts_seen(c) for c in clients] == [1, 1]

        sim.hang(s)  # the fresh server hangs again: a new alert
        body = hung_alert(BACKEND, evidence_of(s), starts_at="2026-11-30T12:00:00Z")
        second = await deliver_to_both(clients, body, seen)
        for action in await all_acted(clients, second):
            assert action["refusal"] == "budget_spent" and action["verification"]["state"] == "hung", action
        await idle(*restarters)
        assert effect.lines() == 1
    finally:
        await effect.stop()
    show(
        f"budget ({faults.kind}): 1 restart, a forced failover (to {promoted}), primary {killed} killed -9 and replaced, "
        f"then a new hang refused for budget; deliveries {dict(seen)}, restarts: {effect.lines()}"
    )


async def test_unreplicated_budget_claim_is_refused_and_not_spent(sim_server, ticker, restarter_client, tmp_path, topo, caplog):
    s, marker, restarters, clients = await hung_pair(sim_server, ticker, restarter_client, tmp_path, topo, budget=ONE_RESTART)
    faults = Faults(topo, restarters[0].state._k("restarts", BACKEND))
    body = hung_alert(BACKEND, evidence_of(s))
    seen = collections.Counter()

    # Every budget claim waits for the test to let it go (the replicas are paused by then).
    go = asyncio.Event()
    claiming = asyncio.Event()
    for r in restarters:
        claim = r.state.claim

        async def held_claim(backend: str, claim=claim) -> tuple[str | None, float]:
            claiming.set()
            await go.wait()
            return await claim(backend)

        r.state.claim = held_claim

    effect = RestartEffect(marker, s)
    paused: list[int] = []
    try:
        # 1. Replicas paused before the alert: the backend's lease cannot be claimed (WAIT).
        paused = await asyncio.to_thread(faults.pause_replicas)
        (x,) = (await post_json(clients[0], body))["alerts"]
        assert x["decision"] == "state_unavailable", x
        await asyncio.to_thread(faults.resume, paused)

        # 2. Lease claimed with the replicas up; paused before the budget claim: refused.
        answers = await deliver_to_both(clients, body, seen)
        await asyncio.wait_for(claiming.wait(), 60)
        paused = await asyncio.to_thread(faults.pause_replicas)
        with caplog.at_level(logging.WARNING, logger="llm_health.restarter"):
            go.set()
            action = await acted(clients, answers)
        assert action["refusal"] == "state_unavailable" and action["command_result"] is None, action
        assert any("budget claim reached no replica" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        await idle(*restarters)
        await asyncio.to_thread(faults.resume, paused)
        paused = []
        assert effect.lines() == 0

        # 3. The alert again (Alertmanager repeats it), replicas up: the refused claim
        # spent nothing, so the one restart of the budget is still there.
        answers = await deliver_to_both(clients, body, seen)
        action = await acted(clients, answers)
        assert action["outcome"] == "recovered", action
        await idle(*restarters)
        assert effect.lines() == 1
        assert [await restarts_seen(c) for c in clients] == [1, 1]
    finally:
        go.set()
        await effect.stop()
        if paused:
            await asyncio.to_thread(faults.resume, paused)
    show(
        f"unreplicated ({faults.kind}): replicas paused -> lease and budget claims refused (state_unavailable), deliveries {dict(seen)}, restarts: {effect.lines()}"
    )
