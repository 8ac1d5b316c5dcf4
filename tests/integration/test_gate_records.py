"""The record of every attempt is finished: when Redis stalls after the answer (sent again,
bounded, counted when given up), when the client drops a stream (its attempt and the
token units the engine had reported), and never twice for one attempt. A real gate, a
real redis-server (stalled with SIGSTOP, as a stuck or swapping Redis is), upstreams on
loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
from aiohttp import web

from llm_health.config.gate import parse_gate_config
from llm_health.gate import decision
from llm_health.gate.decision import Admission
from llm_health.store.queue import AdmissionQueue
from tests.integration.test_gate import deadline_in, post, recorded, stack  # noqa: F401  (the fixture)


class Stalled:
    """A redis-server stopped with SIGSTOP until the block ends (SIGCONT, whatever happens)."""

    def __init__(self, server):
        self.pid = server.proc.pid

    def __enter__(self) -> Stalled:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


async def until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return value


async def stalled_after_admission(stack, server, until_metric: str):  # noqa: F811
    """A request admitted and recorded; Redis stalled once the upstream has it (admission is
    behind it) and kept stalled, past redis-py's own retries, until the gate's counter
    ``until_metric`` moved; the answer read meanwhile."""
    url, up, gate = await stack(redis=server.url)
    up.delay = 0.3
    task = asyncio.ensure_future(post(url, {"X-Request-Id": "stalled-1", **deadline_in(60000)}))
    await until(lambda: up.calls, what="the upstream to get the request")
    with Stalled(server):
        status, body, _ = await task
        assert status == 200, body  # the answer never waits for the record
        moved = await until(lambda: gate.registry.get_sample_value(until_metric), timeout=60, what=until_metric)
    return gate, moved


async def test_a_redis_stall_after_the_answer_leaves_no_record_running(stack, own_redis_server):  # noqa: F811
    gate, retries = await stalled_after_admission(stack, own_redis_server, "llm_gate_record_retries_total")
    assert retries >= 1
    rec = await recorded(own_redis_server.url, gate.cfg.queue_prefix, "stalled-1", timeout=30)
    assert rec is not None and rec.state == "done" and rec.attempts == 1 and rec.http_status == 200, rec
    assert rec.token_units == 272  # the upstream's usage.total_tokens, counted once
    assert gate.registry.get_sample_value("llm_gate_records_given_up_total") == 0


async def test_a_stall_past_the_retries_is_given_up_and_counted(stack, own_redis_server, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setattr(decision, "FINISH_RETRY_S", (0.05, 0.05))
    gate, lost = await stalled_after_admission(stack, own_redis_server, "llm_gate_records_given_up_total")
    assert lost == 1 and gate.registry.get_sample_value("llm_gate_record_retries_total") == 2
    gave_up = [r for r in caplog.records if "gave up recording the attempt of stalled-1" in r.getMessage()]
    assert len(gave_up) == 1 and gave_up[0].exc_info is None


async def test_an_attempt_recorded_twice_counts_once(own_redis_server):
    """The finish is sent again when Redis did not answer in time, and the first copy may
    have run: the attempt, its token units and the tenant's spend count once."""
    cfg = parse_gate_config(
        {
            "gate": {
                "redis": own_redis_server.url,
                "routes": {"chat": {"upstream": "http://127.0.0.1:1", "default_deadline_ms": 30000}},
                "tenants": {"acme": {"token_units_per_minute": 1000}},
            }
        }
    )
    adm = Admission(cfg)
    try:
        out = await adm.decide("POST", "/v1/completions", {"X-Request-Id": "twice", "X-Tenant": "acme"})
        assert out.admitted and out.attempt is not None
        assert await adm.finish(out.attempt, 200, 40)
        assert await adm.finish(out.attempt, 200, 40)
        rec = await adm.queue.read("acme/twice")
        assert rec is not None and rec.attempts == 1 and rec.token_units == 40 and rec.state == "done"
        assert int(await adm.redis.get(adm._tenant_key("acme"))) == 40
        # A second attempt of the same id (a retry) is a new attempt id: counted.
        again = await adm.decide("POST", "/v1/completions", {"X-Request-Id": "twice", "X-Tenant": "acme", "X-Request-Timeout-Ms": "30000"})
        assert again.attempt is not None and again.attempt.attempt_id != out.attempt.attempt_id
    finally:
        await adm.stop()


def usage_chunk(i: int) -> bytes:  # vLLM with stream_options.continuous_usage_stats: usage on every chunk
    usage = {"prompt_tokens": 10, "completion_tokens": i, "total_tokens": 10 + i}
    return f"data: {json.dumps({'choices': [{'delta': {'content': f't{i}'}}], 'usage': usage})}\n\n".encode()


async def test_a_dropped_stream_records_its_attempt_and_the_tokens_reported(own_redis_server, tmp_path):
    from tests.integration.test_gate import serve

    sent = []

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1, 200):
            await resp.write(usage_chunk(i))
            sent.append(i)
            await asyncio.sleep(0.02)
        return resp

    up = web.Application()
    up.router.add_post("/v1/chat/completions", stream)
    up_runner, up_url = await serve(up, handler_cancellation=True)
    cfg = parse_gate_config({"gate": {"redis": own_redis_server.url, "routes": {"chat": {"upstream": up_url, "default_deadline_ms": 30000}}}})
    from llm_health.gate.app import Gate

    gate = Gate(cfg)
    runner, url = await serve(gate.app(), handler_cancellation=True)
    try:
        read = b""
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json={"model": "m", "stream": True}, headers={"X-Request-Id": "dropped-1"}) as r:
                while read.count(b"\n\n") < 5:
                    read += await r.content.readany()
        rec = await recorded(own_redis_server.url, cfg.queue_prefix, "dropped-1")
        assert rec is not None and rec.state == "done" and rec.attempts == 1 and rec.http_status == 499, rec
        # What the engine had reported when the client left: at least what the client read,
        # at most what the engine sent.
        assert 10 + 5 <= rec.token_units <= 10 + max(sent), (rec.token_units, len(sent))
    finally:
        await runner.cleanup()
        await up_runner.cleanup()


async def not_running(redis_url: str, prefix: str, ids: list[str], admission: Admission | None = None, settle_s: float = 15.0) -> dict[str, object]:
    """The ids' records once the door's background writes are done (``admission``, in this
    process) or, for a door in another process, once each is done or ``settle_s`` passed:
    a record still `running` then is one no write will ever finish."""
    q = AdmissionQueue.from_url(redis_url, prefix=prefix)
    try:
        if admission is not None:
            await until(lambda: not admission._pending, timeout=60, what="the door's background writes")
        deadline = time.monotonic() + settle_s
        while True:
            recs = {i: await q.read(f"default/{i}") for i in ids}
            if admission is not None or time.monotonic() > deadline or all(r is not None and r.state == "done" for r in recs.values()):
                return recs
            await asyncio.sleep(0.05)
    finally:
        await q.aclose()


async def test_an_enqueue_run_late_by_a_stall_leaves_no_record_running(stack, own_redis_server):  # noqa: F811
    """Redis SIGSTOPped before the requests, for longer than the gate waits: their enqueues
    are sent and time out, a route failing open admits (`admit_unrecorded`), one failing
    closed refuses; Redis resumes only after both answers and runs the enqueues then (the
    issue saw such records left `running` for good, `attempts: 0`, in 5 of 6 runs). The
    gate finishes both once Redis answers, and once more after: no record `running`."""
    routes = {"open": {"upstream": "UPSTREAM", "default_deadline_ms": 30000, "redis_down": "open"}}
    routes["shut"] = {"upstream": "UPSTREAM", "default_deadline_ms": 30000, "redis_down": "closed"}
    url, _, gate = await stack(redis=own_redis_server.url, routes=routes)
    # Scripts loaded (the late EVALSHAs run) and connections open in the pool (an enqueue
    # on a new one would wait for its handshake, and never be sent).
    warm = await asyncio.gather(*(post(url, {"X-Request-Id": f"warm-{i}", "X-Route": "open"}) for i in range(8)))
    assert all(w[0] == 200 for w in warm)
    with Stalled(own_redis_server):
        opened = await post(url, {"X-Request-Id": "late-open", "X-Route": "open", **deadline_in(60000)})
        shut = await post(url, {"X-Request-Id": "late-shut", "X-Route": "shut", **deadline_in(60000)})
    assert opened[0] == 200 and opened[2]["X-LLM-Health-Decision"] == "admit_unrecorded", opened
    assert shut[0] == 503, shut
    recs = await not_running(own_redis_server.url, gate.cfg.queue_prefix, ["late-open", "late-shut"], gate.admission)
    print(f"records after the stall: { {i: r and r.state for i, r in recs.items()} }")
    assert all(r is None or r.state == "done" for r in recs.values()), recs
    assert recs["late-open"] is None or (recs["late-open"].attempts == 1 and recs["late-open"].http_status == 200), recs
    assert recs["late-shut"] is None or (recs["late-shut"].attempts == 0 and recs["late-shut"].http_status == 503), recs


async def test_late_attempts_followed_are_bounded(own_redis_server, monkeypatch):
    """docs/admission.md: at most LATE_PENDING_MAX background writes pending; a late
    attempt past it is not followed, and is counted as given up."""
    monkeypatch.setattr(decision, "LATE_PENDING_MAX", 0)
    cfg = parse_gate_config({"gate": {"redis": own_redis_server.url, "routes": {"chat": {"upstream": "http://127.0.0.1:1", "default_deadline_ms": 30000}}}})
    adm = Admission(cfg)
    try:
        adm.finish_later(decision.Attempt("x", "default/x", "chat", "default", 0, False, late=True), 200)
        assert not adm._pending and adm.registry.get_sample_value("llm_gate_records_given_up_total") == 1
    finally:
        await adm.stop()
