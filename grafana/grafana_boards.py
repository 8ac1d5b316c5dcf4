"""The three dashboards as code (grafana/generate.py renders them; the module docstring
there says what each shows and how their queries read the exporter's replicas): each one
function of panel definitions that reads as the dashboard does, top to bottom, built from
grafana_panels.py's helpers."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import statetimeline as state_b
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash

from grafana_panels import DATASOURCE, STATES, base, label_variable, query, timeseries


def fleet(cfg: dict) -> dash_b.Dashboard:
    exporter, vllm, window = cfg["selectors"]["exporter"], cfg["selectors"]["vllm"], cfg["vllm"]["rate_window"]
    sel = f'{exporter}, backend=~"$backend"'
    rep = cfg["exporter"]["replica_labels"]  # one series per backend whatever the replicas
    state_code = " or ".join(f'llm_backend_state{{state="{s}", {sel}}} * {i}' for i, (s, _) in enumerate(STATES))
    mapping = dash.ValueMap(options={str(i): dash.ValueMappingResult(text=s, color=c, index=i) for i, (s, c) in enumerate(STATES)})
    state_panel = (
        state_b.Panel()
        .title("State per backend")
        .description("The exporter's verdict per backend (worst engine). Busy is healthy; hung has work in flight and no progress over two rounds.")
        .unit("none")
        .datasource(DATASOURCE)
        .height(8)
        .span(24)
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .line_width(0)
        .fill_opacity(90)
        .mappings([mapping])
        .with_target(query(f"max by (backend) ({state_code})", "{{backend}}"))
    )
    up_panel = (
        stat_b.Panel()
        .title("Backends answering")
        .unit("short")
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .description("Backends whose /metrics or /v1/models answered in the last round, of all watched.")
        .with_target(query(f"sum(max without ({rep}) (llm_backend_up{{{sel}}}))", "up"))
        .with_target(query(f"count(max without ({rep}) (llm_backend_up{{{sel}}}))", "watched", "B"))
    )
    hung_panel = (
        stat_b.Panel()
        .title("Backends hung")
        .unit("short")
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .description("Backends the exporter reports hung now (LLMBackendHung after its for:).")
        .thresholds(
            dash_b.ThresholdsConfig()
            .mode(dash.ThresholdsMode.ABSOLUTE)
            .steps([dash.Threshold(value=None, color="green"), dash.Threshold(value=1, color="red")])
        )
        .with_target(query(f'sum(max without ({rep}) (llm_backend_state{{state="hung", {sel}}}))', "hung"))
    )
    restarts_stat = (
        stat_b.Panel()
        .title("Restarts in range")
        .unit("short")
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .description(
            "Restarts seen by the exporter over the dashboard's time range (a restart loop is a watchdog cascade: each false restart brings the next one)."
        )
        .with_target(query(f"sum(max without ({rep}) (increase(llm_backend_restarts_total{{{sel}}}[$__range])))", "restarts"))
    )
    round_stat = (
        stat_b.Panel()
        .title("Slowest exporter round")
        .unit("s")
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .description("The longest last round across backends: the exporter's own health.")
        .with_target(query(f"max(llm_exporter_round_duration_seconds{{{sel}}})", "round"))
    )
    return (
        base("llm-health-fleet", "LLM health / Fleet", "Busy or hung: the exporter's verdict per backend and the engine counters behind it.")
        .with_variable(label_variable("backend", "Backend", "llm_backend_up", exporter))
        .with_row(dash_b.Row("Now"))
        .with_panel(up_panel)
        .with_panel(hung_panel)
        .with_panel(restarts_stat)
        .with_panel(round_stat)
        .with_row(dash_b.Row("State"))
        .with_panel(state_panel)
        .with_row(dash_b.Row("Progress"))
        .with_panel(
            timeseries(
                "Engine steps per second",
                "Engine steps (iteration_tokens_total count) per second, per engine: the progress signal. Zero with work in flight is what hung looks like.",
                "ops",
                [query(f"max without ({rep}) (llm_backend_engine_steps_per_second{{{sel}}})", "{{backend}} {{model_name}} {{engine}}")],
            )
        )
        .with_panel(
            timeseries(
                "Generated tokens per second",
                "Output tokens per second, per engine. Stalls during a long prefill while steps go on.",
                "suffix: tok/s",
                [query(f"max without ({rep}) (llm_backend_generation_tokens_per_second{{{sel}}})", "{{backend}} {{model_name}} {{engine}}")],
            )
        )
        .with_panel(
            timeseries(
                "Requests running and waiting",
                "Requests in the engines' batches and in their queues.",
                "short",
                [
                    query(f"sum by (backend) (max without ({rep}) (llm_backend_requests_running{{{sel}}}))", "{{backend}} running"),
                    query(f"sum by (backend) (max without ({rep}) (llm_backend_requests_waiting{{{sel}}}))", "{{backend}} waiting", "B"),
                ],
            )
        )
        .with_panel(
            timeseries(
                "Seconds since progress",
                "How long each engine has gone without any progress signal moving. Grows only while hung or stalled.",
                "s",
                [query(f"max by (backend, engine) (llm_backend_seconds_since_progress{{{sel}}})", "{{backend}} {{engine}}")],
            )
        )
        .with_row(dash_b.Row("Restarts and probes"))
        .with_panel(
            timeseries(
                "Restarts",
                "Restarts seen per backend (new process start time or counter resets).",
                "short",
                [query(f"max by (backend) (increase(llm_backend_restarts_total{{{sel}}}[$__rate_interval]))", "{{backend}}")],
                draw_bars=True,
            )
        )
        .with_panel(
            timeseries(
                "Probes per second by result",
                "1-token probes the exporters sent to idle engines, by result (summed over the replicas that watch a backend: what it received). Busy engines are never probed.",
                "ops",
                [query(f"sum by (backend, result) (rate(llm_backend_probes_total{{{sel}}}[$__rate_interval]))", "{{backend}} {{result}}")],
            )
        )
        .with_panel(
            timeseries(
                "Probe duration",
                "Duration of the last probe per backend. An idle engine answers one token at once.",
                "s",
                [query(f"llm_backend_probe_duration_seconds{{{sel}}}", "{{backend}}")],
            )
        )
        .with_panel(
            timeseries(
                "Exporter: /metrics fetch and round errors",
                "The last /metrics fetch per backend, and failed rounds per second by reason.",
                "s",
                [
                    query(f"llm_backend_metrics_fetch_duration_seconds{{{sel}}}", "{{backend}} fetch"),
                    query(
                        f"sum by (backend, reason) (rate(llm_exporter_round_errors_total{{{sel}}}[$__rate_interval]))", "{{backend}} errors/s {{reason}}", "B"
                    ),
                ],
            )
        )
        .with_row(dash_b.Row("vLLM servers scraped directly (raw-layer recording rules)"))
        .with_panel(
            timeseries(
                "Engine steps/s (raw layer)",
                f"Engine steps per second per vLLM engine, from the raw layer's recording rule over {window}: no exporter needed.",
                "ops",
                [query(f"engine:vllm_steps:rate{window}{{{vllm}}}", "{{instance}} {{model_name}} {{engine}}")],
            )
        )
        .with_panel(
            timeseries(
                "Running and waiting (raw layer)",
                "Requests running and waiting per vLLM engine, as the engine reports.",
                "short",
                [
                    query(f"engine:vllm_requests_running:sum{{{vllm}}}", "{{instance}} {{engine}} running"),
                    query(f"engine:vllm_requests_waiting:sum{{{vllm}}}", "{{instance}} {{engine}} waiting", "B"),
                ],
            )
        )
    )


def admission(cfg: dict) -> dash_b.Dashboard:
    exporter, gate_sel = cfg["selectors"]["exporter"], cfg["selectors"]["gate"]
    sel = f'{exporter}, route=~"$route"'
    gate = f'{gate_sel}, route=~"$route"'
    return (
        base(
            "llm-health-admission",
            "LLM health / Admission",
            "Age first, then deadline, utilisation last: queue age against the deadline, retries and duplicated tokens per route.",
        )
        .with_variable(label_variable("route", "Route", "llm_admission_queue_depth", exporter))
        .with_row(dash_b.Row("Age against deadline"))
        .with_panel(
            timeseries(
                "Engine queue age against deadline",
                "Age of the oldest request waiting inside each backend's engine (llm_backend_queue_age_seconds: a lower bound within one "
                "exporter round; no line while unknown), the route's engine queue age (the youngest head among its backends whose age is "
                "known, as the gate combines them) and the route's deadline (routes: in rules/config.yaml). Route age at or above the "
                "deadline: LLMEngineQueueAgeOverDeadline pages.",
                "s",
                [
                    query(f"max without ({cfg['exporter']['replica_labels']}) (llm_backend_queue_age_seconds{{{exporter}}})", "{{backend}} engine queue age"),
                    query('route:llm_engine_queue_age_seconds:min{route=~"$route"}', "{{route}} engine queue age ({{backends}})", "B"),
                    query('route:llm_deadline_seconds:config{route=~"$route"}', "{{route}} deadline", "C"),
                ],
                w=24,
            )
        )
        .with_panel(
            timeseries(
                "Queue age against deadline",
                "Age of the oldest queued request, and the deadline of the tightest one (its age plus its slack). Age above deadline: the SLO is lost, page.",
                "s",
                [
                    query(f"max by (route) (llm_admission_queue_age_seconds{{{sel}}})", "{{route}} oldest age"),
                    query(
                        f"max by (route) (llm_admission_queue_age_seconds{{{sel}}}) + min by (route) (llm_admission_deadline_slack_seconds{{{sel}}})",
                        "{{route}} tightest deadline",
                        "B",
                    ),
                ],
                w=16,
            )
        )
        .with_panel(
            timeseries(
                "Deadline slack",
                "Smallest remaining slack per route. At or below zero a retry must be refused (reject_retry_late).",
                "s",
                [query(f"min by (route) (llm_admission_deadline_slack_seconds{{{sel}}})", "{{route}}")],
                w=8,
                thresholds=[(None, "red"), (0, "green")],
            )
        )
        .with_panel(
            timeseries(
                "Queued past deadline",
                "Queued requests already older than their deadline.",
                "short",
                [query(f"max by (route) (llm_admission_past_deadline{{{sel}}})", "{{route}}")],
                w=8,
            )
        )
        .with_panel(
            timeseries("Queue depth", "Requests queued per route.", "short", [query(f"max by (route) (llm_admission_queue_depth{{{sel}}})", "{{route}}")], w=8)
        )
        .with_panel(
            timeseries(
                "Retried requests queued",
                "Queued ids with retry_count >= 1. Retries after the deadline multiply work.",
                "short",
                [query(f"max by (route) (llm_admission_retried_requests{{{sel}}})", "{{route}}")],
                w=8,
            )
        )
        .with_row(dash_b.Row("Goodput"))
        .with_panel(
            timeseries(
                "Admitted against refused",
                "Requests per second each door sent on (admit_once, admit_unrecorded) and refused (every reject_*): under overload the "
                "admitted rate should sit at the engines' capacity, the rest refused at once (docs/benchmarks.md, bench_goodput).",
                "reqps",
                [
                    query(f'sum by (route) (rate(llm_gate_decisions_total{{{gate}, decision=~"admit_.*"}}[$__rate_interval]))', "{{route}} admitted"),
                    query(f'sum by (route) (rate(llm_gate_decisions_total{{{gate}, decision=~"reject_.*"}}[$__rate_interval]))', "{{route}} refused", "B"),
                ],
            )
        )
        .with_panel(
            timeseries(
                "Late token units",
                "Share of the token units the engines spent (upstream usage) on answers that arrived after their deadline: work that "
                "bought nothing. Near 0 while the door refuses what cannot make it.",
                "percentunit",
                [
                    query(
                        f"sum by (route) (rate(llm_gate_late_token_units_total{{{gate}}}[$__rate_interval])) / "
                        f"sum by (route) (rate(llm_gate_token_units_total{{{gate}}}[$__rate_interval]))",
                        "{{route}} late share",
                    )
                ],
            )
        )
        .with_panel(
            timeseries(
                "Engine refusals by code",
                "Upstream answers that shed the request (an engine's own queue cap or router: 429, 503, 529) per second: refusals with "
                "no tokens spent, not work done.",
                "reqps",
                [query(f"sum by (route, code) (rate(llm_gate_upstream_refusals_total{{{gate}}}[$__rate_interval]))", "{{route}} {{code}}")],
            )
        )
        .with_row(dash_b.Row("Duplication and the gate"))
        .with_panel(
            timeseries(
                "Duplicated tokens per id",
                "The largest token units consumed by one id, in attempts' worth (1 = no duplication; 4 = the tokens of one request spent four times).",
                "suffix:×",
                [query(f"max by (route) (llm_admission_token_duplication_ratio_max{{{sel}}})", "{{route}}")],
                thresholds=[(None, "green"), (2, "red")],
            )
        )
        .with_panel(
            timeseries(
                "Gate decisions",
                "The admission gate's decisions per second (admit_once, reject_retry_late, reject_age_beats_slack, ...).",
                "reqps",
                [query(f"sum by (route, decision) (rate(llm_gate_decisions_total{{{gate}}}[$__rate_interval]))", "{{route}} {{decision}}")],
                stack=True,
            )
        )
        .with_panel(
            timeseries(
                "Upstream responses by code",
                "Upstream answers per second; 429 and 503 apart from other errors.",
                "reqps",
                [query(f"sum by (route, code) (rate(llm_gate_upstream_responses_total{{{gate}}}[$__rate_interval]))", "{{route}} {{code}}")],
            )
        )
        .with_panel(
            timeseries(
                "Gate request duration p95",
                "95th percentile of requests through the gate.",
                "s",
                [
                    query(
                        f"histogram_quantile(0.95, sum by (route, le) (rate(llm_gate_request_duration_seconds_bucket{{{gate}}}[$__rate_interval])))",
                        "{{route}} p95",
                    )
                ],
            )
        )
    )


def gpu_pool(cfg: dict) -> dash_b.Dashboard:
    exporter = cfg["selectors"]["exporter"]
    sel = f'{exporter}, pool=~"$pool"'
    return (
        base("llm-health-gpu-pool", "LLM health / GPU pool", "Redis leases over the GPU pool: held, free, waiters, expiries (holders dying) and drift.")
        .with_variable(label_variable("pool", "Pool", "llm_gpu_pool_size", exporter))
        .with_row(dash_b.Row("Occupancy"))
        .with_panel(
            timeseries(
                "Leases held and GPUs free",
                "Leases held and GPUs free against the pool size.",
                "short",
                [
                    query(f"max by (pool) (llm_gpu_leases_held{{{sel}}})", "{{pool}} held"),
                    query(f"max by (pool) (llm_gpu_free{{{sel}}})", "{{pool}} free", "B"),
                    query(f"max by (pool) (llm_gpu_pool_size{{{sel}}})", "{{pool}} size", "C"),
                ],
            )
        )
        .with_panel(
            timeseries(
                "Waiters",
                "Callers waiting for a GPU. With no GPU free for long, LLMGPUPoolExhausted fires.",
                "short",
                [query(f"max by (pool) (llm_gpu_waiters{{{sel}}})", "{{pool}}")],
            )
        )
        .with_row(dash_b.Row("Lease health"))
        .with_panel(
            timeseries(
                "Lease releases by reason",
                "Leases released per second: del (holder finished) against expired (holder died or stalled past the TTL).",
                "ops",
                [query(f"max by (pool, reason) (rate(llm_gpu_lease_releases_total{{{sel}}}[$__rate_interval]))", "{{pool}} {{reason}}")],
                stack=True,
            )
        )
        .with_panel(
            timeseries(
                "Drift",
                "GPUs where Redis and the backends disagree, by kind; the reconcile pass should clear it.",
                "short",
                [query(f"max by (pool, kind) (llm_gpu_lease_drift{{{sel}}})", "{{pool}} {{kind}}")],
            )
        )
        .with_panel(
            timeseries(
                "Lease TTL left and age",
                "Smallest TTL left and the oldest lease's age: a long job must renew before its TTL runs out.",
                "s",
                [
                    query(f"min by (pool) (llm_gpu_lease_ttl_min_seconds{{{sel}}})", "{{pool}} min TTL left"),
                    query(f"max by (pool) (llm_gpu_lease_age_max_seconds{{{sel}}})", "{{pool}} oldest lease", "B"),
                ],
            )
        )
        .with_panel(
            timeseries(
                "Redis reachable",
                "1 while the exporter reads Redis; lease series are stale otherwise.",
                "bool_yes_no",
                [query(f"min(llm_redis_up{{{exporter}}})", "redis up")],
            )
        )
    )


def gpu_faults(board: dash_b.Dashboard, cfg: dict) -> dash_b.Dashboard:
    """The fleet's last row: hangs joined with dcgm-exporter (rules/dcgm.rules.yml's records).
    Counts read `or vector(0)`: 0 backends mapped is the answer where no DCGM series joins."""
    sel = f'{cfg["selectors"]["exporter"]}, backend=~"$backend"'
    rep = cfg["exporter"]["replica_labels"]  # each backend once behind an HA pair
    red = [dash.Threshold(value=None, color="green"), dash.Threshold(value=1, color="red")]

    def count(title: str, description: str, expr: str, thresholds: bool = False) -> stat_b.Panel:
        panel = stat_b.Panel().title(title).description(description).unit("short").datasource(DATASOURCE).height(4).span(6)
        if thresholds:
            panel = panel.thresholds(dash_b.ThresholdsConfig().mode(dash.ThresholdsMode.ABSOLUTE).steps(red))
        return panel.with_target(query(f"{expr} or vector(0)", title))

    causes = [("no_gpu_data", "text"), ("software", "blue"), ("gpu_fault", "red")]
    code = " or ".join(f'max by (backend) (backend:llm_hung_cause:info{{cause="{c}", {sel}}}) * {i}' for i, (c, _) in enumerate(causes))
    mapping = dash.ValueMap(options={str(i): dash.ValueMappingResult(text=c, color=color, index=i) for i, (c, color) in enumerate(causes)})
    timeline = (
        state_b.Panel()
        .title("Cause of each hang")
        .description(
            "Per hung backend: gpu_fault (a GPU of it reports a hardware XID or failed row remapping: drain, reset the GPU), "
            "software (its GPUs report no fault: the restart fixes it) or no_gpu_data (no dcgm-exporter series joins it)."
        )
        .unit("none")
        .datasource(DATASOURCE)
        .height(6)
        .span(24)
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .line_width(0)
        .fill_opacity(90)
        .mappings([mapping])
        .with_target(query(code, "{{backend}}"))
    )
    return (
        board.with_row(dash_b.Row("GPU faults (dcgm-exporter)"))
        .with_panel(
            count(
                "Backends mapped to a GPU",
                "Backends whose GPUs report to DCGM through the join labels (rules/config.yaml, dcgm:). 0: no dcgm-exporter, or the labels do not match.",
                f"count(max without ({rep}) (backend:llm_gpu_fault:bool{{{sel}}}))",
            )
        )
        .with_panel(
            count(
                "Backends on a faulted GPU",
                "Backends with a GPU that reports a hardware fault now (LLMBackendGPUFault), hung or not.",
                f"sum(max without ({rep}) (backend:llm_gpu_fault:bool{{{sel}}}))",
                thresholds=True,
            )
        )
        .with_panel(
            count(
                "Hung on a GPU fault",
                "Hung backends whose GPU reports a fault (LLMBackendHungGPUFault): not a restart's job.",
                f'count(max without ({rep}) (backend:llm_hung_cause:info{{cause="gpu_fault", {sel}}}))',
                thresholds=True,
            )
        )
        .with_panel(
            count(
                "Hung, GPU healthy",
                "Hung backends whose GPUs report no fault (LLMBackendHungSoftwareWedge): a software wedge, the restart fixes it.",
                f'count(max without ({rep}) (backend:llm_hung_cause:info{{cause="software", {sel}}}))',
            )
        )
        .with_panel(timeline)
    )


DASHBOARDS = {"fleet.json": lambda cfg: gpu_faults(fleet(cfg), cfg), "admission.json": admission, "gpu-pool.json": gpu_pool}
