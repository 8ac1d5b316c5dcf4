"""What an engine is to the product: `Profile`, the one record each engine module fills.

Everything the rest of the product asks of an engine is a field here, never a comparison
of its name: the series and how they reduce, how a restart shows, what a timed-out
`/metrics` means, its health and sleep endpoints, the routes a door forwards to it and
those it never does, its queue-age method, the signals its raw rules watch (rules/
generate.py writes their progress, work and reset expressions from `counters` and
`gauges`, so the exporter and the rules read the same series) and the captured payloads
that prove its series (tests/unit/test_engine_signals.py). Pure data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

START_TIME = "process_start_time_seconds"


@dataclass(frozen=True)
class Profile:
    """How one engine exposes its work and its progress, and how the product talks to it.

    `unit_labels` name the labels that tell one engine unit from another in one payload
    (vLLM's data-parallel `engine` rank and `model_name`); series are summed over every
    other label (e.g. `finished_reason`).

    Progress is `counters` and `gauges`, each series with its `signal` label in the raw
    rules: any of them moving is progress; with requests waiting and none running, the
    counters alone (the work: a queue rises as requests arrive). `counters` only ever rise
    in one process, so a fall means a restart (the rules' resets). `gauges` are the
    engine-side gauges whose change also shows the engine took a step (KV usage rises
    during a long prefill even when no step is counted): never a gauge that a part in
    front of the engine moves as requests arrive (a router's queue), which rises while
    the engine is hung. `steps` is the counter of engine steps (one of `counters`).
    """

    name: str  # the `profile` label and the name in `Reading.profile`
    title: str  # the engine's name in reasons and messages
    prefix: str  # what its series' names start with (named when no engine is recognised)
    marker: str  # a sample name only this profile's engine exposes
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    steps: str | None
    generation_tokens: str | None
    counters: Mapping[str, str]  # series: its `signal` label in the raw rules
    gauges: Mapping[str, str] = field(default_factory=dict)
    unit_labels: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other names the engine goes by (its server's binary)
    # Series that tell this engine where no profile's marker is present (an older or
    # partial payload); asked after every marker.
    fallback_markers: tuple[str, ...] = ()
    sleep_awake: str | None = None  # gauge with sleep_state="awake": 0 means sleeping
    # Endpoints answering {"is_sleeping": true} and {"is_paused": true}, asked before a
    # stalled engine is called stalled (None: the engine has none).
    sleep_path: str | None = None
    pause_path: str | None = None
    # The response header of `/metrics` carrying the process start (integer microseconds),
    # for an engine with no start-time series: compared for equality only.
    start_header: str | None = None
    # Whether the exporter may keep its `/metrics` connection open between rounds.
    metrics_keepalive: bool = True
    # `/metrics` is a task on the inference loop's own queue, answered within milliseconds
    # under any load: a timeout while `health_path` answers is a loop that takes no task
    # (a failed probe), not load.
    metrics_on_loop: bool = False
    # Asked in place of `/v1/models` after a timed-out `/metrics` of a `metrics_on_loop`
    # engine (answered beside the inference loop).
    health_path: str = "/health"
    # An endpoint answered by the inference loop's own task queue and costing no generation
    # (an engine module names it), read only when the exporter already suspects the engine: its
    # `/metrics` timed out, or work in flight and nothing moved. A timeout there is hang
    # evidence (a server whose generation stopped while its health endpoint answers); never
    # sent to an engine that moves. None: the engine has none.
    evidence_path: str | None = None
    # The counters that move only when the engine produces output: a generated token, a
    # finished request. `steps` moving with none of these while requests run, for longer
    # than any honest prefill takes (`Settings.no_output_after_seconds`), is a livelock
    # (vLLM #45094: prefill at 20k tokens/s, decode at 0; a preemption loop), not progress.
    # KV usage or prompt tokens moving with no step counted is a V1 chunked prefill, busy
    # however long. Empty (or no `steps`): the engine shows no such counter, and any move
    # is progress.
    output: tuple[str, ...] = ()
    # The counter of requests the engine refused itself (shedding: a queue cap's 503), summed
    # over the backend (vLLM's has no data-parallel `engine` label), split by the label
    # `refusal_label` into `refusal_reasons` (any other value is "other": a bounded label).
    # A refusing engine is busy and protecting itself, never hung for that (core.health).
    refusals: str | None = None
    refusal_label: str = "reason"
    refusal_reasons: tuple[str, ...] = ()
    # The counter of finished requests for the engine queue age (core.queue_age), where
    # the engine's counts allow the method; None: 0 when nothing waits, unknown otherwise.
    finished: str | None = None
    # The door's default allowlist beyond the OpenAI-compatible API (core.forwarding),
    # and the paths never forwarded whatever a route allows.
    routes: tuple[str, ...] = ()
    never: tuple[str, ...] = ()
    # Its raw rules (rules/generate.py): their section of rules/config.yaml, also their
    # scrape job, shared by the profiles of one engine (vLLM's V1 and V0: the rules watch
    # the signals of both); the labels beside job and instance that a verdict is kept by.
    # A section with no template of its own (rules/templates/<section>.rules.yml.tmpl) is
    # rendered from rules/templates/engine.tmpl. None: the engine has no raw rules.
    rules: str | None = None
    rules_by: tuple[str, ...] = ()
    # Captured `/metrics` payloads of the engine (globs, relative to the repository root):
    # every series the profile reads is in one of them (tests/unit/test_engine_signals.py).
    payloads: tuple[str, ...] = ()

    def __hash__(self) -> int:  # the signal maps are dicts; equal profiles share a name
        return hash(self.name)

    @property
    def has_sleep_endpoints(self) -> bool:
        return self.sleep_path is not None or self.pause_path is not None

    @cached_property
    def wanted(self) -> frozenset[str]:
        names = {START_TIME, *self.running, *self.waiting, *self.counters, *self.gauges, *self.output}
        for name in (self.steps, self.generation_tokens, self.sleep_awake, self.refusals):
            if name:
                names.add(name)
        return frozenset(names)
