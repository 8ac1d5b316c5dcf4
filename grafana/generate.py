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

The dashboards are defined in grafana_boards.py (one function each, top to bottom as the
dashboard reads) from the panel helpers of grafana_panels.py; this file renders them.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "dashboards"
RULES_GENERATOR = ROOT / "rules" / "generate.py"
MIXIN_DASHBOARDS = ROOT / "mixin" / "generated" / "dashboards.libsonnet"
sys.path.insert(0, str(HERE))  # the dashboards' modules beside this script, run or loaded by path

from grafana_foundation_sdk.builders import dashboard as dash_b  # noqa: E402
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402

from grafana_boards import DASHBOARDS  # noqa: E402


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
    targets = {OUT / name: text for name, text in files.items()}
    targets[MIXIN_DASHBOARDS] = mixin_templates(config)
    return _rules_generate().sync(targets, args.check, "python grafana/generate.py")


if __name__ == "__main__":
    sys.exit(main())
