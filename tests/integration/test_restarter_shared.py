"""The restart authority's memory in a real redis-server (`redis:` in its config): two
replicas, a replica that restarts, a Redis that goes away. Backends are simulated
servers on loopback; restart commands are real processes (a marker file)."""

from __future__ import annotations

import asyncio
import json

import pytest

from llm_health.config.restarter import SharedState, default_instance
from llm_health.core.restart_policy import Budget
from llm_health.core.webhook import parse_webhook
from llm_health.restarter.shared_state import RedisState
from llm_health.sim import servers as sim
from tests.fixtures.restarter import RestartEffect, make_config, marker_target, metrics, post_json, sample, status, wait_done
from tests.fixtures.webhooks import webhook_msteams
from tests.integration.test_restarter_evidence import evidence_of, hung_alert


@pytest.fixture
def redis_url(any_redis_url: str) -> str:
    """Every test of this module on one server, Sentinel and Cluster (tests/fixtures/redis_any.py)."""
    return any_redis_url


def shared(url: str, **kw) -> SharedState:
    return SharedState(url=url, lease_ttl=kw.pop("lease_ttl", 5.0), **kw)


async def test_two_replicas_restart_once(sim_server, ticker, restarter_client, tmp_path, redis_url):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    config = make_config(marker_target("gpu0", s, marker), redis=shared(redis_url), confirm_interval=0.3)
    _, a = await restarter_client(config)
    _, b = await restarter_client(config)
    effect = RestartEffect(marker, s)
    body = hung_alert("gpu0", evidence_of(s))
    try:
        # Both Alertmanagers of a pair deliver to both replicas at once.
        answers = await asyncio.gather(post_json(a, body), post_json(b, body), post_json(a, body), post_json(b, body))
        decisions = sorted(x["alerts"][0]["decision"] for x in answers)
        assert decisions == ["accepted", "duplicate", "duplicate", "duplicate"]
        (which, action_id) = next((c, x["alerts"][0]["action"]) for c, x in zip((a, b, a, b), answers) if x["alerts"][0]["decision"] == "accepted")
        action = await wait_done(which, action_id)
        assert action["outcome"] == "recovered"
        # Repeats after the action: the other replica knows it was acted on.
        for c in (a, b):
            again = await post_json(c, body)
            assert again["alerts"][0]["decision"] == "duplicate" and "already acted on" in again["alerts"][0]["detail"]
    finally:
        await effect.stop()
    assert effect.lines() == 1
    for c in (a, b):
        st = await status(c)
        assert st["state"] == "redis" and st["backends"][0]["restarts_in_window"] == 1  # both see the one restart


async def test_a_restarted_replica_keeps_the_budget(sim_server, ticker, restarter_client, tmp_path, redis_url):
    """Budget of one restart an hour: spent by the first restarter; a fresh one (the same
    process restarted, or another replica) refuses the next hang for budget."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    config = make_config(
        marker_target("gpu0", s, marker), redis=shared(redis_url), budget=Budget(max_restarts=1, window=3600, cooldown=60), confirm_interval=0.2
    )
    _, a = await restarter_client(config)
    effect = RestartEffect(marker, s)
    try:
        (x,) = (await post_json(a, hung_alert("gpu0", evidence_of(s))))["alerts"]
        assert (await wait_done(a, x["action"]))["outcome"] == "recovered"
    finally:
        await effect.stop()
    await a.close()  # the restarter goes away ...
    _, b = await restarter_client(config)  # ... and a new one starts
    sim.hang(s)  # the fresh server hangs again
    (y,) = (await post_json(b, hung_alert("gpu0", evidence_of(s), starts_at="2026-11-30T12:00:00Z")))["alerts"]
    action = await wait_done(b, y["action"])
    assert action["refusal"] == "budget_spent" and action["verification"]["state"] == "hung"
    assert effect.lines() == 1
    m = await metrics(b)
    assert sample(m, "llm_restarter_budget_exhausted", backend="gpu0") == 1
    assert sample(m, "llm_restarter_refusals_total", reason="budget_spent") == 1
    st = await status(b)
    assert st["backends"][0]["budget"] == "budget_spent" and st["backends"][0]["budget_exhausted"] is True
    assert st["refused"][0]["alertname"] == "LLMBackendHung"


async def test_raw_alert_on_one_replica_gets_the_evidence_from_the_other(sim_server, ticker, restarter_client, tmp_path, redis_url):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    config = make_config(marker_target("gpu0", s, marker), redis=shared(redis_url), raw_alert_hold=30.0, confirm_interval=0.2)
    _, a = await restarter_client(config)
    _, b = await restarter_client(config)
    effect = RestartEffect(marker, s)
    try:
        (raw,) = (await post_json(a, webhook_msteams(default_instance(s.url))))["alerts"]
        assert raw["decision"] == "accepted"
        (exp,) = (await post_json(b, hung_alert("gpu0", evidence_of(s))))["alerts"]
        assert exp["decision"] == "duplicate" and "another restarter replica" in exp["detail"]
        action = await wait_done(a, raw["action"])
    finally:
        await effect.stop()
    assert action["outcome"] == "recovered" and action["evidence"] == "handed over by LLMBackendHung"
    assert effect.lines() == 1


async def test_redis_down_refuses_to_act_and_status_says_so(sim_server, ticker, restarter_client, tmp_path, own_redis_server):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    config = make_config(marker_target("gpu0", s, marker), redis=shared(own_redis_server.url, timeout=1.0))
    _, a = await restarter_client(config)
    own_redis_server.stop()
    answer = await post_json(a, hung_alert("gpu0", evidence_of(s)))
    (x,) = answer["alerts"]
    assert x["decision"] == "state_unavailable" and answer["accepted"] == 0
    assert "password" not in json.dumps(answer)
    st = await status(a)
    assert st["backends"][0]["budget"] == "unknown" and "shared state unavailable" in st["backends"][0]["budget_error"]
    assert sample(await metrics(a), "llm_restarter_refusals_total", reason="state_unavailable") == 1
    assert not marker.exists()


async def test_an_alert_finished_between_the_look_and_the_claim_is_a_duplicate(sim_server, tmp_path, redis_url):
    """The interleaving a fresh-clone CI run hit on Cluster: replica B looks for the done
    key (absent), replica A then writes it and releases the lease, and B's claim succeeds.
    B must look again under the lease and call the alert a duplicate, not act twice."""
    server = await sim_server(scenario="hung")
    config = make_config(marker_target("gpu0", server, tmp_path / "marker"), redis=shared(redis_url))
    alert = parse_webhook(json.dumps(hung_alert("gpu0", "e"))).alerts[0]
    a = RedisState(config.targets, config.budget, config.redis)
    b = RedisState(config.targets, config.budget, config.redis)
    try:
        assert (await a.admit(alert)).decision == "accepted"
        assert await a.claim("gpu0") == (None, 0.0)
        claim = b.leases.claim

        async def a_finishes_first(*args, **kw):
            await a.finish("gpu0", alert.key, restarted=True)
            return await claim(*args, **kw)

        b.leases.claim = a_finishes_first  # type: ignore[method-assign]
        second = await b.admit(alert)
        assert (second.decision, second.detail) == ("duplicate", "this alert (fingerprint, startsAt) was already acted on")
        assert "gpu0" not in b.held
        # The lease B took for its second look is given back: a new hang can be acted on.
        b.leases.claim = claim  # type: ignore[method-assign]
        fresh = parse_webhook(json.dumps(hung_alert("gpu0", "e", starts_at="2026-12-01T00:00:00Z"))).alerts[0]
        assert (await b.admit(fresh)).decision == "accepted"
    finally:
        await a.close()
        await b.close()
