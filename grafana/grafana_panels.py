"""The panel helpers every llm-health dashboard is built from (grafana/generate.py renders
them, grafana_boards.py defines the dashboards): the data source variable every panel
reads, the states' colours, a time series with its legend and thresholds, a label
variable, a dashboard's common settings."""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dash

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
