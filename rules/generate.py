#!/usr/bin/env python3
"""Render the rule files and the PrometheusRule manifest from rules/config.yaml.

    python rules/generate.py                      # rewrite the committed files in rules/ and rules/<variant>/
    python rules/generate.py --check              # exit 1 if a committed file is stale
    python rules/generate.py --out DIR --set scrape_intervals.vllm=60s ...

Each template in rules/templates/ (*.rules.yml.tmpl) is plain Prometheus rule YAML in which ${section.key}
stands for a value from the config. The rendered text keeps the templates' comments. Every
alert gets `runbook_url: <runbook_url>#<alertname in lower case>`, the heading of its
section in docs/runbook.md. `--set` overrides single values (the real-stack test uses it
for short windows); with `--out` only the main config is rendered, into DIR.
grafana/generate.py reads the same config (`load_config`).

Every window that counts samples is derived from the scrape interval of the job it reads
(`scrape_intervals:`): the config's value is its floor, and the window spans at least
`evidence.still_scrapes` scrapes (stillness: changes, resets) or `evidence.rate_scrapes`
scrapes (rate, increase). `variants:` renders the same templates for the scrape intervals
of the stacks this repository ships (compose, Kubernetes) into rules/<variant>/.
"""

from __future__ import annotations

import argparse
import copy
import math
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
CONFIG = HERE / "config.yaml"
MANIFEST = "prometheusrule.yaml"
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks, so the manifest reads like the rules."""


def _str_representer(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_representer)


# Windows derived from a job's scrape interval, by what they count: stillness (changes,
# resets) or a rate. Every engine's rules section has the two engine windows; an engine
# section is a job of `scrape_intervals:` with a template of its name (rules/templates/
# <job>.rules.yml.tmpl), so adding an engine's section is its template and its config.
STILL, RATE = "still_scrapes", "rate_scrapes"
ENGINE_WINDOWS = {"progress_window": STILL, "rate_window": RATE}
EXPORTER_WINDOWS = {
    "restart_loop_window": RATE,
    "probe_window": RATE,
    "lease_expiry_window": RATE,
    "round_errors_window": RATE,
}
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"((?:[0-9]+(?:ms|s|m|h|d))+)")


def seconds(text: object, where: str) -> float:
    """A Prometheus duration (30s, 5m, 1m30s) in seconds; SystemExit naming `where` otherwise."""
    value = str(text).strip()
    if not _DURATION.fullmatch(value):
        raise SystemExit(f"{where}: {value!r} is not a Prometheus duration (30s, 5m, 1h)")
    total = sum(float(n) * _UNITS[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h|d)", value))
    if total <= 0:
        raise SystemExit(f"{where}: {value!r} must be longer than zero")
    return total


def duration(total: float) -> str:
    """Seconds as the shortest Prometheus duration: 120 -> 2m, 105 -> 1m45s."""
    ms = round(total * 1000)
    out = ""
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if ms >= size:
            out += f"{ms // size}{unit}"
            ms %= size
    return out or "0s"


def engine_sections(config: dict) -> list[str]:
    """The engines' rules sections: each job of `scrape_intervals:` with a template of its
    name (each engine with a raw layer); the exporter's job has its own template (llm-health)."""
    return [job for job in config["scrape_intervals"] if (TEMPLATES / f"{job}.rules.yml.tmpl").is_file()]


def derived_windows(config: dict) -> dict[str, tuple[str, str]]:
    """{dotted key: (job, evidence key)}: every window derived from a job's scrape
    interval, the engine sections' (ENGINE_WINDOWS) and the exporter's."""
    out: dict[str, tuple[str, str]] = {}
    for job in engine_sections(config):
        section = config.get(job)
        missing = [key for key in ENGINE_WINDOWS if not isinstance(section, dict) or key not in section]
        if missing:
            raise SystemExit(f"config: the engine section `{job}:` (rules/templates/{job}.rules.yml.tmpl) needs {', '.join(missing)}")
        out.update({f"{job}.{key}": (job, kind) for key, kind in ENGINE_WINDOWS.items()})
    out.update({f"exporter.{key}": ("exporter", kind) for key, kind in EXPORTER_WINDOWS.items()})
    return out


def derive(config: dict) -> dict:
    """Raise every derived window (derived_windows) to span its job's evidence scrapes, and add
    `<job>.evidence_window` (the shortest window of the job that counts samples, in which
    the `<Job>ScrapeTooSlow` warning counts scrapes) and `<job>.evidence_samples` (the
    scrapes every such window must hold to be evidence)."""
    intervals = config.get("scrape_intervals")
    evidence = config.get("evidence")
    if not isinstance(intervals, dict) or not isinstance(evidence, dict):
        raise SystemExit("config: `scrape_intervals:` and `evidence:` sections are required")
    for key in (STILL, RATE, "min_samples"):
        n = evidence.get(key)
        if not isinstance(n, int) or isinstance(n, bool) or n < 2:
            raise SystemExit(f"config: evidence.{key} must be a whole number of scrapes, at least 2 (got {n!r})")
    if evidence[STILL] <= evidence["min_samples"] or evidence[RATE] <= evidence["min_samples"]:
        raise SystemExit("config: evidence.still_scrapes and rate_scrapes must exceed min_samples (one scrape spare)")
    windows = derived_windows(config)
    every = {job: seconds(intervals.get(job), f"scrape_intervals.{job}") for job, _ in windows.values()}
    shortest: dict[str, float] = {}
    for dotted, (job, kind) in windows.items():
        section, key = dotted.split(".")
        window = max(seconds(config[section][key], dotted), evidence[kind] * every[job])
        config[section][key] = duration(window)
        shortest[job] = min(shortest.get(job, window), window)
    for job, window in shortest.items():
        config[job]["evidence_window"] = duration(window)
        # All but one of the scrapes the window holds at the configured interval (and at
        # least min_samples): one spare for a late scrape, and a scrape slower than the
        # rules were made for shows as too few.
        held = math.floor(window / every[job] + 1e-9)
        config[job]["evidence_samples"] = max(evidence["min_samples"], held - 1)
    for job in engine_sections(config):
        if "queue_age_deadline" in config[job]:
            derive_engine_queue_age(config, job)
    return derive_routes(config)


def derive_engine_queue_age(config: dict, job: str) -> None:
    """An engine section's raw bound on its queue age (vLLM's): raise
    `<job>.queue_age_deadline` to 2 scrapes of the job into `<job>.queue_age_window`."""
    every = seconds(config["scrape_intervals"].get(job), f"scrape_intervals.{job}")
    deadline = seconds(config[job].get("queue_age_deadline"), f"{job}.queue_age_deadline")
    window = max(deadline, 2 * every)
    config[job]["queue_age_window"] = duration(window)
    # The range the guards read (restarts, failed scrapes): the window and one scrape, so
    # that it holds the sample `offset <window>` reads too.
    config[job]["queue_age_range"] = duration(window + every)


NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # a route's or backend's name (the exporter's backend names)


def _regex(names: list[str]) -> str:
    """A PromQL regex matching exactly these names (RE2, anchored by PromQL; `.` escaped)."""
    return "|".join(name.replace(".", "\\\\.") for name in names)


def derive_routes(config: dict) -> dict:
    """Validate `routes:` and render the exporter layer's route records into
    `exporter.route_rules` (YAML list items, indented for the template's rules list)."""
    routes = config.get("routes")
    if routes is None:
        routes = {}
    if not isinstance(routes, dict):
        raise SystemExit("config: routes: must be a mapping of route name to {deadline, backends}")
    selector, replicas = config["selectors"]["exporter"], config["exporter"]["replica_labels"]
    rules: list[str] = []
    for route, spec in routes.items():
        where = f"routes.{route}"
        if not isinstance(route, str) or not NAME.fullmatch(route):
            raise SystemExit(f"config: {where}: a route name uses letters, digits and _ . : - only (at most 128)")
        if not isinstance(spec, dict) or set(spec) != {"deadline", "backends"}:
            got = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
            raise SystemExit(f"config: {where}: needs exactly `deadline` and `backends` (got {got})")
        limit = seconds(spec["deadline"], f"{where}.deadline")
        backends = spec["backends"]
        if not isinstance(backends, list) or not backends:
            raise SystemExit(f"config: {where}.backends: a non-empty list of the exporter's backend names")
        for name in backends:
            if not isinstance(name, str) or not NAME.fullmatch(name):
                raise SystemExit(f"config: {where}.backends: {name!r} is not a backend name (letters, digits and _ . : - only)")
        if len(set(backends)) != len(backends):
            raise SystemExit(f"config: {where}.backends: a backend is named twice")
        names = ",".join(backends)
        rules.append(
            f"- record: route:llm_engine_queue_age_seconds:min\n"
            f"  # Route {route}: the youngest known head among {names}.\n"
            f"  expr: |\n"
            f"    label_replace(label_replace(\n"
            f'      min(max without ({replicas}) (llm_backend_queue_age_seconds{{{selector}, backend=~"{_regex(backends)}"}})),\n'
            f'      "route", "{route}", "", ""), "backends", "{names}", "", "")\n'
            f"- record: route:llm_deadline_seconds:config\n"
            f'  expr: label_replace(vector({limit:g}), "route", "{route}", "", "")'
        )
    text = "\n".join(rules) or "# No routes in rules/config.yaml (routes:): LLMEngineQueueAgeOverDeadline has nothing to read."
    config["exporter"]["route_rules"] = text.replace("\n", "\n      ")
    return config


def load_config(path: Path = CONFIG, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    return derive(apply_overrides(yaml.safe_load(path.read_text()), overrides, path.name))


def apply_overrides(config: dict, overrides: list[str] | tuple[str, ...], name: str) -> dict:
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected key=value")
        node = config
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if last not in node:
            raise SystemExit(f"--set {key}: no such key in {name}")
        node[last] = value
    return config


def variant_configs(path: Path = CONFIG) -> dict[str, dict]:
    """{variant name: its config}: the main config with the variant's scrape intervals."""
    raw = yaml.safe_load(path.read_text())
    out = {}
    for name, spec in (raw.get("variants") or {}).items():
        sets = [f"scrape_intervals.{job}={value}" for job, value in (spec.get("scrape_intervals") or {}).items()]
        out[name] = derive(apply_overrides(copy.deepcopy(raw), sets, f"{path.name} variants.{name}"))
    return out


def lookup(config: dict, dotted: str, template: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise SystemExit(f"{template}: ${{{dotted}}} is not in the config")
        node = node[part]
    if isinstance(node, dict):
        raise SystemExit(f"{template}: ${{{dotted}}} names a section, not a value")
    return node


def render_template(text: str, config: dict, name: str) -> str:
    text = PLACEHOLDER.sub(lambda m: str(lookup(config, m.group(1), name)), text)
    return add_runbook_urls(text, str(config["runbook_url"]))


def add_runbook_urls(text: str, runbook: str) -> str:
    """Append `runbook_url: <runbook>#<alertname in lower case>` to each alert's
    annotations: the anchor a `## AlertName` heading of the runbook renders to."""
    out: list[str] = []
    alert, ann_indent = None, None  # inside an alert's annotations block when ann_indent is set

    def close() -> None:
        nonlocal ann_indent
        if alert and ann_indent is not None:
            at = len(out)
            while at and not out[at - 1].strip():  # before the blank lines that end the block
                at -= 1
            out.insert(at, f"{' ' * ann_indent}runbook_url: {runbook}#{alert.lower()}\n")
        ann_indent = None

    for line in text.splitlines(keepends=True):
        indent = len(line) - len(line.lstrip(" "))
        if ann_indent is not None and line.strip() and indent < ann_indent:
            close()
        m = re.match(r"^( *)- alert: (\w+)\s*$", line)
        if m:
            alert = m.group(2)
        elif alert and line.strip() == "annotations:":
            ann_indent = indent + 2
        out.append(line)
    close()
    return "".join(out)


def jobs_read(template: str, config: dict) -> str:
    """The scrape intervals a template's values depend on: those of the jobs whose section
    or interval it reads (`job 30s, ...`), in the config's order."""
    keys = {m.group(1) for m in PLACEHOLDER.finditer(template)}
    read = [job for job in config["scrape_intervals"] if any(k.startswith(f"{job}.") or k == f"scrape_intervals.{job}" for k in keys)]
    return ", ".join(f"{job} {config['scrape_intervals'][job]}" for job in read) or "none read"


def render_all(config: dict, variant: str | None = None) -> dict[str, str]:
    """Return {file name: text} for every rule file and the manifest."""
    out: dict[str, str] = {}
    groups: list[dict] = []
    intervals = ", ".join(f"{job} {value}" for job, value in config["scrape_intervals"].items())
    where = f"the `{variant}` variant of rules/config.yaml" if variant else "rules/config.yaml"
    for template in sorted(TEMPLATES.glob("*.rules.yml.tmpl")):
        name = template.name.removesuffix(".tmpl")
        source = template.read_text()
        text = render_template(source, config, template.name)
        parsed = yaml.safe_load(text)  # fail here, not in Prometheus, on broken YAML
        groups.extend(parsed["groups"])
        header = (
            f"# GENERATED by rules/generate.py from rules/templates/{template.name} and\n"
            f"# {where}. Do not edit: change those and run `python rules/generate.py`.\n"
            f"# For these scrape intervals: {jobs_read(source, config)}.\n"
        )
        out[name] = header + text
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "llm-health",
            "labels": {"app.kubernetes.io/name": "llm-health", "role": "alert-rules"},
        },
        "spec": {"groups": groups},
    }
    out[MANIFEST] = (
        f"# GENERATED by rules/generate.py from rules/templates/ and {where}:\n"
        f"# the same rules as the *.rules.yml beside it, for the prometheus-operator. Scrape intervals: {intervals}.\n"
        + yaml.dump(manifest, Dumper=_BlockDumper, sort_keys=False, width=1000)
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--out", type=Path, default=None, help="directory to write the main config's files into (no variants)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)

    outputs: dict[Path, dict[str, str]] = {(args.out or HERE): render_all(load_config(args.config, args.set))}
    if args.out is None:
        if args.set:
            raise SystemExit("--set needs --out: the committed files are rendered from the config as it is")
        for name, config in variant_configs(args.config).items():
            outputs[HERE / name] = render_all(config, name)
    stale = []
    for directory, files in outputs.items():
        for name, text in files.items():
            path = directory / name
            if args.check:
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path.relative_to(HERE.parent)) if path.is_relative_to(HERE.parent) else str(path))
            else:
                directory.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if stale:
        print("stale, run `python rules/generate.py`: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
