"""The restarter's quick confirmation: an alert's evidence (the progress digests the
exporter proved hung) against two fresh reads of a simulated server on loopback; the
hold of a raw-layer alert for the exporter's; refusals that name their alert.

The full 60 s check is never wanted on these paths: the restarter here is given a
verifier that fails the test if it runs, unless the test expects the fallback.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llm_health.config.restarter import default_instance
from llm_health.core import engines
from llm_health.core.evidence import progress_digest
from llm_health.sim import servers as sim
from tests.fixtures.restarter import RestartEffect, make_config, marker_target, metrics, post_json, sample, status, wait_done
from tests.fixtures.webhooks import webhook_2447, webhook_msteams


def evidence_of(server: sim.SimServer, engine: str | None = None) -> str:
    """What the alert's `evidence` annotation would hold for this server right now."""
    reading = engines.read(server.payload())
    return " ".join(str(progress_digest(reading.profile, reading.start_time, e)) for e in reading.engines.values() if engine is None or e.engine == engine)


def hung_alert(backend: str, evidence: str, starts_at: str | None = None) -> dict:
    body = webhook_2447(backend=backend, starts_at=starts_at)
    body["alerts"][0]["annotations"] = {"summary": "hung", "evidence": evidence}
    return body


class NoFullCheck:
    def __init__(self):
        self.calls = 0

    async def __call__(self, target):
        self.calls += 1
        return {"state": "unknown", "reason": "the full check ran"}


async def test_evidence_confirmed_by_two_reads_restarts_without_the_full_check(sim_server, ticker, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    full = NoFullCheck()
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), confirm_interval=0.3), verifier=full)
    effect = RestartEffect(marker, s)
    try:
        reads = s.metrics_reads
        (a,) = (await post_json(client, hung_alert("gpu0", evidence_of(s))))["alerts"]
        action = await wait_done(client, a["action"])
    finally:
        await effect.stop()
    assert action["outcome"] == "recovered" and full.calls == 0
    v = action["verification"]
    assert (v["method"], v["state"], v["reads"], v["digests"]) == ("evidence", "hung", 2, 1)
    assert "unchanged since the alert's evidence" in v["reason"]
    assert action["evidence"] == "alert"
    # two confirming reads, the recovery monitor's baseline, then the recovery reads
    assert s.metrics_reads - reads >= 3 and s.completions_while_busy() == []
    assert action["verified_at"] <= action["command_started_at"] <= action["command_ended_at"] <= action["recovered_at"]


@pytest.mark.parametrize("change", ["progress", "restart", "sleep", "new_request"])
async def test_anything_that_moved_since_the_evidence_is_not_hung(sim_server, ticker, restarter_client, tmp_path, change):
    s = await sim_server(scenario="hung")
    evidence = evidence_of(s)
    if change == "progress":  # the engine took steps after all: a slow engine, not a hung one
        sim.batch_job(s, running=4, tokens_per_second=20)
        ticker.append(s)
    elif change == "restart":  # someone restarted it meanwhile
        s.restart()
        sim.hang(s)
    elif change == "sleep":
        sim.sleep(s)
    else:
        s.engines[0].waiting += 1
    marker = tmp_path / "marker"
    full = NoFullCheck()
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), confirm_interval=0.3), verifier=full)
    (a,) = (await post_json(client, hung_alert("gpu0", evidence)))["alerts"]
    action = await wait_done(client, a["action"])
    assert action["refusal"] == "not_hung" and action["outcome"] is None and not marker.exists()
    assert action["verification"]["method"] == "evidence" and full.calls == 0
    refused = (await status(client))["refused"][0]
    assert (refused["reason"], refused["alertname"], refused["backend"], refused["action"]) == ("not_hung", "LLMBackendHung", "gpu0", a["action"])
    assert s.completions_while_busy() == []


async def test_movement_between_the_two_reads_is_caught(sim_server, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    evidence = evidence_of(s)
    marker = tmp_path / "marker"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), confirm_interval=1.0), verifier=NoFullCheck())
    (a,) = (await post_json(client, hung_alert("gpu0", evidence)))["alerts"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while s.metrics_reads < 1 and loop.time() < deadline:  # the first read is in
        await asyncio.sleep(0.01)
    s.engines[0].running += 1  # a new request got scheduled before the second read
    action = await wait_done(client, a["action"])
    assert action["refusal"] == "not_hung" and "second read" in action["verification"]["reason"]
    assert not marker.exists()


async def test_idle_evidence_is_one_more_probe(sim_server, ticker, restarter_client, tmp_path):
    """Proven hung through failed probes (nothing in flight): `none` as evidence. Idle
    still and one more probe fails: restart. Idle and the probe answers: refused."""
    s = await sim_server(scenario="idle")
    s.probe_hangs = True
    marker = tmp_path / "marker"
    config = make_config(marker_target("gpu0", s, marker))
    _, client = await restarter_client(config, verifier=NoFullCheck())
    effect = RestartEffect(marker, s)
    try:
        (a,) = (await post_json(client, hung_alert("gpu0", "none")))["alerts"]
        ticker.append(s)
        action = await wait_done(client, a["action"])
        s.probe_hangs = False
        assert action["outcome"] == "recovered" and action["verification"]["probes_sent"] == 1
        (b,) = (await post_json(client, hung_alert("gpu0", "none", starts_at="2026-11-30T10:00:00Z")))["alerts"]
        again = await wait_done(client, b["action"])
    finally:
        await effect.stop()
    assert again["refusal"] == "not_hung" and "probe answered" in again["verification"]["reason"]


@pytest.mark.parametrize("evidence", ["12 banana", "1" * 16, ""])
async def test_unusable_evidence_falls_back_to_the_full_check(sim_server, ticker, restarter_client, tmp_path, evidence):
    s = await sim_server(scenario="batch")  # busy: the full check says so
    ticker.append(s)
    marker = tmp_path / "marker"
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker)))
    (a,) = (await post_json(client, hung_alert("gpu0", evidence)))["alerts"]
    action = await wait_done(client, a["action"])
    assert action["verification"]["method"] == "full_check" and action["refusal"] == "not_hung"
    assert not marker.exists() and s.completions_while_busy() == []


async def test_raw_alert_waits_for_the_exporters_evidence(sim_server, ticker, restarter_client, tmp_path):
    """VLLMEngineHung first (the raw layer), then LLMBackendHung for the same hang: one
    action, confirmed with the evidence the second alert brought, one restart."""
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    full = NoFullCheck()
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), raw_alert_hold=30.0, confirm_interval=0.2), verifier=full)
    effect = RestartEffect(marker, s)
    try:
        (raw,) = (await post_json(client, webhook_msteams(default_instance(s.url))))["alerts"]
        assert raw["decision"] == "accepted"
        assert next(x for x in (await status(client))["actions"] if x["id"] == raw["action"])["phase"] == "holding"
        (exp,) = (await post_json(client, hung_alert("gpu0", evidence_of(s))))["alerts"]
        assert exp["decision"] == "duplicate" and "handed to that action" in exp["detail"]
        action = await wait_done(client, raw["action"])
    finally:
        await effect.stop()
    assert action["outcome"] == "recovered" and action["evidence"] == "handed over by LLMBackendHung"
    assert action["verification"]["method"] == "evidence" and full.calls == 0
    assert Path(marker).read_text().count("restart") == 1
    m = await metrics(client)
    assert sample(m, "llm_restarter_restarts_total", backend="gpu0", outcome="recovered") == 1


async def test_raw_alert_alone_gets_the_full_check_after_the_hold(sim_server, ticker, restarter_client, tmp_path):
    s = await sim_server(scenario="hung")
    ticker.append(s)
    marker = tmp_path / "marker"
    full = NoFullCheck()
    _, client = await restarter_client(make_config(marker_target("gpu0", s, marker), raw_alert_hold=0.5), verifier=full)
    (raw,) = (await post_json(client, webhook_msteams(default_instance(s.url))))["alerts"]
    action = await wait_done(client, raw["action"])
    assert full.calls == 1 and action["evidence"] is None and action["refusal"] == "not_hung"
