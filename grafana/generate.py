#!/usr/bin/env python3
"""Dashboards as code: render grafana/dashboards/*.json with grafana-foundation-sdk.

    pip install -r grafana/requirements.txt      # the pinned SDK (Grafana 11.6 schema)
    python grafana/generate.py                   # rewrite the committed JSON
    python grafana/generate.py --check           # exit 1 if a committed file is stale
    python grafana/generate.py --queries         # every panel query, concrete, as JSON
    python grafana/generate.py --queries --set selectors.exporter='job="x"'   # with other config values

Three dashboards over the exporter's series (docs/architecture.md): the fleet (state per
backend, steps, running and waiting, tokens/s, restarts, probes; and the raw layer's
recording rules for vLLM servers scraped directly), admission (queue age against the
deadline, slack, past-deadline count, retries, duplicated tokens) and the GPU pool (held,
free, waiters, expiries, drift). They read the same monitoring config as the rules
(rules/config.yaml): its selectors pick the scrape jobs, its raw-layer rate window names
the recording rules. Every panel reads the `datasource`
template variable and has a unit; counters are read through rate() or increase() over
$__rate_interval. One answer per backend, pool and route whatever the number of exporter
replicas (HA pairs, shards that each read Redis): totals and per-backend lines take
`max without (instance)` (exporter.replica_labels; pools and routes: `max by
(pool)`, `max by (route)`) of the replicas first, then sum.

Longer than 500 lines because each dashboard is one function of panel definitions (the
fleet alone is ~170 lines) that reads as the dashboard does, top to bottom; the shared
panel helpers and the CLI are the rest.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import statetimeline as state_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "dashboards"
RULES_GENERATOR = ROOT / "rules" / "generate.py"
MIXIN_DASHBOARDS = ROOT / "mixin" / "generated" / "dashboards.libsonnet"


@functools.cache
def _rules_generate():
    """rules/generate.py, loaded once (load_config and mixin_templates both use it)."""
    spec = importlib.util.spec_from_file_location("rules_generate", RULES_GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """rules/config.yaml, through the rules generator's own reader (and its --set)."""
    return _rules_generate().load_config(overrides=overrides)


DATASOURCE = dash.DataSourceRef(type_val="prometheus", uid="${datasource}")
TAGS = ["llm-health"]

# llm_backend_state is one-hot; the timeline shows one code per backend. Worse is higher.
STATES = [
    ("idle", "green"),
    ("busy", "blue"),
    ("sleeping", "purple"),
    ("paused", "purple"),
    ("restarted", "yellow"),
    ("unknown", "text"),
    ("no_metrics", "orange"),
    ("stalled", "orange"),
    ("unresponsive", "orange"),
    ("hung", "red"),
    ("down", "dark-red"),
]


def query(expr: str, legend: str, ref: str = "A") -> prom_b.Dataquery:
    return prom_b.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE).range()


def timeseries(
    title: str,
    description: str,
    unit: str,
    targets: list[prom_b.Dataquery],
    w: int = 12,
    h: int = 8,
    stack: bool = False,
    thresholds: list[tuple[float | None, str]] | None = None,
    draw_bars: bool = False,
) -> ts_b.Panel:
    panel = (
        ts_b.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(DATASOURCE)
        .height(h)
        .span(w)
        .fill_opacity(10)
        .line_width(1)
        .legend(
            common_b.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
        .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING))
    )
    if stack:
        panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    if draw_bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80)
    if thresholds:
        panel = panel.thresholds(
            dash_b.ThresholdsConfig().mode(dash.ThresholdsMode.ABSOLUTE).steps([dash.Threshold(value=v, color=c) for v, c in thresholds])
        ).thresholds_style(common_b.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE))
    for t in targets:
        panel = panel.with_target(t)
    return panel


def datasource_variable() -> dash_b.DatasourceVariable:
    return dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(name: str, label: str, metric: str, selector: str) -> dash_b.QueryVariable:
    return (
        dash_b.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"query": f"label_values({metric}{{{selector}}}, {name})", "refId": "PrometheusVariableQueryEditor-VariableQuery"})
        .refresh(dash.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .sort(dash.VariableSort.ALPHABETICAL_ASC)
        .current(dash.VariableOption(selected=True, text="All", value="$__all"))
    )


def base(uid: str, title: str, description: str) -> dash_b.Dashboard:
    return (
        dash_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .editable()
        .tooltip(dash.DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource_variable())
    )


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


def render(builder: dash_b.Dashboard) -> str:
    built = builder.build()
    for number, panel in enumerate(built.panels or [], start=1):  # stable ids, in layout order
        panel.id_val = number
    return json.dumps(built, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def render_all(config: dict | None = None) -> dict[str, str]:
    config = config if config is not None else load_config()
    return {name: render(make(config)) for name, make in DASHBOARDS.items()}


def placeholders(config: dict, prefix: str = "") -> dict:
    """The config with each value replaced by `${its.dotted.key}`: dashboards rendered
    with it are the mixin's templates (mixin/generated/dashboards.libsonnet), into which
    the mixin puts its _config's values, derived as the rules' are."""
    return {k: placeholders(v, f"{prefix}{k}.") if isinstance(v, dict) else f"${{{prefix}{k}}}" for k, v in config.items()}


def mixin_templates(config: dict | None = None) -> str:
    """mixin/generated/dashboards.libsonnet: each dashboard's JSON text with `${section.key}`
    where a config value goes."""
    module = _rules_generate()
    config = config if config is not None else load_config()
    marked = placeholders(config)
    keys = set(re.findall(r"\$\{([^}]*)\}", json.dumps(marked)))  # a dashboard's own `${datasource}` stays as it is
    values = {name: module.templated(json.loads(render(make(marked))), keys.__contains__) for name, make in DASHBOARDS.items()}
    what = "The dashboards, `${section.key}` cut out of their strings where a value of rules/config.yaml goes (rules/generate.py `templated`)"
    return module.libsonnet(what, "the dashboards' code", "grafana/generate.py", values)


def panels(dashboard: dict) -> list[dict]:
    """Every panel that shows data (rows' nested panels included, rows themselves not)."""
    out = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL as written in the dashboard) for every target."""
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


def concrete(expr: str, rate_interval: str = "1m", time_range: str = "1h") -> str:
    """The query as Grafana would send it with every variable at "All"."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__range", time_range)
    return re.sub(r"\$\{?(backend|route|pool)\}?", ".*", expr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--queries", action="store_true", help="print every panel query (concrete) as JSON")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a value of rules/config.yaml")
    args = parser.parse_args(argv)
    if args.set and not args.queries:
        parser.error("--set only with --queries: the committed dashboards follow rules/config.yaml")
    config = load_config(args.set)
    files = render_all(config)
    if args.queries:
        out = {name: [{"panel": title, "expr": concrete(expr)} for title, expr in queries(json.loads(text))] for name, text in files.items()}
        print(json.dumps(out, indent=2))
        return 0
    stale = []
    targets = {OUT / name: text for name, text in files.items()}
    targets[MIXIN_DASHBOARDS] = mixin_templates(config)
    for path, text in targets.items():
        name = str(path.relative_to(ROOT))
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale, run `python grafana/generate.py`: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
