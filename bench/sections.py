"""The sections of docs/benchmarks.md: which benchmark each one runs (module and arguments,
one run at one commit), which paths it measures (a change to any of them since that commit
makes the section stale: bench/summary.py), and the few lines that say how to read it.

`make bench` runs every section not marked `long`; `make bench-long` the long ones (real
engines, the whole loop), written into the same file with their own commit.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every benchmark's helpers: a change to how a figure is taken or judged changes them all.
COMMON = ("bench/_goal.py", "bench/_machine.py", "bench/_stats.py")
CORE = "exporter/llm_health/core"


@dataclass(frozen=True)
class Section:
    name: str  # the module under bench/, and the section's key in the doc
    title: str
    args: tuple[str, ...]
    paths: tuple[str, ...]  # what the figures measure, besides COMMON and the module itself
    about: str
    long: bool = False

    @property
    def command(self) -> str:
        return " ".join(("python", "-m", f"bench.{self.name}", *self.args))

    @property
    def measured(self) -> tuple[str, ...]:
        return (f"bench/{self.name}.py", *COMMON, *self.paths)


SECTIONS: tuple[Section, ...] = (
    Section(
        "bench_parse",
        "Parse: targeted parser vs prometheus_client",
        (),
        (f"{CORE}/exposition.py", f"{CORE}/engines.py", "tests/fixtures/prom_reference.py", "tests/data/real-world/metrics"),
        "Values are checked against prometheus_client for every name set before anything is timed. "
        "\"own\" is the payload's engine profile's names; the goal is judged per engine on its own payloads, "
        "on the smallest own ratio as printed.",
    ),
    Section(
        "bench_scale",
        "Scale: one exporter, 10,000 backends",
        ("--backends", "10000", "--interval", "60", "--scrapes", "1"),
        (
            "bench/_shards.py",
            CORE,
            "exporter/llm_health/exporter",
            "exporter/llm_health/probe",
            "exporter/llm_health/web.py",
            "exporter/llm_health/sim/servers.py",
        ),
        "One exporter process against 10,000 simulated backends in others (60 s rounds, the share of a core computed "
        "at 10 s rounds from the cost of a round); a round against the floor measured in the same run, the scrape, and "
        "what 100,000 backends take in shards (hashmod of the names, each shard's share projected from that round's cost).",
    ),
    Section(
        "bench_client",
        "One /metrics read: the exporter's client against the alternatives",
        (),
        ("exporter/llm_health/probe", "bench/bench_scale.py", "exporter/llm_health/sim/servers.py"),
        "CPU per read by client (ours, aiohttp reused and new, a minimal GET), side by side in one run.",
    ),
    Section(
        "bench_decision",
        "Decision quality: a day with a batch job and one real hang",
        (),
        (CORE, "exporter/llm_health/sim/replay.py"),
        "A simulated day (counts, exact for the input): naive watchdogs against llm-health.",
    ),
    Section(
        "bench_gate",
        "Gate: added latency and throughput",
        (),
        (CORE, "exporter/llm_health/gate", "exporter/llm_health/store", "exporter/llm_health/web.py"),
        "The gate's hop against the upstream reached directly, in one run.",
    ),
    Section(
        "bench_admission",
        "Admission doors side by side",
        (),
        (CORE, "exporter/llm_health/gate", "exporter/llm_health/store", "deploy", "tests/fixtures/nginx.py", "tests/fixtures/litellm.py"),
        "Every door (the gate, nginx auth_request, the LiteLLM hook) against its own baseline in one run.",
    ),
    Section(
        "bench_leases",
        "Redis: lease hand-off and contention",
        (),
        ("bench/_leases_deployments.py", "exporter/llm_health/store", "tests/fixtures/redis_server.py", "tests/fixtures/redis_topology.py"),
        "Hand-off latency on one server, Sentinel and Cluster (with and without WAIT), and claims under contention.",
    ),
    Section(
        "bench_redis_view",
        "Redis: the exporter's view",
        (),
        ("exporter/llm_health/exporter/redis_view.py", "exporter/llm_health/store"),
        "Round trips and commands per refresh (counts) and refresh time at size.",
    ),
    Section(
        "bench_hostile",
        "One hostile backend beside 100 healthy ones",
        (),
        (CORE, "exporter/llm_health/exporter", "exporter/llm_health/probe", "exporter/llm_health/web.py", "tests/fixtures/hostile.py"),
        "Each healthy round's start-to-start interval and the render time, with the hostile backend present.",
    ),
    Section(
        "engines_measure",
        "Real engines side by side",
        (),
        (CORE, "exporter/llm_health/probe", "tests/harness"),
        "Each real engine of bench/engines_measure.py, as the real-engine tests run it.",
        long=True,
    ),
    Section(
        "bench_goodput",
        "Goodput under overload: the age-first door against vLLM's queue cap, a queue TTL and nothing",
        ("--seconds", "60"),
        (
            "bench/_goodput_model.py",
            "bench/_goodput_real.py",
            "bench/_goodput_sim.py",
            CORE,
            "exporter/llm_health/gate",
            "exporter/llm_health/exporter",
            "exporter/llm_health/store",
            "deploy/nginx",
            "tests/harness",
            "tests/fixtures/nginx.py",
        ),
        "Answers complete before their deadline per second, on a real vLLM (throttled to a known capacity C) and on a simulated "
        "fleet of 16, per policy and offered load (0.8x, 2x, 4x C), the same seeded schedule and the openai SDK's own retries for "
        "every policy; wasted engine tokens, copies at the engine, refusals, latency of the on-time answers.",
        long=True,
    ),
    Section(
        "loop_recovery",
        "Recovery on the whole loop: a real hang to its restart",
        ("--runs", "3", "--stack", "compose"),
        ("exporter/llm_health", "rules", "compose", "tests/harness", "tests/fixtures/loop.py"),
        "Seconds from a real engine's hang to its restart command, through Prometheus, Alertmanager and the restarter.",
        long=True,
    ),
)

BY_NAME = {s.name: s for s in SECTIONS}
