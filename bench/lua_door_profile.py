"""Where the nginx Lua door's CPU goes: the door's module run as shipped and with one part
of it taken out at a time, each at the same open-loop rate in front of the same engine and
Redis (bench_admission's engine; one nginx per variant, its module edited before it
starts). The differences between rows are what each part costs nginx per request.

    python -m bench.lua_door_profile [--rate 500] [--seconds 6] [--rounds 2]

Variants (each drops what the ones above it keep, where named so):
- shipped: the module as `llm-health nginx-lua` writes it;
- no finishes: the attempt's end is not queued (log_by_lua returns at once);
- no script: the connection is taken from the pool and given back, the decision script
  is not sent (its reply stood in), no finishes;
- no Redis: no connection either;
- phases only: access_by_lua returns at once (the three Lua phases still run, empty);
- nginx alone: the shipped nginx.conf without any admission (bench_admission's baseline).

Rounds interleave the variants, so machine noise hits them alike; the table shows each
variant's mean over the rounds. No goal is judged here: bench_admission judges the door.

`--closed SECONDS`: then each variant at its ceiling too (bench_admission's closed loop, 64
clients, in the same interleaved rounds): answers per second, the CPU per answer of each
server process (they share the servers' core: what one answer costs that core is what
bounds a ceiling it holds) and how busy the load generator's core was (near 1: the load
generator, not the servers, held that ceiling).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import aiohttp
from tests.fixtures.nginx import Nginx, NginxLua
from tests.fixtures.redis_server import RedisServer
from tests.harness.processes import free_port

from bench._machine import machine_line
from bench._processes import cpu_seconds, engine_process, gate_config, pin, split_cpus, wait_port
from bench.bench_admission import Run, Target, closed_loop, engine_proc, open_loop

FAKE_REPLY = 'queue_id .. "\\t" .. deadline .. "\\tadmit_once\\t200\\t\\t0\\t0\\t" .. (deadline - now) .. "\\t0\\t\\t\\tprofile"'  # a lean reply
SCRIPT = "      res, err = run_call(r, plan.scripts.decide, parts, count)"
NO_FINISH = ("function M.log()\n", "function M.log()\n  do return end\n")
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "shipped": [],
    "no finishes": [NO_FINISH],
    "no script": [NO_FINISH, (SCRIPT, f"      res = {FAKE_REPLY}")],
    "no Redis": [NO_FINISH, ("  local r, err = connect()\n  local res\n", f"  local r, err = nil, nil\n  local res = {FAKE_REPLY}\n")],
    "phases only": [("function M.access()\n", "function M.access()\n  do return end\n")],
}


def edited(source: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        if old not in source:
            raise SystemExit(f"lua_door_profile: the module no longer has {old.strip()!r}: update the variant")
        source = source.replace(old, new)
    return source


def own_cpu_s() -> float:
    """This process's CPU seconds (the load generator's)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


class Part(NamedTuple):
    """One closed-loop part of a variant."""

    answers: float
    bad: int
    wall_s: float
    cpu_s: dict[str, float]  # by role
    generator_cpu_s: float


async def measure(targets: dict[str, Target], rate: float, seconds: float, rounds: int, closed: float) -> tuple[dict[str, list[Run]], dict[str, list[Part]]]:
    """(the open-loop runs by variant, the closed-loop parts by variant)."""
    runs: dict[str, list[Run]] = {name: [] for name in targets}
    ceilings: dict[str, list[Part]] = {name: [] for name in targets}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as s:
        for t in targets.values():
            await open_loop(s, t, 50, 1, Run(), f"warm-{t.name}")
        for r in range(rounds):
            for name, t in targets.items():
                run = Run()
                await open_loop(s, t, rate, seconds, run, f"p{r}-{time.time_ns()}")
                runs[name].append(run)
            if not closed:
                continue
            for name, t in targets.items():
                cpu0, mine0, t0 = {k: cpu_seconds(p) for k, p in t.pids.items()}, own_cpu_s(), time.perf_counter()
                # the variant's name goes into each request's X-Request-Id: no spaces there
                per_s, bad = await closed_loop(s, Target(name.replace(" ", "-"), t.url, t.pids), 64, closed / rounds, f"c{r}-{time.time_ns()}")
                wall = time.perf_counter() - t0
                cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in t.pids.items()}
                ceilings[name].append(Part(per_s * wall, bad, wall, cpu, own_cpu_s() - mine0))
    return runs, ceilings


def ceiling_lines(ceilings: dict[str, list[Part]]) -> list[str]:
    out = [f"{'variant':<13} {'ceiling/s':>9} {'bad':>5} {'nginx':>7} {'redis':>7} {'engine':>7} {'servers':>8} {'generator busy':>15}"]
    for name, parts in ceilings.items():
        answers, bad, wall = sum(p.answers for p in parts), sum(p.bad for p in parts), sum(p.wall_s for p in parts)
        per = {k: sum(p.cpu_s.get(k, 0.0) for p in parts) / max(answers, 1) * 1000 for k in ("nginx", "redis", "engine")}
        busy = sum(p.generator_cpu_s for p in parts) / wall
        out.append(
            f"{name:<13} {answers / wall:>9.0f} {bad:>5} {per['nginx']:>7.3f} {per['redis']:>7.3f} {per['engine']:>7.3f} {sum(per.values()):>8.3f} {busy:>15.2f}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--closed", type=float, default=0, help="seconds of closed loop per variant (in --rounds parts): each variant's ceiling")
    args = ap.parse_args(argv)
    mine, servers = split_cpus()
    machine = machine_line()
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="lua-profile-") as tmp_name:
        tmp = Path(tmp_name)
        redis = stack.enter_context(RedisServer())
        port = free_port()
        engine = engine_process(stack, engine_proc, port)
        wait_port(port)
        gate_yml = gate_config(tmp, redis.url, port)
        assert redis.proc and engine.pid
        targets: dict[str, Target] = {}
        for i, (name, edits) in enumerate(VARIANTS.items()):
            (tmp / f"v{i}").mkdir()
            nginx = NginxLua(tmp / f"v{i}", gate_file=gate_yml, engine_port=port)
            module = nginx.lua_dir / "llm_health.lua"
            module.write_text(edited(module.read_text(), edits))
            stack.enter_context(nginx)
            assert nginx.proc
            targets[name] = Target(name, nginx.url + "/v1/chat/completions", {"nginx": nginx.proc.pid, "redis": redis.proc.pid, "engine": engine.pid})
        (tmp / "alone").mkdir()
        alone = stack.enter_context(Nginx(tmp / "alone", decide_port=free_port(), engine_port=port, syslog_port=free_port(), admission=False))
        assert alone.proc
        targets["nginx alone"] = Target("nginx alone", alone.url + "/v1/chat/completions", {"nginx": alone.proc.pid, "engine": engine.pid})
        os.sched_setaffinity(0, mine)
        pin([p for t in targets.values() for p in t.pids.values()], servers)
        runs, ceilings = asyncio.run(measure(targets, args.rate, args.seconds, args.rounds, args.closed))
    print(f"machine: {machine}")
    print(f"{args.rounds} rounds of {args.seconds:g} s per variant at {args.rate:g} requests/s, interleaved; CPU ms per request, the mean of the rounds")
    print(f"{'variant':<13} {'sent':>6} {'failed':>6} {'nginx':>7} {'redis':>7} {'nginx less the row below':>25}")
    names = list(targets)
    means = {n: sum(r.cpu_ms_per_request("nginx") for r in runs[n]) / len(runs[n]) for n in names}
    for i, n in enumerate(names):
        sent, failed = sum(r.sent for r in runs[n]), sum(r.failed for r in runs[n])
        redis_ms = sum(r.cpu_ms_per_request("redis") for r in runs[n]) / len(runs[n])
        below = f"{means[n] - means[names[i + 1]]:>25.3f}" if i + 1 < len(names) else f"{'':>25}"
        print(f"{n:<13} {sent:>6} {failed:>6} {means[n]:>7.3f} {redis_ms:>7.3f} {below}")
    if args.closed:
        print()
        print(
            f"closed loop, 64 clients, {args.closed:g} s per variant in {args.rounds} interleaved parts: answers/s, CPU ms per answer by process on CPU {sorted(servers)}, the load generator's CPU {sorted(mine)} busy (1 = all of it)"
        )
        print("\n".join(ceiling_lines(ceilings)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
