"""What each admission door adds, side by side in one run: direct; `llm-health gate`;
nginx alone, nginx with `auth_request` to `llm-health decide` and nginx deciding itself
with its Lua module (the shipped deploy/nginx files, the Lua door's written by
`llm-health nginx-lua`); LiteLLM alone and LiteLLM with the llm-health callback (the shipped
deploy/litellm files, LiteLLM 1.106.12 from .ci/install-litellm.sh).

Every path ends at the same OpenAI-compatible engine on loopback, which answers a chat
completion at once (with `usage`), so what is measured is the door. The doors use one real
redis-server and one gate configuration (route `chat`, model `llama`). Each request
carries its own `X-Request-Id`.

This process (the load generator) runs on CPU 0; every server it starts on the other
CPUs, so the generator does not take the cores the doors run on (on a 2-core machine the
servers share CPU 1). Open loop at each rate (default 100 and 500 requests/s), each path
in six interleaved parts, so machine noise hits them alike: latency p50/p99, what each
door adds over its baseline (the gate over direct, the nginx door over nginx alone, the
LiteLLM hook over LiteLLM alone), answers other than 200, errors, and the CPU time per
request of the path's server processes (its door, Redis where it asks Redis, the engine),
also by process. One LiteLLM process serves about 100 requests/s on one core, so the
LiteLLM paths run at their own rates (default 25 and 50 requests/s, direct beside them).
Then closed loop (64 clients) for each path's ceiling, 12 s a path in six interleaved parts too
(at 3 s a path the ceilings' ratios swung by a third from run to run).

The calibration figure is prometheus_client's parse of the 45 KB vLLM payload
(tests/data/real-world/metrics/vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom), best
of 7, in ms: runs on machines of different speed compare through it.

    python -m bench.bench_admission [--rates 100,500] [--litellm-rates 25,50] [--seconds 12] [--closed-seconds 12] [--rounds 6] [--no-litellm]

Goals, judged at 500 requests/s (a run that did not reach that rate for a path prints
NOT RUN for its goals): the gate and the nginx door each add under 1 ms at p50 and p99 over
their baseline; the LiteLLM hook under 0.5 ms over LiteLLM alone, judged at 50 requests/s
(one LiteLLM process does not reach 500 requests/s on one core: its closed-loop ceiling,
in the same run, is near 150; at 50 it is a third of that, as 500 is for the others'
ceilings or less); the gate and the nginx doors keep at
least half of their baseline's ceiling; `decide`'s CPU per request is at most nginx's own
per proxied request, the gate's at most twice it. The Lua door (nginx+lua) adds under
0.5 ms at p50 and 1 ms at p99 over nginx alone, and its CPU per request (what its nginx
spends over nginx alone's, per request) is at most nginx's own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
import timeit
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from tests.fixtures import litellm as litellm_fixture
from tests.fixtures.nginx import Nginx, NginxLua
from tests.fixtures.redis_server import RedisServer
from tests.harness.processes import free_port

from bench._goal import added_latency, goal_line, not_run, printed
from bench._machine import machine_line
from bench._processes import cpu_seconds, decide_args, engine_process, gate_config, llm_health, pin, split_cpus, wait_port
from bench._stats import percentile
from bench._unjudged import failed_line

ROOT = Path(__file__).resolve().parents[1]
CALIBRATION_PAYLOAD = ROOT / "tests" / "data" / "real-world" / "metrics" / "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom"
GOAL_ADDED_P99_MS = {"gate": 1.0, "nginx+door": 1.0, "nginx+lua": 1.0, "litellm+hook": 0.5}
GOAL_ADDED_P50_MS = {"nginx+lua": 0.5}  # where the p50's goal is below the p99's
GOAL_CEILING_RATIO = 0.5
ROUNDS = 6  # each path's seconds in this many interleaved parts (open loop and closed)
GOAL_RATE = 500.0  # every door's latency and CPU goals are judged at this rate, or print NOT RUN
# ... except the LiteLLM hook's latency: one LiteLLM process tops out near 150 requests/s here
GOAL_RATES = {"litellm+hook": 50.0}
GOAL_DECIDE_CPU_RATIO = 1.0  # decide's CPU per request against nginx's own per proxied request
GOAL_GATE_CPU_RATIO = 2.0
GOAL_LUA_CPU_RATIO = 1.0  # the Lua door's CPU (nginx+lua's nginx less nginx alone's) against nginx's own
LUA_DOOR = "the Lua door"  # its CPU per request: what nginx spends with the Lua door over nginx alone
BASELINE = {"gate": "direct", "nginx+door": "nginx", "nginx+lua": "nginx", "litellm": "direct", "litellm+hook": "litellm"}
BODY = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
REPLY = {
    "id": "c1",
    "object": "chat.completion",
    "created": 1,
    "model": "llama",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
}


def parse_calibration_ms() -> float:
    text = CALIBRATION_PAYLOAD.read_text()
    timer = timeit.Timer(lambda: list(text_string_to_metric_families(text)))
    number, _ = timer.autorange()
    return min(timer.repeat(repeat=7, number=number)) / number * 1000


def engine_proc(port: int) -> None:
    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(REPLY)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- load --------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    pids: dict[str, int]  # the path's server processes by role: door, redis, engine
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    lat: list[float] = field(default_factory=list)
    not_ok: int = 0  # answered, not 200
    errors: int = 0  # no answer (connection error, timeout)
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds by role

    @property
    def sent(self) -> int:
        return len(self.lat) + self.not_ok + self.errors

    @property
    def failed(self) -> int:
        return self.not_ok + self.errors

    def cpu_ms_per_request(self, role: str | None = None) -> float:
        seconds = sum(self.cpu.values()) if role is None else self.cpu.get(role, 0.0)
        return seconds / max(self.sent, 1) * 1000


async def open_loop(session: aiohttp.ClientSession, path: Target, rate: float, seconds: float, run: Run, tag: str) -> None:
    async def one(i: int) -> None:
        t = time.perf_counter()
        try:
            async with session.post(path.url, json=BODY, headers={**path.headers, "X-Request-Id": f"{tag}-{i}"}) as r:
                await r.read()
                if r.status != 200:  # a failed request's time is in no latency figure
                    run.not_ok += 1
                    return
        except (aiohttp.ClientError, TimeoutError):
            run.errors += 1
            return
        run.lat.append(time.perf_counter() - t)

    cpu0 = {role: cpu_seconds(pid) for role, pid in path.pids.items()}
    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    for role, pid in path.pids.items():
        run.cpu[role] = run.cpu.get(role, 0.0) + cpu_seconds(pid) - cpu0[role]


async def closed_loop(session: aiohttp.ClientSession, path: Target, concurrency: int, seconds: float, tag: str = "") -> tuple[float, int]:
    """(200 answers per second, other answers and errors): the clients start no request
    after `seconds`, and the rate is over the time until the last of them is answered."""
    ok = bad = 0
    start = time.perf_counter()
    stop = start + seconds

    async def worker(w: int) -> None:
        nonlocal ok, bad
        i = 0
        while time.perf_counter() < stop:
            try:
                async with session.post(path.url, json=BODY, headers={**path.headers, "X-Request-Id": f"closed{tag}-{path.name}-{w}-{i}"}) as r:
                    await r.read()
                    ok, bad = (ok + 1, bad) if r.status == 200 else (ok, bad + 1)
            except (aiohttp.ClientError, TimeoutError):
                bad += 1
            i += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return ok / (time.perf_counter() - start), bad


Runs = list[tuple[float, dict[str, Run]]]  # (rate, the runs of the paths measured at it), in the order run


async def measure(plan: list[tuple[float, list[Target]]], seconds: float, closed_seconds: float, concurrency: int, rounds: int = ROUNDS) -> tuple[Runs, dict]:
    """`plan`: (rate, the paths measured at it), in order. (the runs, ceilings by path).
    Each path's seconds, open loop and closed, in `rounds` interleaved parts: a drift of the
    machine over the run hits every path alike."""
    paths = list({p.name: p for _, group in plan for p in group}.values())
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), timeout=timeout) as s:
        for p in paths:  # warm up connections, scripts and the doors' first-request work
            await open_loop(s, p, 50, 1, Run(), f"warm-{p.name}")
        runs: Runs = []
        for rate, group in plan:
            runs.append((rate, {p.name: Run() for p in group}))
            for part in range(rounds):
                for p in group:
                    await open_loop(s, p, rate, seconds / rounds, runs[-1][1][p.name], f"r{rate:g}-{p.name}-{part}-{time.time_ns()}")
        done: dict[str, tuple[float, int]] = {p.name: (0.0, 0) for p in paths}
        for part in range(rounds):
            for p in paths:
                answered, bad = await closed_loop(s, p, concurrency, closed_seconds / rounds, f"{part}-{time.time_ns()}")
                done[p.name] = (done[p.name][0] + answered / rounds, done[p.name][1] + bad)
        ceilings = done
    return runs, ceilings


def ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000 if values else float("nan")


def report(runs: Runs, ceilings: dict) -> list[str]:
    lines = [
        f"{'path':<13} {'req/s':>5} {'sent':>7} {'non-200':>7} {'errors':>6} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'+p50 ms':>8} {'+p99 ms':>8} {'over':<8} {'CPU ms/req':>10}"
    ]
    for rate, group in runs:
        for name, run in group.items():
            base = BASELINE.get(name)
            if base in group:
                b = group[base].lat
                added = f"{ms(run.lat, 50) - ms(b, 50):>8.2f} {ms(run.lat, 99) - ms(b, 99):>8.2f} {base:<8}"
            else:
                added = f"{'':>8} {'':>8} {'':<8}"
            lines.append(
                f"{name:<13} {rate:>5g} {run.sent:>7} {run.not_ok:>7} {run.errors:>6} {ms(run.lat, 50):>7.2f} {ms(run.lat, 99):>7.2f} "
                f"{added} {run.cpu_ms_per_request():>10.2f}"
            )
    lines.append("")
    lines.append("CPU ms per request by process, at each path's highest rate:")
    for name in ceilings:
        rate, run = max((rate, group[name]) for rate, group in runs if name in group)
        lines.append(f"  {name:<13} " + ", ".join(f"{role} {run.cpu_ms_per_request(role):.2f}" for role in run.cpu) + f" ({rate:g} req/s)")
    lines.append("")
    lines.append(f"{'path':<13} {'ceiling req/s':>13} {'non-200+errors':>14} {'ratio to baseline':>18}")
    for name, (ceiling, bad) in ceilings.items():
        base = BASELINE.get(name)
        ratio = f"{ceiling / ceilings[base][0]:.2f} ({base})" if base in ceilings and ceilings[base][0] else ""
        lines.append(f"{name:<13} {ceiling:>13.0f} {bad:>14} {ratio:>18}")
    return lines


def failures(runs: dict[str, Run]) -> str:
    """How many requests of each of `runs` failed (not 200, or no answer); empty if none."""
    return ", ".join(f"{name} {run.failed} of {run.sent} requests failed" for name, run in runs.items() if run.failed)


def goals(runs: Runs, ceilings: dict) -> list[str]:
    """Each door's goals, judged at GOAL_RATE only (GOAL_RATES for LiteLLM's latency; NOT
    RUN where the run did not reach it):
    the added latency from matched quantiles of interleaved parts (bench/_goal.py), the
    ceiling against its baseline's, and the CPU per request of the decision (`decide`) and of
    the gate against nginx's own per proxied request in the same run. Each ratio is printed
    in a line of its own above the goal lines, and judged as printed."""
    out, lines = [], []
    at_goal = next((group for rate, group in runs if rate == GOAL_RATE), {})
    highest = {name: max(rate for rate, group in runs if name in group) for _, group in runs for name in group}
    for name, goal in GOAL_ADDED_P99_MS.items():
        base, rate = BASELINE[name], GOAL_RATES.get(name, GOAL_RATE)
        at_rate = next((group for r, group in runs if r == rate and name in group), {})
        p50_goal = GOAL_ADDED_P50_MS.get(name)
        under = f"under {goal:g} ms at p50 and p99" if p50_goal is None else f"under {p50_goal:g} ms at p50 and under {goal:g} ms at p99"
        text = f"{name} adds {under} at {rate:g} requests/s over {base}, every answer 200"
        if name not in at_rate or base not in at_rate:
            why = f"highest rate measured: {highest[name]:g} requests/s" if name in highest else "not measured in this run"
            out.append(not_run(text, why))
            continue
        run, b = at_rate[name], at_rate[base].lat
        if failed := failures({n: at_rate[n] for n in (name, base)}):
            out.append(failed_line(text, failed))
            continue
        if p50_goal is None:
            measured, met = added_latency(ms(run.lat, 50) - ms(b, 50), ms(run.lat, 99) - ms(b, 99), goal)
        else:
            measured, met = added_latency(ms(run.lat, 50) - ms(b, 50), ms(run.lat, 99) - ms(b, 99), p50_goal, goal)
        out.append(goal_line(text, f"{measured}, 0 not 200", met))
    for name in ("gate", "nginx+door", "nginx+lua"):
        base = BASELINE[name]
        text = f"{name} keeps at least {GOAL_CEILING_RATIO:g} of {base}'s ceiling"
        if name not in ceilings or base not in ceilings or not ceilings[base][0]:
            out.append(not_run(text, "no ceiling measured"))
            continue
        if bad := [f"{n} {ceilings[n][1]}" for n in (name, base) if ceilings[n][1]]:
            out.append(failed_line(text, f"requests failed in the closed loop: {', '.join(bad)}"))
            continue
        ratio = printed(ceilings[name][0] / ceilings[base][0])
        out.append(goal_line(text, f"ratio {ratio:.2f}", ratio >= GOAL_CEILING_RATIO))
    for name, role, limit in (("nginx+door", "decide", GOAL_DECIDE_CPU_RATIO), ("gate", "gate", GOAL_GATE_CPU_RATIO)):
        text = f"{role}'s CPU per request at most {limit:g}x nginx's own per proxied request, at {GOAL_RATE:g} requests/s"
        if name not in at_goal or "nginx" not in at_goal:
            out.append(not_run(text, f"no {name} and nginx runs at {GOAL_RATE:g} requests/s"))
            continue
        if failed := failures({n: at_goal[n] for n in (name, "nginx")}):
            out.append(failed_line(text, failed))
            continue
        mine, theirs = printed(at_goal[name].cpu_ms_per_request(role), 3), printed(at_goal["nginx"].cpu_ms_per_request("nginx"), 3)
        if not theirs:
            out.append(not_run(text, "nginx's CPU per request read 0.000 ms (too few requests to count)"))
            continue
        ratio = printed(mine / theirs)
        lines.append(f"CPU per request at {GOAL_RATE:g} req/s: {role} {mine:.3f} ms / nginx {theirs:.3f} ms = {ratio:.2f}")
        out.append(goal_line(text, f"{ratio:.2f}x ({role} {mine:.3f} ms, nginx {theirs:.3f} ms)", ratio <= limit))
    text = f"{LUA_DOOR}'s CPU per request at most {GOAL_LUA_CPU_RATIO:g}x nginx's own per proxied request, at {GOAL_RATE:g} requests/s"
    if "nginx+lua" not in at_goal or "nginx" not in at_goal:
        out.append(not_run(text, f"no nginx+lua and nginx runs at {GOAL_RATE:g} requests/s"))
    elif failed := failures({n: at_goal[n] for n in ("nginx+lua", "nginx")}):
        out.append(failed_line(text, failed))
    else:
        theirs = printed(at_goal["nginx"].cpu_ms_per_request("nginx"), 3)
        mine = printed(at_goal["nginx+lua"].cpu_ms_per_request("nginx") - theirs, 3)
        if not theirs or mine < 0:
            why = (
                "nginx's CPU per request read 0.000 ms"
                if not theirs
                else f"nginx+lua's nginx spent less than nginx alone's ({mine:.3f} ms): noise larger than the door"
            )
            out.append(not_run(text, why))
        else:
            ratio = printed(mine / theirs)
            lines.append(f"CPU per request at {GOAL_RATE:g} req/s: {LUA_DOOR} {mine:.3f} ms / nginx {theirs:.3f} ms = {ratio:.2f}")
            out.append(goal_line(text, f"{ratio:.2f}x ({LUA_DOOR} {mine:.3f} ms, nginx {theirs:.3f} ms)", ratio <= GOAL_LUA_CPU_RATIO))
    return lines + out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100,500", help="open-loop rates, requests/s, comma-separated")
    # 12 s (2 s parts): at 6 s the Lua door's CPU per request over nginx's own read 0.93x,
    # 1.02x and 1.14x in three runs of one commit within an hour
    ap.add_argument("--seconds", type=float, default=12, help="open-loop seconds per path and rate (in --rounds parts)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved parts of each path's seconds, open and closed loop")
    # 12 s a path (2 s parts): at 3 s (0.5 s parts) the Lua door's ratio to nginx alone's
    # ceiling spread from 0.43 to 0.63 over eleven runs since e097b8a
    ap.add_argument("--closed-seconds", type=float, default=12)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--litellm-rates", default="25,50", help="the LiteLLM paths' rates: one LiteLLM process serves about 100 requests/s on one core")
    ap.add_argument("--no-litellm", action="store_true", help="leave the LiteLLM paths out")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    litellm_rates = [float(r) for r in args.litellm_rates.split(",")]
    mine, servers = split_cpus()
    with_litellm = not args.no_litellm and litellm_fixture.installed()
    machine = machine_line("nginx " + nginx_version(), "LiteLLM " + (litellm_fixture.LITELLM_VERSION if with_litellm else "not run"))  # before any load
    calibration = parse_calibration_ms()

    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp_name:
        tmp = Path(tmp_name)
        redis = stack.enter_context(RedisServer())
        engine_port = free_port()
        engine = engine_process(stack, engine_proc, engine_port)
        gate_yml = gate_config(tmp, redis.url, engine_port, models=True)
        gate_port, decide_port, syslog_port = free_port(), free_port(), free_port()
        gate = stack.enter_context(llm_health("gate", "--config.file", str(gate_yml), "--web.listen-address", f"127.0.0.1:{gate_port}"))
        decide = stack.enter_context(llm_health(*decide_args(gate_yml, decide_port, syslog_port)))
        for port, proc in ((engine_port, None), (gate_port, gate), (decide_port, decide)):
            wait_port(port, proc)
        (tmp / "alone").mkdir()
        (tmp / "door").mkdir()
        nginx_alone = stack.enter_context(Nginx(tmp / "alone", decide_port=decide_port, engine_port=engine_port, syslog_port=syslog_port, admission=False))
        nginx_door = stack.enter_context(Nginx(tmp / "door", decide_port=decide_port, engine_port=engine_port, syslog_port=syslog_port))
        (tmp / "lua").mkdir()
        nginx_lua = stack.enter_context(NginxLua(tmp / "lua", gate_file=gate_yml, engine_port=engine_port))
        assert redis.proc and nginx_alone.proc and nginx_door.proc and nginx_lua.proc and engine.pid
        e, r = {"engine": engine.pid}, {"redis": redis.proc.pid}
        paths = [
            Target("direct", f"http://127.0.0.1:{engine_port}/v1/chat/completions", e),
            Target("gate", f"http://127.0.0.1:{gate_port}/v1/chat/completions", {"gate": gate.pid, **r, **e}),
            Target("nginx", nginx_alone.url + "/v1/chat/completions", {"nginx": nginx_alone.proc.pid, **e}),
            Target("nginx+door", nginx_door.url + "/v1/chat/completions", {"nginx": nginx_door.proc.pid, "decide": decide.pid, **r, **e}),
            Target("nginx+lua", nginx_lua.url + "/v1/chat/completions", {"nginx": nginx_lua.proc.pid, **r, **e}),
        ]
        if with_litellm:
            (tmp / "litellm").mkdir()
            (tmp / "hook").mkdir()
            alone = stack.enter_context(litellm_fixture.LiteLLM(tmp / "litellm", engine_port=engine_port, hook=False))
            hook = stack.enter_context(litellm_fixture.LiteLLM(tmp / "hook", engine_port=engine_port, gate_config=gate_yml))
            lite = [
                Target("litellm", alone.url + "/v1/chat/completions", {"litellm": alone.pid, **e}, alone.headers),
                Target("litellm+hook", hook.url + "/v1/chat/completions", {"litellm": hook.pid, **r, **e}, hook.headers),
            ]
        os.sched_setaffinity(0, mine)
        plan = [(rate, paths) for rate in rates]
        if with_litellm:
            plan += [(rate, [paths[0], *lite]) for rate in litellm_rates]  # direct beside them: the same moment's machine
        pin([p for _, group in plan for path in group for p in path.pids.values()], servers)
        runs, ceilings = asyncio.run(measure(plan, args.seconds, args.closed_seconds, args.concurrency, args.rounds))

    print(f"machine: {machine}")
    print(f"calibration: prometheus_client parses the 45 KB vLLM payload in {calibration:.1f} ms (best of 7)")
    print(f"load generator on CPU {sorted(mine)}, every server on CPU {sorted(servers)}")
    print(
        f"open loop: {args.seconds:g} s per path and rate, in {args.rounds} interleaved parts; closed loop: {args.concurrency} clients, {args.closed_seconds:g} s per path, in {args.rounds} interleaved parts"
    )
    if not with_litellm:
        print("LiteLLM paths not run: " + ("--no-litellm" if args.no_litellm else f"{litellm_fixture.VENV} missing (bash .ci/install-litellm.sh)"))
    print("CPU ms/req: CPU milliseconds per request of the path's server processes (door, Redis where asked, engine)")
    for line in report(runs, ceilings):
        print(line)
    print()
    for line in goals(runs, ceilings):
        print(line)
    return 0


def nginx_version() -> str:
    from tests.fixtures.nginx import find_nginx

    out = subprocess.run([find_nginx(), "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).strip().rsplit("/", 1)[-1]


if __name__ == "__main__":
    raise SystemExit(main())
