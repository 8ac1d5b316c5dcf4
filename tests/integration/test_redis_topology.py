"""The Sentinel and Cluster topologies of tests/fixtures/redis_topology.py are what they
claim, on real processes: replication, failovers (commanded and after a SIGKILL), a node
back after a restart, a slot migration with its keys and the ASK redirect meanwhile.

Tests that kill, fail over or migrate take a topology of their own; the others share the
session's. Every wait polls under a generous bound; no test asserts a wall-clock time.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket

import pytest
from redis.exceptions import AskError, MovedError, ReadOnlyError

from tests.fixtures.redis import heal, report
from tests.fixtures.redis_server import RedisServer, answering_pid, port_taken
from tests.fixtures.redis_topology import SLOTS, ClusterTopology, SentinelTopology, info, linked, poll
from tests.harness.processes import free_port, proc_state

# ----------------------------------------------------------------------------- Sentinel


def test_sentinel_url_and_addresses(redis_sentinel: SentinelTopology):
    ports = [p for _, p in redis_sentinel.sentinel_addresses]
    assert len(ports) == 3
    assert redis_sentinel.url == f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in ports)}/mymaster/0"


def test_sentinel_write_on_primary_is_read_on_every_replica(redis_sentinel: SentinelTopology):
    redis_sentinel.flushall()
    primary, replicas = redis_sentinel.primary_port(), redis_sentinel.replica_ports()
    assert len(replicas) == 2 and primary not in replicas
    assert redis_sentinel.commands(primary, ("SET", "topology:k", "v1"), ("WAIT", 2, 10000), timeout_s=15) == ["OK", 2]
    assert [redis_sentinel.command(r, "GET", "topology:k") for r in replicas] == ["v1", "v1"]
    with pytest.raises(ReadOnlyError):
        redis_sentinel.command(replicas[0], "SET", "topology:k", "no")
    assert info(primary, "server")["redis_mode"] == "standalone"
    assert redis_sentinel.command(primary, "CONFIG", "GET", "notify-keyspace-events")[1] in ("Egx", "gxE")


def test_sentinel_paused_replica_misses_a_write_until_resumed(redis_sentinel: SentinelTopology):
    redis_sentinel.flushall()
    primary, (paused, other) = redis_sentinel.primary_port(), redis_sentinel.replica_ports()
    redis_sentinel.pause(paused)
    try:
        ok, paused_acks, acks = redis_sentinel.commands(primary, ("SET", "topology:paused", "1"), ("WAIT", 2, 200), ("WAIT", 1, 10000), timeout_s=15)
        assert (ok, acks) == ("OK", 1) and paused_acks <= 1  # the paused one cannot acknowledge
        assert redis_sentinel.command(other, "GET", "topology:paused") == "1"
    finally:
        redis_sentinel.resume(paused)
    poll(lambda: redis_sentinel.command(paused, "GET", "topology:paused") == "1", 30, "the resumed replica catching up")


def test_sentinel_failover_promotes_a_replica(own_redis_sentinel: SentinelTopology):
    topo = own_redis_sentinel
    old, replicas = topo.primary_port(), topo.replica_ports()
    new = topo.failover()
    assert new in replicas
    assert {topo.command(s, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster")[1] for _, s in topo.sentinel_addresses} == {str(new)}
    assert topo.command(new, "ROLE")[0] == "master"
    assert sorted(topo.replica_ports()) == sorted([old, *(r for r in replicas if r != new)])
    assert all(linked(r, new) for r in topo.replica_ports())  # the old primary included


def test_sentinel_replaces_a_killed_primary_and_takes_it_back_as_a_replica(own_redis_sentinel: SentinelTopology):
    topo = own_redis_sentinel
    old, replicas = topo.primary_port(), topo.replica_ports()
    assert topo.commands(old, ("SET", "topology:kept", "yes"), ("WAIT", 2, 10000), timeout_s=15) == ["OK", 2]
    topo.kill(old)
    new = topo.wait_new_primary(old, timeout_s=60)
    assert new in replicas
    assert topo.command(new, "GET", "topology:kept") == "yes"
    topo.wait_ready(60)  # the other replica follows the new primary
    topo.restart(old)
    assert topo.primary_port() == new
    assert topo.command(old, "ROLE")[:3] == ["slave", "127.0.0.1", new]
    assert topo.command(old, "GET", "topology:kept") == "yes"  # synced from the new primary
    assert old in topo.replica_ports()


# ----------------------------------------------------------------------------- Ports
# The kernel hands a freed port to the next bind to port 0 (free_port, any test's), often at
# once. Another test's server, given a killed primary's port, answered in its place: Sentinel
# saw the primary back and never failed over, and the replicas resynced from the stranger
# (tests/integration/test_gate_deployments.py failed so, in 2 of 7 full runs).


def test_a_killed_nodes_port_is_handed_to_no_one_until_it_restarts(own_redis_sentinel: SentinelTopology):
    topo = own_redis_sentinel
    old, sentinel = topo.primary_port(), topo.sentinel_ports[0]
    topo.kill(old)
    topo.kill(sentinel)
    assert port_taken(old) and port_taken(sentinel)  # held: no bind to port 0 gets them
    assert not {old, sentinel} & {free_port() for _ in range(2000)}
    for port in (old, sentinel):  # dead to a client, as before
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    topo.restart(sentinel)
    new = topo.wait_new_primary(old, timeout_s=60)
    topo.restart(old)
    assert topo.command(old, "ROLE")[:3] == ["slave", "127.0.0.1", new]
    assert answering_pid(sentinel) == topo.procs[sentinel].proc.pid  # type: ignore[union-attr]


def test_a_server_handed_a_port_in_use_takes_another_and_never_the_strangers(redis_server_factory):
    stranger = redis_server_factory()
    server = RedisServer()
    server.port = stranger.port  # free_port() handed the same port out twice
    try:
        server.start()
        assert server.port != stranger.port and server.proc is not None and answering_pid(server.port) == server.proc.pid
    finally:
        server.stop()


# ----------------------------------------------------------------------------- Cluster


def test_cluster_covers_every_slot_with_three_primaries_and_a_replica_each(redis_cluster: ClusterTopology):
    nodes = redis_cluster.nodes()
    primaries = [n for n in nodes if n["role"] == "primary"]
    replicas = [n for n in nodes if n["role"] == "replica"]
    assert len(primaries) == 3 and len(replicas) == 3
    assert sorted(r["primary_id"] for r in replicas) == sorted(p["id"] for p in primaries)
    covered = sorted(r for p in primaries for r in p["slots"])
    assert covered[0][0] == 0 and covered[-1][1] == SLOTS - 1
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(covered))
    for n in nodes:
        cluster = info(n["port"], "cluster-info")
        assert (cluster["cluster_state"], cluster["cluster_slots_assigned"], cluster["cluster_size"]) == ("ok", str(SLOTS), "3")
    seeds = re.fullmatch(r"redis\+cluster://127\.0\.0\.1:(\d+),127\.0\.0\.1:(\d+),127\.0\.0\.1:(\d+)", redis_cluster.url)
    assert seeds and sorted(map(int, seeds.groups())) == sorted(p["port"] for p in primaries)


def test_cluster_key_lives_on_the_node_owning_its_slot(redis_cluster: ClusterTopology):
    redis_cluster.flushall()
    slot = redis_cluster.keyslot("topology:k")
    owner = redis_cluster.primary_for_slot(slot)
    assert redis_cluster.commands(owner, ("SET", "topology:k", "v"), ("WAIT", 1, 10000), timeout_s=15) == ["OK", 1]
    other = next(p for p in redis_cluster.primary_ports() if p != owner)
    with pytest.raises(MovedError, match=f"^{slot} 127.0.0.1:{owner}$"):  # redis-py strips the MOVED
        redis_cluster.command(other, "GET", "topology:k")
    replica = next(n["port"] for n in redis_cluster.nodes() if n["primary_id"] == redis_cluster.node_id(owner))
    assert redis_cluster.command(replica, "CLUSTER", "COUNTKEYSINSLOT", slot) == 1


def test_cluster_slot_migration_moves_the_key_and_asks_meanwhile(own_redis_cluster: ClusterTopology):
    topo = own_redis_cluster
    slot = topo.keyslot("{topology}old")
    assert topo.keyslot("{topology}new") == slot
    source = topo.primary_for_slot(slot)
    dest = next(p for p in topo.primary_ports() if p != source)
    topo.command(source, "SET", "{topology}old", "here")
    topo.begin_migration(slot, dest)
    mine = next(n for n in topo.nodes(source) if n["port"] == source)
    assert mine["migrating"] == {slot: topo.node_id(dest)}
    assert topo.command(source, "GET", "{topology}old") == "here"  # not moved yet: served
    with pytest.raises(AskError, match=f"^{slot} 127.0.0.1:{dest}$"):
        topo.command(source, "SET", "{topology}new", "x")  # a new key goes to the destination
    topo.finish_migration(slot)
    assert all(topo.primary_for_slot(slot, via=p) == dest for p in topo.live())
    assert topo.command(dest, "CLUSTER", "COUNTKEYSINSLOT", slot) == 1
    assert topo.command(source, "CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert topo.command(dest, "GET", "{topology}old") == "here"


def test_cluster_failover_swaps_roles_and_a_killed_primary_is_replaced(own_redis_cluster: ClusterTopology):
    topo = own_redis_cluster
    slot = topo.keyslot("topology:kept")
    primary = topo.primary_for_slot(slot)
    primary_id = topo.node_id(primary)
    replica = next(n for n in topo.nodes() if n["primary_id"] == primary_id)
    # A commanded failover swaps the two.
    topo.failover(replica["port"], force=True)
    for via in topo.live():
        roles = {n["port"]: (n["role"], n["primary_id"]) for n in topo.nodes(via)}
        assert roles[replica["port"]] == ("primary", None) and roles[primary] == ("replica", replica["id"])
    assert topo.primary_for_slot(slot) == replica["port"]
    # The new primary killed: the old one, its replica now, takes the slots back after cluster-node-timeout.
    assert topo.commands(replica["port"], ("SET", "topology:kept", "yes"), ("WAIT", 1, 10000), timeout_s=15) == ["OK", 1]
    topo.kill(replica["port"])
    topo.wait_primary(primary, timeout_s=60)
    assert topo.primary_for_slot(slot) == primary
    assert topo.command(primary, "GET", "topology:kept") == "yes"
    # Back on the same port with its nodes.conf: a replica of the node that took over.
    topo.restart(replica["port"])
    mine = next(n for n in topo.nodes(replica["port"]) if n["port"] == replica["port"])
    assert (mine["role"], mine["primary_id"]) == ("replica", primary_id)
    assert linked(replica["port"], primary)
    assert topo.command(replica["port"], "CLUSTER", "COUNTKEYSINSLOT", slot) == 1  # synced again


def test_a_node_that_died_or_was_stopped_behind_the_topologys_back_is_named_and_healed(own_redis_cluster: ClusterTopology):
    """What the session's fixtures do before each test (tests/fixtures/redis.py `_settled`):
    a node killed or SIGSTOPped by something other than the topology is named in the
    report, started again or continued, and the cluster settles."""
    topo = own_redis_cluster
    died, stopped = [n["port"] for n in topo.nodes() if n["role"] == "replica"][:2]
    died_pid, stopped_pid = topo.procs[died].proc.pid, topo.procs[stopped].proc.pid  # type: ignore[union-attr]
    os.kill(died_pid, signal.SIGKILL)
    os.kill(stopped_pid, signal.SIGSTOP)
    try:
        poll(lambda: topo.procs[died].proc.poll() is not None, 10, "the killed node reaped")  # type: ignore[union-attr]
        poll(lambda: proc_state(stopped_pid) == "T", 10, "the node stopped")
        said_now = report(topo)
        assert f"{died}: pid {died_pid} state 'gone' exit -9 paused False listeners []" in said_now, said_now
        assert f"{stopped}: pid {stopped_pid} state 'T' exit None paused False listeners [{stopped_pid}]" in said_now, said_now
        said = {died: f"{died} had exited (-9): started again", stopped: f"{stopped} was stopped by something other than the topology: continued"}
        assert heal(topo) == [said[p] for p in sorted(said)]
    finally:
        os.kill(stopped_pid, signal.SIGCONT)
    topo.wait_ready(60)
    assert answering_pid(died) == topo.procs[died].proc.pid != died_pid  # type: ignore[union-attr]
    assert answering_pid(stopped) == stopped_pid
    assert heal(topo) == []
