"""A Redis that answers "not now" (store.errors.retryable) is outlived, not raised: a real
redis-server with `min-replicas-to-write 1` and no replica refuses every write with
NOREPLICAS, as a primary does after a failover until a replica resynced. A waiter waits
to its deadline and returns None; the gate applies the route's `redis_down` policy; the
queue's record is not counted as a refused write (500)."""

from __future__ import annotations

import pytest

from llm_health.config.gate import parse_gate_config
from llm_health.gate.decision import Admission
from llm_health.store.leases import LeaseClient
from llm_health.store.records import Pool


@pytest.fixture
def no_replicas(redis_server_factory):
    return redis_server_factory(extra_args=("--min-replicas-to-write", "1", "--min-replicas-max-lag", "10"))


async def test_a_waiter_outlives_noreplicas_until_its_deadline(no_replicas):
    client = LeaseClient.from_url(no_replicas.url, socket_timeout=1.0, fallback_interval_s=0.1)
    try:
        assert await client.wait_for_gpu(Pool("p", ["g0", "g1"]), "w1", timeout=0.6) is None
    finally:
        await client.aclose()


@pytest.mark.parametrize(("mode", "status", "decision"), [("open", 200, "admit_unrecorded"), ("closed", 503, "reject_redis_down")])
async def test_the_gate_takes_noreplicas_for_redis_down(no_replicas, mode, status, decision):
    route = {"upstream": "http://127.0.0.1:1", "default_deadline_ms": 30000, "redis_down": mode}
    adm = Admission(parse_gate_config({"gate": {"redis": no_replicas.url, "routes": {"chat": route}}}))
    try:
        out = await adm.decide("POST", "/v1/completions", {"X-Request-Id": f"nr-{mode}"})
        assert (out.status, out.decision) == (status, decision), out.body
        assert adm.registry.get_sample_value("llm_gate_redis_up") == 0
        if out.attempt is not None:
            assert not out.attempt.recorded
    finally:
        await adm.stop()
