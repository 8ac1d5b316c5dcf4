"""The door's own figure of its engines' queue age (core.queue_age.door_age): the decision
script (store.scripts.DECIDE_LUA) keeps the route's requests in flight, sent and not yet
seen end, and reads the age of the oldest waiting one from them and the engines' waiting
and running counts the exporter publishes (`QueueKeys.engine_waiting`). A client that gives
up leaves the set at once, so the figure stays true where the counters' figure (vLLM counts
such a request nowhere) runs high. On a real redis-server and through the real gate."""

from __future__ import annotations

import asyncio
import json
import random
import time

import redis
from redis import asyncio as aioredis

from llm_health.core import admission
from llm_health.core.queue_age import acted_on, door_age, door_ahead, door_covers, door_running, door_wait, keep_until
from llm_health.gate.decision import _policy_args as ARGS
from llm_health.store.keys import QueueKeys
from llm_health.store.policy import Figures, Verdict
from llm_health.store.queue import AdmissionQueue, parse_decide
from llm_health.store.scripts import GAVE_UP_MS
from tests.integration.test_gate import post, stack  # noqa: F401  (the fixture)


async def test_the_script_and_the_reference_agree(redis_url):
    """Seeded cases: random requests in flight (some sent after the round's read), waiting
    and running counts over one to three backends; the script's figure and coverage are the
    Python reference's, to the millisecond, and so are the requests that must end before
    the new one starts (door_ahead). And a request past its deadline leaves the set."""
    rng = random.Random(48)
    client = aioredis.Redis.from_url(redis_url)
    q = AdmissionQueue(client, prefix=f"t{rng.randrange(10**9)}:")
    await q.load_scripts()
    try:
        for case in range(150):
            route, backends = f"r{case}", [f"b{case}-{i}" for i in range(rng.randint(1, 3))]
            now = int(time.time() * 1000)
            read = now - rng.randint(0, 3000)
            sent = [now - rng.randint(0, 20_000) for _ in range(rng.randint(0, 12))]
            counts = [(rng.randint(0, 6), rng.randint(0, 4)) for _ in backends]
            # what each runs when full: absent (an older exporter: R), 0 (not yet seen full:
            # nothing projected for the route), or the most it ran at once, at least R
            seen = [rng.choice([None, 0, r, r + rng.randint(0, 3)]) for _, r in counts]
            keys = q.keys
            pipe = client.pipeline(transaction=False)
            if sent:
                pipe.zadd(keys.route_inflight(route)[0], {f"x/{i}": t for i, t in enumerate(sent)})
            for b, (w, r), most in zip(backends, counts, seen):
                pipe.set(keys.engine_age(b), 5000)
                pipe.set(keys.engine_waiting(b), f"{w} {r} {read}" + ("" if most is None else f" {most}"))
            await pipe.execute()
            pipe = client.pipeline(transaction=False)
            policy = admission.Policy(expected_service_ms=rng.choice([0.0, 250.0, 4000.0]), reject_if_queue_age_ms_gte=rng.choice([3000.0, 30000.0]))
            q.pipe_decide(pipe, f"t/new-{case}", route, "t", now + 60_000, now, tenant_key=None, fingerprint=None, backends=backends, policy=ARGS(policy))
            got = parse_decide(f"t/new-{case}", (await pipe.execute())[0], now)
            # the running ones the figure skips: R, at least S where requests wait (door_running)
            running = sum(door_running(r, w, r if most is None else most) for (w, r), most in zip(counts, seen))
            held = sum(w + r for w, r in counts)
            sized = all(most != 0 for most in seen)
            slots = sum(r if most is None else most for (_, r), most in zip(counts, seen)) if sized else None
            assert got.door_age_ms == int(door_age(sent, running, read, now)), (case, sent, counts, read)
            assert got.door_covers == door_covers(sent, held, read), case
            assert (got.ahead, got.slots) == (door_ahead(sent, slots, held, got.door_covers), slots), (case, sent, counts, seen)
            # What the script decided on, and the decision: the reference's on the same figures.
            engine = acted_on(5000, got.door_age_ms, got.door_covers)
            wait = door_wait(got.ahead, got.slots, policy.expected_service_ms)
            want = Figures(int(engine or 0), 60_000, 0, None if engine is None else int(engine), None if wait is None else int(wait))
            assert got.figures == want, (case, got.figures, want)
            ref = admission.decide(admission.Request(want.queue_age_ms, 60_000, 0, wait_ms=want.wait_ms), policy)
            assert got.verdict == Verdict(ref.decision, ref.reason, ref.status, ref.retry_after_s, ref.retryable), case
            # The request itself joined the sets, sent now, until its end is heard or its
            # deadline plus its budget (keep_until: 60 s, a minute at most) has passed.
            assert await client.zscore(keys.route_inflight(route)[0], f"t/new-{case}") == now
            assert await client.zscore(keys.route_inflight(route)[1], f"t/new-{case}") == keep_until(now, now + 60_000, GAVE_UP_MS) == now + 120_000
            assert 60_000 < await client.pttl(keys.route_inflight(route)[0]) <= 120_000  # nothing outlives the traffic
        # A request whose end the door never heard of (a lost report) stays past its deadline,
        # as an admitted retry's copy waits in the engine past it, until its deadline plus its
        # own budget (keep_until: sent at now - 1000, deadline now + 50, so until now + 1100).
        route, now = "lost", int(time.time() * 1000)
        await client.set(q.keys.engine_waiting("lb"), f"1 0 {now}")
        assert keep_until(now - 1000, now + 50, GAVE_UP_MS) == now + 1100
        for rid, deadline in (("t/lost", now + 50), ("t/other", now + 60_000)):
            pipe = client.pipeline(transaction=False)
            q.pipe_decide(pipe, rid, route, "t", deadline, now - 1000, tenant_key=None, fingerprint=None, backends=["lb"], policy=ARGS(admission.Policy()))
            await pipe.execute()

        async def decide_at(rid: str, at: int) -> list[str]:
            pipe = client.pipeline(transaction=False)
            q.pipe_decide(pipe, rid, route, "t", at + 60_000, at, tenant_key=None, fingerprint=None, backends=["lb"], policy=ARGS(admission.Policy()))
            await pipe.execute()
            return [m.decode() for m in await client.zrange(q.keys.route_inflight(route)[0], 0, -1)]

        assert await decide_at("t/past", now + 1099) == ["t/lost", "t/other", "t/past"]  # past its deadline, in flight still
        assert await decide_at("t/next", now + 1100) == ["t/other", "t/past", "t/next"]
        # A budget longer than a minute keeps it a minute past its deadline, no more.
        assert keep_until(now, now + 300_000, GAVE_UP_MS) == now + 300_000 + GAVE_UP_MS
    finally:
        await q.aclose()


def publish(url: str, prefix: str, backend: str, age_ms: int, waiting: int, running: int) -> None:
    keys = QueueKeys(prefix)
    with redis.Redis.from_url(url) as r:
        r.set(keys.engine_age(backend), age_ms, px=60000)
        r.set(keys.engine_waiting(backend), f"{waiting} {running} {int(time.time() * 1000)}", px=60000)


async def until(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_client_that_gives_up_leaves_the_door_figure_at_once(stack, redis_url):  # noqa: F811
    """A request waits; its client gives up as another arrives. The counters' figure keeps
    the first one's age (published here as the exporter would: 61 s against a 60 s
    deadline); the gate acts on the age of the one really waiting and admits a fresh
    request. Requests the gate never sent (the engine holds more than it sent) bring the
    counters' figure back."""
    url, up, gate = await stack(routes={"chat": {"upstream": "UPSTREAM", "default_deadline_ms": 60_000, "backends": ["gpu-a"]}})
    prefix, keys = gate.cfg.queue_prefix, QueueKeys(gate.cfg.queue_prefix)
    up.delay = 120.0  # the engine holds every request
    publish(redis_url, prefix, "gpu-a", 0, 0, 0)

    def in_flight() -> list[str]:
        with redis.Redis.from_url(redis_url) as r:
            return [m.decode() for m in r.zrange(keys.route_inflight("chat")[0], 0, -1)]

    a = asyncio.create_task(post(url, {"X-Request-Id": "a"}))
    await until(lambda: len(up.calls) == 1, "a at the engine")
    assert in_flight() == ["default/a"]
    a.cancel()  # a's client gives up
    await until(lambda: in_flight() == [], "a's give-up seen by the gate")
    b = asyncio.create_task(post(url, {"X-Request-Id": "b"}))
    await until(lambda: len(up.calls) == 2, "b at the engine")
    await asyncio.sleep(0.3)
    publish(redis_url, prefix, "gpu-a", 61_000, 1, 0)  # the exporter's round: b waits; its counters still date a
    c = asyncio.create_task(post(url, {"X-Request-Id": "c"}))
    await until(lambda: len(up.calls) == 3, "c admitted and sent on")
    assert up.calls[2][0] == "c"
    await asyncio.sleep(0.3)  # c is older than the 50 ms of slack the last request (f) brings: a CI run got there in less
    # The engine holds four where the gate sent two (b, c) and one client gave up (a, which
    # the engine may hold until it notices): something bypasses the gate, and only the
    # counters see it: the larger figure stands, theirs here (the door's is b's).
    publish(redis_url, prefix, "gpu-a", 50_000, 4, 0)
    status, body, headers = await post(url, {"X-Request-Id": "d", "X-Request-Timeout-Ms": "50"})
    err = json.loads(body)["error"]
    assert (status, err["code"], headers["x-queue-age-ms"]) == (422, "reject_age_beats_slack", "50000"), body
    publish(redis_url, prefix, "gpu-a", 50_000, 2, 0)  # the two it sent are all it holds: the door's figure
    status, body, headers = await post(url, {"X-Request-Id": "e", "X-Request-Timeout-Ms": "50"})
    assert status == 422 and 300 <= int(headers["x-queue-age-ms"]) < 50_000, body
    # The exporter reads the engine holding b and c; then b's client gives up. Until the
    # engine aborts b (vLLM notices a closed stream only between steps), it holds one more
    # than the gate has in flight: b is counted as ended since the read, not as a bypass.
    publish(redis_url, prefix, "gpu-a", 50_000, 2, 0)
    b.cancel()
    await until(lambda: in_flight() == ["default/c"], "b's give-up seen by the gate")
    status, body, headers = await post(url, {"X-Request-Id": "f", "X-Request-Timeout-Ms": "50"})
    assert status == 422 and int(headers["x-queue-age-ms"]) < 50_000, body  # c's age, the door's figure
    c.cancel()
    await asyncio.gather(b, c, return_exceptions=True)
    await until(lambda: in_flight() == [], "every give-up seen")


async def test_a_burst_sent_since_the_read_is_in_the_projected_wait(stack, redis_url):  # noqa: F811
    """With expected_service_ms set, the gate projects a request's wait from the requests
    that must end before it starts: five in flight, sent after the exporter's last read
    showed an idle engine, then a read of two running: 5 - 2 + 1 = 4 ahead at 1000 ms on 2
    sequences, 2000 ms. The head's age (the third oldest's, milliseconds) admits a request
    with 2.5 s left; its wait plus its service refuses it (reject_wait_beats_slack,
    `expected_wait_ms` in the body). One with time to spare is admitted."""
    routes = {"chat": {"upstream": "UPSTREAM", "default_deadline_ms": 60_000, "backends": ["gpu-a"], "expected_service_ms": 1000}}
    url, up, gate = await stack(routes=routes, admission={"reject_if_queue_age_ms_gte": 600_000})
    prefix = gate.cfg.queue_prefix
    up.delay = 120.0  # the engine holds every request
    publish(redis_url, prefix, "gpu-a", 0, 0, 0)
    held = [asyncio.create_task(post(url, {"X-Request-Id": f"r{i}"})) for i in range(5)]
    try:
        await until(lambda: len(up.calls) == 5, "five at the engine")
        publish(redis_url, prefix, "gpu-a", 0, 3, 2)
        status, body, _ = await post(url, {"X-Request-Id": "tight", "X-Request-Timeout-Ms": "2500"})
        err = json.loads(body)["error"]
        assert (status, err["code"], err["expected_wait_ms"]) == (422, "reject_wait_beats_slack", 2000), body
        assert err["queue_age_ms"] < 1000, body  # the head's age alone would have admitted it
        assert "projected wait 2000 ms + expected service 1000 ms" in err["message"], body
        loose = asyncio.create_task(post(url, {"X-Request-Id": "loose", "X-Request-Timeout-Ms": "30000"}))
        await until(lambda: len(up.calls) == 6, "the request with time to spare admitted")
        held.append(loose)
    finally:
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
