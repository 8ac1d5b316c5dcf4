"""The sections of docs/benchmarks.md: which benchmark each one runs (module and arguments,
one run at one commit), which paths it measures (a change to any of them since that commit
makes the section stale: bench/summary.py), and the few lines that say how to read it.

A section measures its module's import closure, computed from the source (bench/_imports.py:
every repository file the benchmark's code imports, the helpers of bench/ among them), and
the paths it `runs` that are not imported: data it reads, configuration it ships to a
server, scripts or test files it starts (a .py file there counts with its own imports).
`tests/unit/test_benchmarks_doc.py` fails when a path here does not exist.

`make bench` runs every section not marked `long`; `make bench-long` the long ones (real
engines, the whole loop), written into the same file with their own commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench._imports import closure


@dataclass(frozen=True)
class Section:
    name: str  # the module under bench/, and the section's key in the doc
    title: str
    args: tuple[str, ...]
    runs: tuple[str, ...]  # what the figures measure besides the module's imports (data, configuration, programs it starts)
    about: str
    long: bool = False

    @property
    def command(self) -> str:
        return " ".join(("python", "-m", f"bench.{self.name}", *self.args))

    @property
    def measured(self) -> tuple[str, ...]:
        """The module, then every file its code and the .py files it runs import, then the rest it runs."""
        module = f"bench/{self.name}.py"
        code = closure(module, *(p for p in self.runs if p.endswith(".py")))
        return (module, *(p for p in code if p != module), *(p for p in self.runs if not p.endswith(".py")))


SECTIONS: tuple[Section, ...] = (
    Section(
        "bench_parse",
        "Parse: targeted parser vs prometheus_client",
        (),
        ("tests/data/real-world/metrics",),
        "Values are checked against prometheus_client for every name set before anything is timed. "
        "\"own\" is the payload's engine profile's names; the goal is judged per engine on its own payloads, "
        "on the smallest own ratio as printed.",
    ),
    Section(
        "bench_scale",
        "Scale: one exporter, 10,000 backends",
        ("--backends", "10000", "--interval", "60"),
        (),
        "One exporter process against 10,000 simulated backends in others, at 60 s rounds (the simulated fleet serves a "
        "few hundred reads a second on a 2-core machine; 10,000 at 10 s rounds ask 1,000): the share of a core at 10 s rounds is projected "
        "from the cost of a round, and so are the shards 100,000 backends take (hashmod of the names); measured: a round "
        "against the floor in the same run, and a scrape's body rendered and gzipped in process (no HTTP).",
    ),
    Section(
        "bench_client",
        "One /metrics read: the exporter's client against the alternatives",
        (),
        (),
        "CPU per read by client (ours, aiohttp reused and new, a minimal GET), side by side in one run.",
    ),
    Section(
        "bench_decision",
        "Decision quality: a day with a batch job and one real hang",
        (),
        (),
        "A simulated day (counts, exact for the input): naive watchdogs against llm-health.",
    ),
    Section(
        "bench_gate",
        "Gate: added latency and throughput",
        (),
        (),
        "The gate's hop against the upstream reached directly, in one run.",
    ),
    Section(
        "bench_admission",
        "Admission doors side by side",
        (),
        (
            "deploy/nginx",
            "deploy/litellm",
            "exporter/llm_health/gate/nginx",
        ),  # the shipped files the doors run, and the Lua door's module: no import names them
        "Every door (the gate, nginx auth_request, nginx's Lua module, the LiteLLM hook) against its own baseline in one run.",
    ),
    Section(
        "bench_leases",
        "Redis: lease hand-off and contention",
        (),
        (),
        "Hand-off latency on one server, Sentinel and Cluster (with and without WAIT), and claims under contention.",
    ),
    Section(
        "bench_redis_view",
        "Redis: the exporter's view",
        (),
        (),
        "Round trips and commands per refresh (counts) and refresh time at size.",
    ),
    Section(
        "bench_hostile",
        "One hostile backend beside 100 healthy ones",
        (),
        (),
        "Each healthy round's start-to-start interval and the render time, with the hostile backend present.",
    ),
    Section(
        "engines_measure",
        "Real engines side by side",
        (),
        ("tests/harness",),
        "Each real engine of bench/engines_measure.py, as the real-engine tests run it.",
        long=True,
    ),
    Section(
        "bench_goodput",
        "Goodput under overload: the age-first door against vLLM's queue cap, a queue TTL and nothing",
        ("--seconds", "120"),
        ("exporter/llm_health/__main__.py", "deploy/nginx", "tests/harness"),  # llm-health serve, gate and decide; nginx; vLLM and its throttle
        "Answers complete before their deadline per second, on a real vLLM (throttled to a known capacity C) and on a simulated "
        "fleet of 16, per policy and offered load (0.8x, 2x, 4x C), the same seeded schedule and the openai SDK's own retries for "
        "every policy; wasted engine tokens, copies at the engine, refusals, latency of the on-time answers.",
        long=True,
    ),
    Section(
        "loop_recovery",
        "Recovery on the whole loop: a real hang to its restart",
        ("--runs", "3", "--stack", "compose"),
        ("tests/integration/realvllm/test_loop.py", "rules", "compose", "tests/harness"),
        "Seconds from a real engine's hang to its restart command, through Prometheus, Alertmanager and the restarter.",
        long=True,
    ),
)

BY_NAME = {s.name: s for s in SECTIONS}
