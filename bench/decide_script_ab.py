"""What Redis spends on the nginx Lua door's one script call, this tree's script against a
git revision's, on one redis-server: the decision (store.ends.DECIDE_ENDS_LUA, the lean
reply the door asks for, a route with no backends as in bench_admission) carrying the
previous request's end whole (`e`), as the door sends them at its ceiling. The calls are
built by the same code the tests use to speak for the door (tests/fixtures/lua_door_calls.py:
store.queue's pipe_decide, attempt_call and leave_call; store.ends.attempt_end), each
request a new id.

The two scripts run in interleaved blocks (A B, then B A, ...) on the one server, so a
drift of the machine falls on both; each block's figure is Redis's own time per EVALSHA
(INFO commandstats, reset before the block: the commands the script runs included, the
network not). Printed: each block, each script's median, and the ratio of the medians.

    python -m bench.decide_script_ab --against REV [--blocks 10] [--calls 4000]

No goal is judged here: bench_admission judges the door; this says where a change to the
script moved Redis's share of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import redis
from tests.fixtures import lua_door_calls
from tests.fixtures.redis_server import RedisServer

from bench._machine import machine_line
from llm_health.core.admission import Policy
from llm_health.store.ends import DECIDE_ENDS_LUA
from llm_health.store.policy import policy_args
from llm_health.store.queue import AdmissionQueue

ROOT = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000_000
BATCH = 200  # calls a pipeline carries


def script_at(rev: str) -> str:
    """DECIDE_ENDS_LUA as the package at ``rev`` builds it (its files from git, imported in
    a child process: this process keeps the tree's)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "exporter/llm_health"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        code = "import sys\nfrom llm_health.store.ends import DECIDE_ENDS_LUA\nsys.stdout.write(DECIDE_ENDS_LUA)\n"
        env = {**os.environ, "PYTHONPATH": str(Path(tmp) / "exporter")}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def calls(q: AdmissionQueue, first: int, count: int) -> list[list[str]]:
    """``count`` door calls from request ``first``: each decision (lean) after the previous
    request's end whole, as the Lua door carries it."""
    settings = policy_args(Policy())
    out = []
    for i in range(first, first + count):
        now = NOW + i
        call = [str(v) for v in lua_door_calls.decision(q, f"r{i}", now, now + 30_000, backends=[], policy=settings)]
        if i > first:
            call += lua_door_calls.whole_end(q, f"r{i - 1}", 200, 9, now)
        out.append(call)
    return out


def block(rc: redis.Redis, sha: str, work: list[list[str]]) -> float:
    """Redis's own µs per EVALSHA over one block."""
    rc.config_resetstat()
    for b in range(0, len(work), BATCH):
        pipe = rc.pipeline(transaction=False)
        for call in work[b : b + BATCH]:
            pipe.evalsha(sha, *call)
        for reply in pipe.execute(raise_on_error=True):
            if not isinstance(reply, bytes) or b"\tadmit_once\t" not in reply:
                raise SystemExit(f"decide_script_ab: a decision answered {reply!r}, not an admit: the replay is not what the door sends")
    return float(rc.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the git revision whose script is compared with this tree's")
    ap.add_argument("--blocks", type=int, default=10, help="blocks of each script, interleaved")
    ap.add_argument("--calls", type=int, default=4000, help="script calls a block")
    args = ap.parse_args(argv)
    scripts = {"this tree": DECIDE_ENDS_LUA, args.against: script_at(args.against)}
    print(f"machine: {machine_line()}")
    if scripts[args.against] == DECIDE_ENDS_LUA:
        print(f"the script at {args.against} is this tree's: nothing to compare")
        return 0
    figures: dict[str, list[float]] = {name: [] for name in scripts}
    with RedisServer() as srv:
        rc = redis.Redis.from_url(srv.url)
        shas = {name: rc.script_load(text) for name, text in scripts.items()}
        first = 0
        names = list(scripts)
        for b in range(args.blocks):
            for name in names if b % 2 == 0 else names[::-1]:
                q = AdmissionQueue(rc, prefix=f"ab{len(figures[name])}{'t' if name == 'this tree' else 'r'}:")
                figures[name].append(block(rc, shas[name], calls(q, first, args.calls)))
                first += args.calls
    print(f"{args.blocks} blocks of {args.calls} calls each, interleaved; Redis µs per EVALSHA (INFO commandstats)")
    for name, values in figures.items():
        print(f"{name:<12} median {statistics.median(values):6.2f}  blocks {' '.join(f'{v:.1f}' for v in values)}")
    ratio = statistics.median(figures["this tree"]) / statistics.median(figures[args.against])
    print(f"this tree / {args.against}: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
