"""Chaos on real Redis Sentinel and Redis Cluster topologies (tests/fixtures/redis_topology.py),
``min-replicas-to-write 1`` on every data node (as docs/redis-schema.md advises: a primary without a
linked replica refuses writes with NOREPLICAS, from the claim script and the waiters'
list alike): five worker processes (tests/harness/lease_worker.py --detail; two with jobs of 1-3.5 s,
that renew across the faults, three with jobs under 0.7 s) claim, renew and release a
pool of three GPUs (TTL 3 s) for over 30 s each while, on the real processes:

* the primary (on Cluster: the one serving ``{g0}``) is SIGKILLed while a claim script
  is in flight, after its replicas were paused (SIGSTOP) and a claim came back
  NotReplicated; then the replicas are resumed, a replica takes over (Sentinel elects
  one; Cluster's replica promotes itself) and the killed node is restarted, a replica;
* a failover is forced: ``SENTINEL FAILOVER``, or ``CLUSTER FAILOVER FORCE`` on a replica;
* Cluster only: the slot of ``{g0}`` (its lease, info and fence keys) migrates to another
  primary while a short job holds g0 and a worker waits, held half-way until the source
  answers a script on those keys with TRYAGAIN or ASK (asserted), then finished;
* every primary kills its pub/sub clients (``CLIENT KILL TYPE pubsub``): the waiters' feeds.

A claim cut by the kill may come back acknowledged later: its retry reached the promoted
replica, which had it (the kernel had buffered the stream to the paused replica), and
WAIT confirmed it there; ``claims_cut_by_kill`` prints how they ended.

Every worker acts on its GPU through a resource that accepts a write only with the newest
fencing token it has seen for that GPU. A sampler in the test reads each GPU's lease every
0.1 s in a script that also writes a probe key in that GPU's slot, confirmed by WAIT like
a claim: a sample counts as "free" only when a claim could have been acknowledged then.
From the workers' logs, the resource's and the samples, the test counts and asserts:

* claims acknowledged, and NotReplicated claims (at least one while the replicas were
  paused: otherwise the fault tested nothing); no claim acknowledged while they were;
* holders acting at once: writes of an older holder of a GPU after a newer one's first
  write; 0, except those the fence refused (then printed as fenced);
* token regressions: a claim sent after another claim of the GPU was acknowledged, with
  a smaller token: 0;
* claims lost after an acknowledgement: a renewal refused before the lease's confirmed
  validity (last confirmed send + TTL) ran out, or another holder granted the GPU within
  it (validity ends early only at the holder's release or its LeaseLost): 0;
* waiters that overslept: a wait_for_gpu that returned None although a GPU of its pool
  sampled free for over 2 s while it waited: 0;
* exceptions raised to the workers by wait_for_gpu (NOREPLICAS, READONLY, LOADING, ...
  are "not yet" to a waiter: store.errors.retryable): 0;
* every worker claims a GPU again after the last fault.

It prints the counts (and what broke a zero), and leaves the logs with chaos.json (faults,
the resource's writes, the samples) in the test's tmp_path. No wall-clock time is
asserted: the schedule only places faults.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from redis.exceptions import AskError, TryAgainError

from llm_health.sim.servers import serve_app
from llm_health.store.deployment import connect
from llm_health.store.keys import LeaseKeys
from tests.fixtures.fencing import Resource
from tests.fixtures.redis_topology import ClusterTopology, SentinelTopology
from tests.fixtures.summary import show

TTL_MS = 3000
GPUS = ("g0", "g1", "g2")
WORKERS = 5
LONG_JOBS = ("w0", "w1")  # 20-60 writes 50 ms apart: they renew across faults; the others 3-12
WAIT_TIMEOUT_S = 4.0  # each wait_for_gpu; its fallback re-check every 1 s (the default)
CHAOS_S = 30.0
FREE_S = 2.0  # a GPU sampled free this long during a wait that timed out: overslept
SAMPLE_LUA = "redis.call('SET', KEYS[4], ARGV[1])\nreturn redis.call('GET', KEYS[1])"


class Chaos:
    """Workers, the resource, the sampler and the fault record of one test."""

    def __init__(self, tmp_path: Path, url: str):
        self.url, self.logs = url, tmp_path / "logs"
        self.logs.mkdir()
        self.resource = Resource()
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.events: list[dict] = []
        self._read: dict[Path, tuple[int, str]] = {}
        self.samples: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
        self.faults: list[tuple[float, float, str]] = []
        self.unreplicable: list[tuple[float, float, set[str]]] = []  # replicas paused: no claim can be acknowledged
        self.kills: list[tuple[float, set[str]]] = []  # when a primary was killed, the GPUs it served
        self.notes: list[str] = []
        self._stop = asyncio.Event()
        self.migration: dict[str, int] | None = None  # Cluster: what the source answered during the migration
        self.started = self.ended = time.monotonic()

    async def __aenter__(self) -> Chaos:
        app = web.Application()
        app.router.add_post("/act", self.resource.handle)
        self.runner, port = await serve_app(app)
        for i in range(WORKERS):
            name = f"w{i}"
            argv = [sys.executable, "-m", "tests.harness.lease_worker", "--redis", self.url, "--pool", ",".join(GPUS), "--worker", name]
            argv += ["--resource", f"http://127.0.0.1:{port}/act", "--log", str(self.logs / f"{name}.jsonl"), "--ttl-ms", str(TTL_MS)]
            argv += ["--steps", "20,60" if name in LONG_JOBS else "3,12", "--wait-timeout-s", str(WAIT_TIMEOUT_S), "--fallback-s", "1.0", "--detail"]
            self.workers[name] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
        self.sampler = asyncio.create_task(self._sample())
        for name in self.workers:  # the schedule starts once every worker has held a GPU
            await self.wait_for(lambda e, n=name: e["worker"] == n and e["event"] == "claim", 90, f"a first claim by {name}")
        self.started = time.monotonic()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(self.sampler, return_exceptions=True)
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        await self.runner.cleanup()
        self.read()
        record = {
            "started": self.started,
            "faults": self.faults,
            "kills": [(t, sorted(g)) for t, g in self.kills],
            "resource": self.resource.log,
            "samples": self.samples,
        }
        (self.logs.parent / "chaos.json").write_text(json.dumps(record))  # beside the logs, for a failure's diagnosis

    async def _sample(self) -> None:
        dep = connect(self.url, socket_timeout=1.0)
        keys = dep.lease_keys()
        try:
            while not self._stop.is_set():
                for g in GPUS:
                    t0, state = time.monotonic(), "unavailable"
                    try:
                        ks = [keys.lease(g), keys.info(g), keys.fence(g), f"chaos:probe:{dep.tag(g)}"]
                        held = await asyncio.wait_for(dep.script(SAMPLE_LUA, ks, [t0]), 1.0)
                        state = "free" if held is None else "held"
                    except Exception:  # Redis down, NotReplicated, TRYAGAIN: a claim could not count now
                        pass
                    self.samples[g].append((t0, time.monotonic(), state))
                await asyncio.sleep(0.1)
        finally:
            await dep.aclose()

    def read(self) -> list[dict]:
        """The workers' log lines written since the last call, appended to ``events``."""
        new: list[dict] = []
        for path in sorted(self.logs.glob("*.jsonl")):
            offset, rest = self._read.get(path, (0, ""))
            with open(path) as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            *lines, rest = (rest + chunk).split("\n")
            new += [json.loads(line) for line in lines if line.strip()]
            self._read[path] = (offset, rest)
        self.events += new
        return new

    async def wait_for(self, match: Callable[[dict], bool], timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        seen = list(self.events)
        while True:
            for e in seen:
                if match(e):
                    return e
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f} s")
            await asyncio.sleep(0.01)
            seen = self.read()

    async def fault(self, what: str, action: Callable[..., Any], *args: Any) -> Any:
        t0 = time.monotonic()
        result = await asyncio.to_thread(action, *args)
        self.faults.append((t0, time.monotonic(), what))
        return result

    def in_flight(self, gpus: set[str]) -> bool:
        """Some worker's last claim script on one of ``gpus`` was sent and has not come back."""
        self.read()
        last: dict[str, dict] = {}
        for e in self.events:
            if e["event"] in ("claim_try", "claim_done"):
                last[e["worker"]] = e
        return any(e["event"] == "claim_try" and gpus & set(e["gpus"]) for e in last.values())

    async def kill_mid_claim(self, primary: int, replicas: list[int], gpus: set[str], topo: Any) -> None:
        """Pause the replicas; once a claim came back NotReplicated and another is in
        flight, SIGKILL the primary; resume the replicas."""
        await self.fault(f"replicas {replicas} paused (SIGSTOP)", lambda: [topo.pause(r) for r in replicas])
        paused = time.monotonic()
        await self.wait_for(lambda e: e["event"] == "not_replicated" and e["t"] > paused and e["gpu"] in gpus, 30, "NotReplicated claim")
        deadline = time.monotonic() + 10
        while not self.in_flight(gpus) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        self.kills.append((time.monotonic(), gpus))
        await self.fault(f"primary {primary} SIGKILLed mid-claim", topo.kill, primary)
        await self.fault(f"replicas {replicas} resumed", lambda: [topo.resume(r) for r in replicas])
        self.unreplicable.append((paused, time.monotonic(), gpus))

    def roles(self) -> dict[str, tuple[str, str | None]]:
        """Each worker's state by its log: ("waiting", None) or ("holding", gpu), or ("idle", None)."""
        self.read()
        state: dict[str, tuple[str, str | None]] = {}
        for e in self.events:
            if e["event"] in ("waiting", "claim", "release_start", "lost"):
                state[e["worker"]] = {"waiting": ("waiting", None), "claim": ("holding", e.get("gpu"))}.get(e["event"], ("idle", None))
        return state

    async def migrate_while_waiting(self, topo: ClusterTopology, gpu: str) -> None:
        """Migrate ``gpu``'s slot to another primary once a short job holds it and a worker
        waits; held half-way until a claim-like script on its keys met TRYAGAIN or ASK on
        the source (the short job's release empties the slot there but for the fence key)."""
        slot = topo.keyslot("{" + gpu + "}")
        source = topo.primary_for_slot(slot)
        dest = next(p for p in topo.primary_ports() if p != source)
        deadline = time.monotonic() + 30
        while True:
            r = self.roles()
            if any(v[0] == "waiting" for v in r.values()) and any(v == ("holding", gpu) and w not in LONG_JOBS for w, v in r.items()):
                break
            assert time.monotonic() < deadline, f"no short job on {gpu} with a worker waiting: {r}"
            await asyncio.sleep(0.01)
        waiting = sorted(w for w, v in r.items() if v[0] == "waiting")
        await self.fault(f"slot {slot} of {{{gpu}}} migrating {source} -> {dest} ({', '.join(waiting)} waiting)", topo.begin_migration, slot, dest)
        lk = LeaseKeys().tagged()
        keys = [lk.lease(gpu), lk.info(gpu), lk.fence(gpu)]
        met: dict[str, int] = defaultdict(int)
        begun = time.monotonic()
        while time.monotonic() < begun + 1.5 or (not (met["TRYAGAIN"] or met["ASK"]) and time.monotonic() < begun + 10):
            try:
                await asyncio.to_thread(topo.command, source, "EVAL", "return redis.call('EXISTS', KEYS[1])", 3, *keys)
                met["served"] += 1
            except TryAgainError:
                met["TRYAGAIN"] += 1
            except AskError:
                met["ASK"] += 1
            await asyncio.sleep(0.05)
        await self.fault(f"slot {slot} migrated", topo.finish_migration, slot)
        self.migration = dict(met)
        self.read()
        done = {(e["worker"], e["sent"]): e["result"] for e in self.events if e["event"] == "claim_done"}
        tries = [e for e in self.events if e["event"] == "claim_try" and gpu in e["gpus"] and begun <= e["sent"] <= self.faults[-1][1]]
        ended = defaultdict(int, {"sent": len(tries)})
        for e in tries:
            ended[done.get((e["worker"], e["sent"]), "none back yet")] += 1
        self.notes.append(f"during the migration the source answered {dict(met)}; claims of {gpu} sent then: {dict(ended)}")

    async def pubsub_killed(self, primaries: list[int], topo: Any) -> None:
        killed = await self.fault("CLIENT KILL TYPE pubsub on every primary", lambda: [topo.command(p, "CLIENT", "KILL", "TYPE", "pubsub") for p in primaries])
        self.notes.append(f"pub/sub clients killed {killed}")

    async def until_recovered(self) -> None:
        """Chaos for CHAOS_S at least; then every worker claims once after the last fault."""
        await asyncio.sleep(max(0.0, self.started + CHAOS_S - time.monotonic()))
        last = self.faults[-1][1]
        for name in self.workers:
            await self.wait_for(lambda e, n=name: e["worker"] == n and e["event"] == "claim" and e["t"] > last, 60, f"claim by {name} after the last fault")
        self.ended = time.monotonic()


def free_run(samples: list[tuple[float, float, str]], start: float, end: float) -> tuple[float, float] | None:
    """The first stretch of FREE_S or more within [start, end] over which every sample
    (at most 0.6 s apart) found the GPU free: (first sample's end, last sample's start)."""
    run: list[tuple[float, float, str]] = []
    for s in [s for s in samples if start <= s[0] and s[1] <= end]:
        if s[2] != "free" or (run and s[0] - run[-1][1] > 0.6):
            run = []
        if s[2] == "free":
            run.append(s)
            if run[-1][0] - run[0][1] >= FREE_S:
                return run[0][1], run[-1][0]
    return None


def judge(c: Chaos) -> dict[str, Any]:
    """The counts (see the module docstring) from the logs, the resource and the samples."""
    ev = sorted(c.events, key=lambda e: e["t"])
    claims = [e for e in ev if e["event"] == "claim"]
    nr = [e for e in ev if e["event"] == "not_replicated"]
    out: dict[str, Any] = {"claims": len(claims), "not_replicated": len(nr)}
    out["not_replicated_while_paused"] = sum(any(a <= e["t"] <= b + 1 and e["gpu"] in g for a, b, g in c.unreplicable) for e in nr)
    out["acked_while_paused"] = sum(any(a + 0.3 <= e["t"] <= b and e["gpu"] in g for a, b, g in c.unreplicable) for e in claims)
    # Claim scripts on the killed primary's GPUs sent before the kill, back after it: how they ended.
    done = {(e["worker"], e["sent"]): e for e in ev if e["event"] == "claim_done"}
    cut: dict[str, int] = defaultdict(int)
    for e in (e for e in ev if e["event"] == "claim_try"):
        back = done.get((e["worker"], e["sent"]))
        if any(e["sent"] < k < (back["t"] if back else 1e18) and gpus & set(e["gpus"]) for k, gpus in c.kills):
            cut[back["result"] if back else "none back"] += 1
    out["claims_cut_by_kill"] = dict(cut)

    # Token regressions: a claim sent after another claim of its GPU was acknowledged has a
    # larger token (or the same, given back to the same holder: the idempotent re-claim).
    regressions = 0
    for c2 in claims:
        earlier = [c1 for c1 in claims if c1["gpu"] == c2["gpu"] and c1["t"] < c2["sent"]]
        if larger := [c1 for c1 in earlier if c1["token"] > c2["token"] or (c1["token"] == c2["token"] and c1["worker"] != c2["worker"])]:
            regressions += 1
            same = next((c1 for c1 in earlier if c1["token"] == c2["token"]), None)
            c.notes.append(
                f"token regression on {c2['gpu']}: {c2['worker']} acknowledged token {c2['token']} at {c2['t'] - c.started:+.2f}s (via {c2['via']}), "
                f"{len(larger)} larger ones acknowledged before, the last {larger[-1]['token']} ({larger[-1]['worker']}, {larger[-1]['t'] - c.started:+.2f}s)"
                + (f"; the same token was first acknowledged to {same['worker']} at {same['t'] - c.started:+.2f}s" if same else "")
            )
    out["token_regressions"] = regressions

    # Claims lost after an acknowledgement. A tenure: a claim (or the idempotent re-claim of
    # the same token), its confirmed renewals, up to its release_start or LeaseLost.
    tenures: list[dict] = []
    open_: dict[tuple[Any, Any], dict] = {}
    refused_early: set[tuple[Any, Any]] = set()
    for e in ev:
        key = (e.get("gpu"), e.get("token"))
        if e["event"] == "claim":
            open_[key] = ten = {"gpu": e["gpu"], "token": e["token"], "worker": e["worker"], "sent": e["sent"], "valid": e["sent"] + TTL_MS / 1000, "end": None}
            tenures.append(ten)
        elif (ten := open_.get(key)) is not None and e["event"] == "renew":
            if e["result"] == "ok":
                ten["valid"] = max(ten["valid"], e["sent"] + TTL_MS / 1000)
            elif e["result"] == "refused" and e["t"] < ten["valid"]:
                refused_early.add(key)
                c.notes.append(f"renewal refused {ten['valid'] - e['t']:.2f} s before the lease's validity: {e}")
        elif ten is not None and e["event"] in ("release_start", "lost"):
            ten["end"] = e["t"] if ten["end"] is None else ten["end"]
            del open_[key]
    granted_within: set[tuple[Any, Any]] = set()
    for ten in tenures:
        end = min(ten["valid"], ten["end"] if ten["end"] is not None else 1e18)
        for c2 in claims:
            if c2["gpu"] == ten["gpu"] and c2["token"] > ten["token"] and ten["sent"] <= c2["t"] < end:
                granted_within.add((ten["gpu"], ten["token"]))
                c.notes.append(
                    f"{c2['worker']} granted {ten['gpu']} (token {c2['token']}) {end - c2['t']:.2f} s within the validity of {ten['worker']}'s token {ten['token']}"
                )
    out["lost_after_ack"] = len(refused_early | granted_within)

    # Holders acting at once, by the resource's arrival order: writes of an older tenure
    # of a GPU after a newer tenure's first write; fenced when the fence refused them all.
    at_once, fenced = 0, 0
    by_gpu: dict[str, list[dict]] = defaultdict(list)
    for r in c.resource.log:
        by_gpu[r["gpu"]].append(r)
    for writes in by_gpu.values():
        first: dict[int, int] = {}
        for i, r in enumerate(writes):
            first.setdefault(r["token"], i)
        for token, i in first.items():
            late = [r for r in writes[i + 1 :] if r["token"] < token]
            if late:
                fenced += all(not r["accepted"] for r in late)
                at_once += any(r["accepted"] for r in late)
    out["acting_at_once"], out["acting_at_once_fenced"] = at_once, fenced
    out["writes"] = len(c.resource.log)
    out["refused_writes"] = sum(not r["accepted"] for r in c.resource.log)

    # Waiters that overslept: timed out although a GPU sampled free for FREE_S during the wait.
    timeouts = [e for e in ev if e["event"] == "timeout"]
    overslept = 0
    for w in timeouts:
        for g in GPUS:
            if run := free_run(c.samples[g], w["start"], w["deadline"]):
                overslept += 1
                c.notes.append(f"{w['worker']} timed out at {w['deadline']:.2f} although {g} was sampled free from {run[0]:.2f} to {run[1]:.2f}")
                break
    out["timeouts"], out["overslept"] = len(timeouts), overslept
    lost = [e for e in ev if e["event"] == "lost"]
    out["leases_lost"] = len(lost)
    out["errors"] = sum(e["event"] == "error" for e in ev)
    # What escaped wait_for_gpu: a waiter outlives every failover (store.errors.retryable).
    raised = [e for e in ev if e["event"] == "error" and e.get("where") == "wait_for_gpu"]
    out["raised_to_waiters"] = len(raised)
    # What the waiters met and outlived: claim scripts answered by a failover's error reply.
    met = [e["error"] for e in ev if e["event"] == "claim_done" and e["result"] == "error"]
    out["claims_refused"] = {w: n for w in ("NOREPLICAS", "READONLY", "LOADING", "TRYAGAIN", "CLUSTERDOWN") if (n := sum(w in m for m in met))}
    out["error_kinds"] = sorted({e["error"][:80] for e in ev if e["event"] == "error"})
    out["samples_free_held_unavailable"] = [sum(s[2] == k for g in GPUS for s in c.samples[g]) for k in ("free", "held", "unavailable")]
    return out


def report(c: Chaos, kind: str, counts: dict[str, Any]) -> None:
    faults = "; ".join(f"{t0 - c.started:+.1f}s {what}" for t0, _, what in c.faults)
    show(f"lease chaos on {kind} ({c.ended - c.started:.0f} s): " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f"\n  faults: {faults}")
    for note in c.notes[:20]:
        print("  " + note)


def check(c: Chaos, counts: dict[str, Any]) -> None:
    assert c.ended - c.started >= CHAOS_S
    assert counts["not_replicated_while_paused"] >= 1, "no claim came back NotReplicated while the replicas were paused"
    assert counts["acked_while_paused"] == 0
    assert counts["token_regressions"] == 0
    assert counts["lost_after_ack"] == 0
    assert counts["acting_at_once"] == 0
    assert counts["overslept"] == 0
    assert counts["raised_to_waiters"] == 0, f"wait_for_gpu raised to its caller: {counts['error_kinds']}"
    assert counts["claims"] >= 30
    if c.migration is not None:
        assert c.migration.get("TRYAGAIN", 0) + c.migration.get("ASK", 0) >= 1, f"the migration met no claim-like TRYAGAIN or ASK: {c.migration}"


async def test_lease_chaos_sentinel(guarded_redis_sentinel: SentinelTopology, tmp_path: Path) -> None:
    topo = guarded_redis_sentinel
    async with Chaos(tmp_path, topo.url) as c:
        await asyncio.sleep(2)
        old = topo.primary_port()
        await c.kill_mid_claim(old, topo.replica_ports(), set(GPUS), topo)
        new = await c.fault("a replica elected", topo.wait_new_primary, old)
        await c.fault(f"{old} restarted, a replica of {new}", topo.restart, old)
        await asyncio.sleep(2)
        await c.fault("SENTINEL FAILOVER", lambda: topo.failover(settle=False))
        await asyncio.sleep(2)
        await c.pubsub_killed([topo.primary_port()], topo)
        await c.fault("settled", topo.wait_ready)
        await asyncio.sleep(1)
        await c.pubsub_killed([topo.primary_port()], topo)
        await c.until_recovered()
    counts = judge(c)
    report(c, "Sentinel", counts)
    check(c, counts)


def replica_of(topo: ClusterTopology, primary: int) -> int:
    pid = topo.node_id(primary)
    return next(n["port"] for n in topo.nodes() if n["primary_id"] == pid)


async def test_lease_chaos_cluster(guarded_redis_cluster: ClusterTopology, tmp_path: Path) -> None:
    topo = guarded_redis_cluster
    slot = {g: topo.keyslot("{" + g + "}") for g in GPUS}
    async with Chaos(tmp_path, topo.url) as c:
        await asyncio.sleep(2)
        old = topo.primary_for_slot(slot["g0"])
        replica = replica_of(topo, old)
        await c.kill_mid_claim(old, [replica], {g for g in GPUS if topo.primary_for_slot(slot[g]) == old}, topo)
        await c.fault(f"replica {replica} took over", topo.wait_primary, replica)
        await c.fault(f"{old} restarted, a replica of {replica}", topo.restart, old)
        await asyncio.sleep(2)
        forced = replica_of(topo, topo.primary_for_slot(slot["g1"]))
        await c.fault(f"CLUSTER FAILOVER FORCE on {forced}", topo.failover, forced)
        await asyncio.sleep(2)
        await c.migrate_while_waiting(topo, "g0")
        await asyncio.sleep(2)
        await c.pubsub_killed(topo.primary_ports(), topo)
        await c.until_recovered()
    counts = judge(c)
    report(c, "Cluster", counts)
    check(c, counts)
