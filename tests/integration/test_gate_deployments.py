"""The admission gate on every Redis deployment: real HTTP on loopback, a fake upstream
worker, one server, Sentinel and Cluster (tests/fixtures/redis_any.py), and a topology of
the test's own whose primary is killed (SIGKILL).

- what the gate records is where the exporter reads it: the store's AdmissionQueue and
  the exporter's RedisView on the same URL see the record and the route's stats, and the
  gate sees what the queue wrote (the route's queue age);
- a resent request id is a retry (no retry header);
- a primary that dies turns into each route's `redis_down` policy while it is gone (open:
  admitted unrecorded; closed: 503 reject_redis_down), and the gate comes back by itself
  after the failover (llm_gate_redis_up 1, requests recorded again), never answering 500.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config.gate import parse_gate_config
from llm_health.config.redis import parse_redis_config
from llm_health.exporter.redis_view import RedisView
from llm_health.gate.app import Gate
from llm_health.store.queue import AdmissionQueue, QueueRecord
from tests.fixtures.redis_topology import ClusterTopology, SentinelTopology, info, poll
from tests.fixtures.summary import show
from tests.harness.processes import proc_state
from tests.integration.test_gate import Upstream, deadline_in, serve

ADMISSION = {"reject_if_queue_age_ms_gte": 3000, "reject_if_retry_count_gte": 1, "ignore_worker_util_when_slack_ms_lte": 0}


class Stack:
    def __init__(self, url: str, up: Upstream, gate: Gate, redis_url: str):
        self.url, self.up, self.gate, self.redis_url = url, up, gate, redis_url

    async def post(self, headers: dict[str, str]) -> tuple[int, dict[str, Any], dict[str, str]]:
        async with aiohttp.ClientSession() as s, s.post(self.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, headers=headers) as r:
            return r.status, json.loads(await r.read()), dict(r.headers)

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/metrics") as r:
            text = await r.text()
        return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text) for x in f.samples}

    async def healthy(self) -> bool:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/-/healthy") as r:
            return r.status == 200

    def queue(self) -> AdmissionQueue:
        return AdmissionQueue.from_url(self.redis_url, prefix=self.gate.cfg.queue_prefix)

    async def record(self, queue_id: str, attempts: int = 1, timeout: float = 30.0) -> QueueRecord | None:
        """The id's record once the gate wrote its attempt (just after the response)."""
        q = self.queue()
        try:
            deadline = time.monotonic() + timeout
            while True:
                rec = await q.read(queue_id)
                if (rec is not None and rec.attempts >= attempts and rec.state == "done") or time.monotonic() > deadline:
                    return rec
                await asyncio.sleep(0.02)
        finally:
            await q.aclose()


@pytest.fixture
async def stack():
    """factory(redis url, routes) -> Stack; every server stopped at teardown."""
    runners: list[web.AppRunner] = []

    async def make(redis_url: str, routes: dict[str, dict[str, Any]] | None = None, sample_interval: str = "100ms") -> Stack:
        up = Upstream()
        uapp = web.Application()
        uapp.router.add_post("/v1/completions", up.completions)
        ur, uurl = await serve(uapp, handler_cancellation=True)
        runners.append(ur)
        routes = routes or {"chat": {"default_deadline_ms": 30000}}
        cfg = parse_gate_config(
            {
                "admission": ADMISSION,
                "gate": {"redis": redis_url, "sample_interval": sample_interval, "routes": {n: {"upstream": uurl, **r} for n, r in routes.items()}},
            },
            "test.yml",
        )
        gate = Gate(cfg)
        gr, gurl = await serve(gate.app(), handler_cancellation=True)
        runners.append(gr)
        return Stack(gurl, up, gate, redis_url)

    yield make
    for r in reversed(runners):
        await r.cleanup()


async def test_record_retry_and_route_stats_where_the_exporter_reads_them(stack, any_redis_url: str, redis_kind: str):
    s = await stack(any_redis_url)
    h = {"X-Request-Id": "r1", "X-Tenant": "acme", **deadline_in(30000)}
    status, body, _ = await s.post(h)
    assert status == 200 and body["usage"]["total_tokens"] == 272 and s.up.calls[0][0] == "r1"
    rec = await s.record("acme/r1")
    assert rec is not None and (rec.route, rec.tenant, rec.attempts, rec.retry_count, rec.token_units, rec.http_status) == ("chat", "acme", 1, 0, 272, 200)

    # The same id again, no retry header, time left: a retry, admitted, counted on its record.
    status, _, _ = await s.post(h)
    assert status == 200 and len(s.up.calls) == 2
    rec = await s.record("acme/r1", attempts=2)
    assert rec is not None and (rec.attempts, rec.retry_count, rec.token_units, rec.state) == (2, 1, 544, "done")
    # An id resent after its deadline: a late retry, refused; the gate says what it counted.
    late = {"X-Request-Id": "late", **deadline_in(2000)}
    assert (await s.post(late))[0] == 200
    while time.time() * 1000 <= int(late["X-Request-Deadline-Ms"]) + 10:
        await asyncio.sleep(0.05)
    status, body, _ = await s.post(late)
    assert (status, body["error"]["code"], body["error"]["retry_count"]) == (422, "reject_retry_late", 1)
    assert len(s.up.calls) == 3

    # The store's queue and the exporter's view, on the same URL, read the route.
    q = s.queue()
    try:
        assert await q.routes() == ["chat"]
        stats = await q.route_stats("chat")
        assert (stats.depth, stats.token_duplication_ratio_max) == (0, 2.0), stats
        # ... and the gate reads what the queue wrote: a request waiting 4 s ahead of it.
        now = int(time.time() * 1000)
        await q.enqueue("old", "chat", "t", deadline_ms=now + 60000, enqueued_ms=now - 4000)
    finally:
        await q.aclose()
    view = RedisView(parse_redis_config({"url": any_redis_url}, "t.yaml"))
    try:
        await view.start()
        await view.refresh({})
        assert view.up, view.error
        seen = view.snapshot.routes["chat"]
        assert (seen.depth, seen.token_duplication_ratio_max) == (1, 2.0) and seen.oldest_age_ms >= 4000, seen
    finally:
        await view.stop()
    status, body, _ = await s.post({"X-Request-Id": "new", **deadline_in(60000)})
    assert (status, body["error"]["code"]) == (503, "reject_age_beats_slack") and body["error"]["queue_age_ms"] >= 4000
    assert len(s.up.calls) == 3


class Outage:
    """The primary holding the gate's queue, killed with SIGKILL; no failover while the test
    looks at the gate (the failure detection held back), then the failover let go. Blocking:
    called in a thread."""

    HOLD_MS = 600_000

    def __init__(self, topo: SentinelTopology | ClusterTopology, key: str):
        self.topo, self.key = topo, key

    def primary(self) -> int:
        if isinstance(self.topo, ClusterTopology):
            return self.topo.primary_for_slot(self.topo.keyslot(self.key))
        return self.topo.primary_port()

    def _detection(self, ms: int | None) -> None:
        topo = self.topo
        if isinstance(topo, ClusterTopology):
            for p in topo.live():
                # Validity factor 0: the replica may take over however long its link was down.
                topo.commands(p, ("CONFIG", "SET", "cluster-node-timeout", ms or topo.node_timeout_ms), ("CONFIG", "SET", "cluster-replica-validity-factor", 0))
        else:
            for p in topo.sentinel_ports:
                topo.command(p, "SENTINEL", "SET", topo.service, "down-after-milliseconds", ms or topo.down_after_ms)

    def kill(self) -> int:
        port = self.primary()
        if isinstance(self.topo, ClusterTopology):
            pid = self.topo.node_id(port)
            (self.replica,) = [n["port"] for n in self.topo.nodes() if n["primary_id"] == pid]
        self._detection(self.HOLD_MS)
        self.topo.kill(port)
        return port

    def fail_over(self, killed: int) -> int:
        """Failure detection as before: a replica takes over; the new primary."""
        self._detection(None)
        try:
            if isinstance(self.topo, ClusterTopology):
                self.topo.wait_primary(self.replica)
                new = self.primary()
            else:
                new = self.topo.wait_new_primary(killed)
        except TimeoutError as exc:  # name each process's state: a stopped ('T') or gone one is the cause to look for
            states = {port: (node.proc.pid, proc_state(node.proc.pid)) for port, node in self.topo.procs.items() if node.proc is not None}
            raise TimeoutError(f"{exc}; processes (port: pid, state): {states}") from exc
        assert new != killed
        return new


@pytest.fixture(params=("sentinel", "cluster"))
def topo(request: pytest.FixtureRequest) -> SentinelTopology | ClusterTopology:
    return request.getfixturevalue(f"own_redis_{request.param}")


def decisions(m: dict, route: str, decision: str) -> float:
    return m.get(("llm_gate_decisions_total", (("decision", decision), ("route", route))), 0.0)


async def test_dead_primary_is_the_redis_down_policy_until_the_failover(stack, topo):
    routes = {
        "open": {"default_deadline_ms": 30000, "redis_down": "open"},
        "closed": {"default_deadline_ms": 30000, "redis_down": "closed"},
    }
    s = await stack(topo.url, routes)
    assert (await s.post({"X-Route": "closed", "X-Request-Id": "before"}))[0] == 200
    assert (await s.record("default/before")) is not None
    outage = Outage(topo, s.gate.queue.keys.routes())
    killed = await asyncio.to_thread(outage.kill)

    # While it is gone, each route's redis_down policy; nothing recorded, the gate up.
    status, body, headers = await s.post({"X-Route": "closed", "X-Request-Id": "gone-closed"})
    assert (status, body["error"]["code"]) == (503, "reject_redis_down") and "Retry-After" in headers, body
    status, body, _ = await s.post({"X-Route": "open", "X-Request-Id": "gone-open"})
    assert status == 200 and body["usage"]["total_tokens"] == 272
    m = await s.metrics()
    assert m[("llm_gate_redis_up", ())] == 0
    assert decisions(m, "open", "admit_unrecorded") == 1 and decisions(m, "closed", "reject_redis_down") == 1
    assert await s.healthy()

    # The failover let go: requests keep coming meanwhile; each gets the policy or an
    # admission, never a 500; the gate finds the new primary by itself.
    answers: collections.Counter[str] = collections.Counter()
    stop = asyncio.Event()

    async def traffic() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            status, body, _ = await s.post({"X-Route": "closed", "X-Request-Id": f"during-{i}"})
            code = "admit" if status == 200 else body.get("error", {}).get("code", body.get("error", {}).get("type"))
            answers[f"{status} {code}"] += 1
            await asyncio.sleep(0.05)

    sender = asyncio.create_task(traffic())
    try:
        new = await asyncio.to_thread(outage.fail_over, killed)
        deadline = time.monotonic() + 60
        while (await s.metrics())[("llm_gate_redis_up", ())] != 1:
            assert time.monotonic() < deadline, "llm_gate_redis_up never came back to 1"
            await asyncio.sleep(0.1)
        while answers["200 admit"] == 0:
            assert time.monotonic() < deadline, f"no request admitted after the failover: {answers}"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await sender
    assert set(answers) <= {"200 admit", "503 reject_redis_down"}, answers

    status, _, _ = await s.post({"X-Route": "closed", "X-Request-Id": "after"})
    assert status == 200
    rec = await s.record("default/after")
    assert rec is not None and (rec.route, rec.http_status, rec.state) == ("closed", 200, "done")
    assert (await s.record("default/gone-closed", timeout=0)) is None  # never recorded
    assert (await s.metrics())[("llm_gate_redis_up", ())] == 1 and await s.healthy()
    kind = "cluster" if isinstance(topo, ClusterTopology) else "sentinel"
    show(f"gate ({kind}): primary {killed} killed -9: redis_down policies applied, then {new} took over; requests meanwhile {dict(answers)}")


async def test_cluster_down_elsewhere_is_the_redis_down_policy(stack, own_redis_cluster: ClusterTopology):
    """A shard other than the queue's lost whole (its primary and replica killed): the queue's
    primary lives, but answers CLUSTERDOWN (cluster-require-full-coverage): Redis is down for
    the gate too. Both back on their ports: it recovers by itself."""
    topo = own_redis_cluster
    routes = {"open": {"default_deadline_ms": 30000, "redis_down": "open"}, "closed": {"default_deadline_ms": 30000, "redis_down": "closed"}}
    s = await stack(topo.url, routes)
    assert (await s.post({"X-Route": "closed", "X-Request-Id": "before"}))[0] == 200
    queue_primary = topo.primary_for_slot(topo.keyslot(s.gate.queue.keys.routes()))
    other = next(p for p in topo.primary_ports() if p != queue_primary)
    other_id = topo.node_id(other)
    shard = [other, *(n["port"] for n in topo.nodes() if n["primary_id"] == other_id)]
    for p in shard:
        topo.kill(p)
    await asyncio.to_thread(poll, lambda: info(queue_primary, "cluster-info")["cluster_state"] == "fail", 60, "CLUSTERDOWN on the queue's primary")

    status, body, headers = await s.post({"X-Route": "closed", "X-Request-Id": "down-closed"})
    assert (status, body["error"]["code"]) == (503, "reject_redis_down") and "Retry-After" in headers, body
    status, body, _ = await s.post({"X-Route": "open", "X-Request-Id": "down-open"})
    assert status == 200 and body["usage"]["total_tokens"] == 272
    m = await s.metrics()
    assert decisions(m, "open", "admit_unrecorded") == 1 and decisions(m, "closed", "reject_redis_down") == 1
    deadline = time.monotonic() + 60
    while (await s.metrics())[("llm_gate_redis_up", ())] != 0:  # the sampler too
        assert time.monotonic() < deadline, "llm_gate_redis_up stayed 1 with the cluster down"
        await asyncio.sleep(0.1)
    assert await s.healthy()

    for p in shard:
        await asyncio.to_thread(topo.procs[p].start)
    await asyncio.to_thread(topo.wait_ready)
    while (await s.metrics())[("llm_gate_redis_up", ())] != 1:
        assert time.monotonic() < deadline + 60, "llm_gate_redis_up never came back to 1"
        await asyncio.sleep(0.1)
    assert (await s.post({"X-Route": "closed", "X-Request-Id": "after"}))[0] == 200
    rec = await s.record("default/after")
    assert rec is not None and rec.state == "done" and await s.healthy()


async def test_commanded_failover_is_followed_at_once(stack, topo):
    """A commanded failover (Sentinel: the old primary demoted; Cluster: FORCE, it answers
    MOVED): the next request finds the new primary, admitted and recorded there, no redis_down.
    No sampling meanwhile: the request itself follows the failover."""
    s = await stack(topo.url, {"closed": {"default_deadline_ms": 30000, "redis_down": "closed"}}, sample_interval="1h")
    assert (await s.post({"X-Request-Id": "before"}))[0] == 200
    assert (await s.record("default/before")) is not None
    outage = Outage(topo, s.gate.queue.keys.routes())
    old = outage.primary()
    if isinstance(topo, ClusterTopology):
        old_id = topo.node_id(old)
        (replica,) = [n["port"] for n in topo.nodes() if n["primary_id"] == old_id]
        await asyncio.to_thread(topo.failover, replica, True)
    else:
        await asyncio.to_thread(topo.failover)
    new = outage.primary()
    assert new != old
    status, body, _ = await s.post({"X-Request-Id": "after"})
    assert status == 200, body
    rec = await s.record("default/after")
    assert rec is not None and rec.state == "done"
    assert topo.command(new, "HGET", s.gate.queue.keys.record("default/after"), "state") == "done"
    m = await s.metrics()
    assert decisions(m, "closed", "reject_redis_down") == 0 and decisions(m, "closed", "admit_once") == 2
