"""The dashboards: generated JSON up to date, and what Grafana's dashboard linter checks
(valid PromQL, $__rate_interval in rate windows, units on every panel, the datasource
variable on every panel and target, counters read through rate/increase), plus: every
series they read is one the exporter exports."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys

import pytest
import yaml

from tests.fixtures.paths import ROOT, load_script
from tests.fixtures.stack import PROMTOOL, exporter_series, metric_names, run_tool

GRAFANA = ROOT / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
RATE_FUNCTIONS = {"rate", "irate", "increase"}


def load_generator():
    """grafana/generate.py as a module (its helpers need no SDK until render time)."""
    return load_script(GRAFANA / "generate.py", "grafana_generate")


def sdk_pin() -> str:
    line = next(l for l in (GRAFANA / "requirements.txt").read_text().splitlines() if l.startswith("grafana-foundation-sdk=="))
    return line.split("==", 1)[1].strip()


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in DASHBOARDS}


def data_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return out


def all_queries() -> list[tuple[str, str, str]]:
    return [(name, p["title"], t["expr"]) for name, d in dashboards().items() for p in data_panels(d) for t in p.get("targets", [])]


def enclosing_function(expr: str, position: int) -> str | None:
    """The function whose parentheses directly enclose the text at `position`."""
    depth = 0
    for i in range(position - 1, -1, -1):
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(":
            if depth == 0:
                m = re.search(r"([A-Za-z_][A-Za-z0-9_]*)\s*$", expr[:i])
                return m.group(1) if m else None
            depth -= 1
    return None


def test_three_dashboards():
    assert {p.name for p in DASHBOARDS} == {"fleet.json", "admission.json", "gpu-pool.json"}
    uids = [d["uid"] for d in dashboards().values()]
    assert len(set(uids)) == len(uids)


def test_sdk_is_pinned_to_a_grafana_11_build():
    pin = sdk_pin()
    assert re.fullmatch(r"\d+!11\.\d+\.\d+", pin), pin


def test_generated_dashboards_are_up_to_date():
    try:
        installed = importlib.metadata.version("grafana-foundation-sdk")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("grafana-foundation-sdk is not installed: pip install -r grafana/requirements.txt")
    if installed != sdk_pin():
        pytest.skip(f"grafana-foundation-sdk {installed} installed, the dashboards are pinned to {sdk_pin()}")
    result = run_tool(sys.executable, str(GRAFANA / "generate.py"), "--check")
    assert result.returncode == 0, result.stderr


def test_datasource_variable_is_used_by_every_panel_and_target():
    for name, d in dashboards().items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus", name
        for v in variables.values():
            if v["type"] == "query":
                assert v["datasource"]["uid"] == "${datasource}", (name, v["name"])
        for panel in data_panels(d):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", (name, panel["title"])


def test_every_panel_has_a_unit_title_and_description():
    for name, d in dashboards().items():
        for panel in data_panels(d):
            assert panel["fieldConfig"]["defaults"].get("unit"), (name, panel["title"])
            assert panel.get("title") and panel.get("description"), (name, panel.get("title"))


def test_panel_ids_unique_and_grid_within_24_columns():
    for name, d in dashboards().items():
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)) and all(ids), name
        for p in d["panels"]:
            assert p["gridPos"]["x"] >= 0 and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, (name, p.get("title"))


def test_rate_windows_use_rate_interval():
    for name, title, expr in all_queries():
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), (name, title, window)
        for m in re.finditer(r"\b(rate|irate|increase)\s*\(", expr):
            window = re.search(r"\[([^\]]+)\]", expr[m.end() :]).group(1)
            allowed = {"$__rate_interval"} if m.group(1) != "increase" else {"$__rate_interval", "$__range"}
            assert window in allowed, (name, title, m.group(1), window)


def test_counters_are_read_through_rate_or_increase():
    for name, title, expr in all_queries():
        for m in re.finditer(r"(?<![\w:])([a-zA-Z_:][a-zA-Z0-9_:]*(?:_total|_bucket))\b", expr):
            assert enclosing_function(expr, m.start()) in RATE_FUNCTIONS, (name, title, m.group(1))


def test_counter_check_catches_a_raw_counter():
    expr = "sum by (backend) (llm_backend_restarts_total)"
    position = expr.index("llm_backend_restarts_total")
    assert enclosing_function(expr, position) not in RATE_FUNCTIONS
    assert enclosing_function("sum(rate(x_total[$__rate_interval]))", 9) == "rate"


def recorded_series() -> set[str]:
    """The recording rules of the committed rule files (the raw layer's panels read them)."""
    out = set()
    for path in (ROOT / "rules").glob("*.rules.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            out.update(r["record"] for r in group["rules"] if "record" in r)
    return out


def test_every_series_is_exported_or_recorded():
    known = exporter_series() | recorded_series()
    for name, title, expr in all_queries():
        assert metric_names(expr) <= known, (name, title, metric_names(expr) - known)
    for name, d in dashboards().items():
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                metric = re.search(r"label_values\((\w+)[{,]", v["query"]["query"]).group(1)
                assert metric in known, (name, v["name"])


def test_dashboards_follow_the_monitoring_config():
    """One config for rules and dashboards: its selectors and the raw layer's rate window
    appear in the queries; another value given to the generator changes them."""
    config = yaml.safe_load((ROOT / "rules" / "config.yaml").read_text())
    exprs = [expr for _, _, expr in all_queries()]
    assert any(config["selectors"]["exporter"] in e for e in exprs)
    assert any(f"engine:vllm_steps:rate{config['vllm']['rate_window']}" in e for e in exprs)
    result = run_tool(
        sys.executable,
        str(GRAFANA / "generate.py"),
        "--queries",
        "--set",
        "scrape_intervals.vllm=5s",
        "--set",
        "vllm.rate_window=42s",
        "--set",
        'selectors.exporter=job="mine"',
    )
    assert result.returncode == 0, result.stderr
    other = [q["expr"] for qs in json.loads(result.stdout).values() for q in qs]
    assert any("engine:vllm_steps:rate42s" in e for e in other) and any('job="mine"' in e for e in other)
    assert not any(config["selectors"]["exporter"] in e for e in other)


@pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (apt-get install prometheus)")
def test_every_query_is_valid_promql(tmp_path):
    generator = load_generator()
    rules = [{"record": f"dashboard:query_{i}:check", "expr": generator.concrete(expr)} for i, (_, _, expr) in enumerate(all_queries())]
    path = tmp_path / "dashboard-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = run_tool(PROMTOOL, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_query_list_is_easy_to_extract():
    """`generate.py --queries` (or generator.queries(json)) gives every panel's query."""
    generator = load_generator()
    for name, d in dashboards().items():
        assert [e for _, e in generator.queries(d)] == [e for n, _, e in all_queries() if n == name]
        assert "$" not in "".join(generator.concrete(e) for _, e in generator.queries(d))


def test_state_timeline_maps_every_health_state():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    states = set(re.findall(r"`([a-z_]+)`", doc.split("## Health states", 1)[1].split("\n\n", 2)[1]))
    panel = next(p for p in data_panels(dashboards()["fleet.json"]) if p["type"] == "state-timeline")
    mapped = {m["text"] for mapping in panel["fieldConfig"]["defaults"]["mappings"] for m in mapping["options"].values()}
    assert states and states <= mapped, states - mapped


def test_provisioning_files():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True and source["url"].startswith("http://prometheus:")
    boards = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "llm-health.yml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
