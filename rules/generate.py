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
of the stacks this repository ships (compose, Kubernetes) into rules/<variant>/. The
derivation has one definition, mixin/lib/derive.libsonnet, which the monitoring mixin runs
too (so this needs the jsonnet Python package); the committed render also writes the
mixin's copies of the config and the templates into mixin/generated/ (rules/README.md,
"The mixin").
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

# The engines' profiles of this checkout (the package beside this directory), whatever
# llm_health is installed: the rules are written from them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "exporter"))
from llm_health.core import engines

HERE = Path(__file__).resolve().parent
MIXIN = HERE.parent / "mixin"
TEMPLATES = HERE / "templates"
ENGINE_TEMPLATE = HERE / "templates" / "engine.tmpl"
CONFIG = HERE / "config.yaml"
MANIFEST = "prometheusrule.yaml"
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_.]*)\}")


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks, so the manifest reads like the rules."""


def _str_representer(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_representer)


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"((?:[0-9]+(?:ms|s|m|h|d))+)")


def seconds(text: object, where: str) -> float:
    """A Prometheus duration (30s, 5m, 1m30s) in seconds, as the derivation reads it; for
    the tests and tools that read a rendered window back. SystemExit naming `where`."""
    value = str(text).strip()
    if not _DURATION.fullmatch(value):
        raise SystemExit(f"{where}: {value!r} is not a Prometheus duration (30s, 5m, 1h)")
    total = sum(float(n) * _UNITS[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h|d)", value))
    if total <= 0:
        raise SystemExit(f"{where}: {value!r} must be longer than zero")
    return total


def engine_sections(config: dict) -> list[str]:
    """The engines' rules sections: each job of `scrape_intervals:` with a template of its
    name or a registered engine's rules section (`Profile.rules`); the exporter's job has
    its own template (llm-health). Adding an engine's section is its profile and its config
    (two windows: progress_window and rate_window), and a template where
    rules/templates/engine.tmpl does not say enough."""
    intervals = config.get("scrape_intervals")
    sections = {p.rules for p in engines.PROFILES}
    return [job for job in intervals if job in sections or (TEMPLATES / f"{job}.rules.yml.tmpl").is_file()] if isinstance(intervals, dict) else []


SIGNALS = re.compile(r"^( *)\$\{signals\.([A-Za-z0-9_]+)\.([a-z]+)\}[ \t]*$", re.M)
# Each kind of signals line: what it reads of each series, and its window in the section.
MOVED = "(max_over_time({s}[{w}]) < Inf) > bool (min_over_time({s}[{w}]) > -Inf)"
KINDS = {
    "progress": (MOVED, "progress_window"),
    "work": (MOVED, "progress_window"),
    "resets": ("resets({s}[{w}])", "progress_window"),
    "output": (MOVED, "no_output_window"),
}


def section_profiles(section: str, where: str) -> list[engines.Profile]:
    """The registered engines whose raw rules are `section`; SystemExit naming `where`."""
    profiles = [p for p in engines.PROFILES if p.rules == section]
    if not profiles:
        raise SystemExit(f"{where}: no registered engine has the rules section {section!r}")
    if len({p.rules_by for p in profiles}) > 1:
        raise SystemExit(f"{where}: the engines of {section!r} keep their verdicts by different labels")
    return profiles


def signals(section: str, kind: str, where: str = "rules/generate.py") -> dict[str, str]:
    """{series: its `signal` label}: the signals of `kind` (KINDS) the rules of `section`
    read, of every engine whose rules they are, in the registry's order."""
    profiles = section_profiles(section, where)
    counters = {s: name for p in profiles for s, name in p.counters.items()}
    if kind in ("work", "resets"):
        return counters
    if kind == "progress":
        return {**counters, **{s: name for p in profiles for s, name in p.gauges.items()}}
    if kind == "output":
        return {s: counters[s] for p in profiles for s in p.output}
    raise SystemExit(f"{where}: ${{signals.{section}.{kind}}}: the kinds are {', '.join(KINDS)}")


def by_labels(section: str, where: str = "rules/generate.py") -> str:
    """The labels the rules of `section` keep a verdict by: job, instance and `rules_by`."""
    return ", ".join(("job", "instance", *section_profiles(section, where)[0].rules_by))


def signal_lines(section: str, kind: str, indent: str, where: str) -> str:
    """The expression a `${signals.<section>.<kind>}` line stands for, one signal a line,
    each kept apart by its `signal` label until the sum (the config's placeholders left in)."""
    read, window = KINDS.get(kind, (MOVED, ""))
    terms = [
        f'label_replace({read.format(s=f"{series}{{${{selectors.{section}}}}}", w=f"${{{section}.{window}}}")}, "signal", "{name}", "", "")'
        for series, name in signals(section, kind, where).items()
    ]
    body = f"\n{indent}  or\n".join(f"{indent}    {term}" for term in terms)
    return f"{indent}sum by ({by_labels(section, where)}) (\n{body}\n{indent})"


def with_signals(text: str, where: str) -> str:
    """A template with each `${signals.<section>.<kind>}` line written out (`signal_lines`)."""
    return SIGNALS.sub(lambda m: signal_lines(m.group(2), m.group(3), m.group(1), where), text)


def engine_template(section: str) -> str:
    """rules/templates/engine.tmpl for an engine section with no template of its own: its
    `@...@` words filled from the section's profiles (the first one's title names it)."""
    where = f"{ENGINE_TEMPLATE.name} for {section}"
    profiles = section_profiles(section, where)
    title = profiles[0].title
    in_flight = dict.fromkeys(s for p in profiles for s in (*p.running, *p.waiting))
    words = {
        "@section@": section,
        "@title@": title,
        "@alert@": re.sub(r"[^A-Za-z0-9]", "", title[:1].upper() + title[1:]),
        "@by@": by_labels(section, where),
        "@in_flight@": "|".join(re.escape(s) for s in in_flight),
    }
    text = ENGINE_TEMPLATE.read_text()
    for word, value in words.items():
        text = text.replace(word, value)
    return text


def templates(config: dict) -> dict[str, tuple[str, str]]:
    """{rule file: (the template's name, its text with the signals written in)}: each
    template of rules/templates/, and rules/templates/engine.tmpl for each engine section
    with no template of its own."""
    out = {t.name.removesuffix(".tmpl"): (t.name, with_signals(t.read_text(), t.name)) for t in TEMPLATES.glob("*.rules.yml.tmpl")}
    for section in engine_sections(config):
        if f"{section}.rules.yml" not in out:
            out[f"{section}.rules.yml"] = (ENGINE_TEMPLATE.name, with_signals(engine_template(section), ENGINE_TEMPLATE.name))
    return dict(sorted(out.items()))


_DERIVE = "local d = import 'derive.libsonnet'; function(config, engines) d.derive(config, engines)"


def derived(config: dict) -> dict[str, dict]:
    """{section: {key: value}}: every window derived from its job's scrape interval, each
    job's evidence window and samples, the engines' queue-age windows and the exporter
    layer's route records, by mixin/lib/derive.libsonnet: the one definition, which the
    monitoring mixin runs on its `_config` too (so a jsonnet user's overrides give what
    `--set` gives here). Needs the jsonnet Python package. SystemExit with the config error."""
    try:
        import _jsonnet  # the jsonnet package (pip install jsonnet): the mixin's own evaluator
    except ImportError as e:
        raise SystemExit(
            "rules/generate.py needs the jsonnet Python package (pip install jsonnet): the windows are derived by mixin/lib/derive.libsonnet"
        ) from e
    codes = {"config": json.dumps(config), "engines": json.dumps(engine_sections(config))}
    try:
        out = _jsonnet.evaluate_snippet("derive", _DERIVE, jpathdir=[str(MIXIN / "lib")], tla_codes=codes)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else "the derivation failed"
        raise SystemExit(first.removeprefix("RUNTIME ERROR: ")) from None
    return json.loads(out)


def derive(config: dict) -> dict:
    """`config` with its derived values set (`derived`): every window that counts samples
    raised to span its job's evidence scrapes, `<job>.evidence_window` and
    `<job>.evidence_samples`, `<job>.queue_age_window` and `queue_age_range` where the
    engine has a `queue_age_deadline`, and `exporter.route_rules`."""
    for section, values in derived(config).items():
        config[section].update(values)
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
    for name, (template, source) in templates(config).items():
        text = render_template(source, config, template)
        parsed = yaml.safe_load(text)  # fail here, not in Prometheus, on broken YAML
        groups.extend(parsed["groups"])
        header = (
            f"# GENERATED by rules/generate.py from rules/templates/{template} and\n"
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


def libsonnet(what: str, source: str, by: str, value: object) -> str:
    """A generated file of the mixin (mixin/generated/): a header saying what it holds,
    from which source and by which generator, then the value as JSON, which jsonnet reads
    as it is."""
    return f"// {what}.\n// GENERATED by {by} from {source}. Do not edit: change that and run `python {by}`.\n" + json.dumps(value, indent=2) + "\n"


# A placeholder that stands for YAML list items (a line of its own), and the derived value
# that holds the same items as values, for the mixin.
FRAGMENTS = {"exporter.route_rules": "exporter.route_records"}


def templated(value: object, known: Callable[[str], bool] = lambda key: True) -> object:
    """`value` with each string that holds a `${section.key}` the config has (`known`) cut
    into `{__parts__: [text, {key: section.key}, text, ...]}`, the mixin's templates
    (mixin/generated/): the mixin joins the parts with its _config's values, scanning no
    string (jsonnet's string functions are slow: scanning every string of the dashboards
    took seconds a render)."""
    if isinstance(value, dict):
        return {k: templated(v, known) for k, v in value.items()}
    if isinstance(value, list):
        return [templated(v, known) for v in value]
    if not isinstance(value, str) or not any(known(m.group(1)) for m in PLACEHOLDER.finditer(value)):
        return value
    parts: list[object] = []
    at = 0
    for m in PLACEHOLDER.finditer(value):
        if known(m.group(1)):
            parts += [value[at : m.start()], {"key": m.group(1)}]
            at = m.end()
    parts.append(value[at:])
    return {"__parts__": [p for p in parts if p != ""]}


def template_values(text: str) -> object:
    """A template as values (`templated`), each fragment's line a marker item
    `{__fragment__: <the key of its values>}`: what the mixin fills in. (The mixin does not
    parse YAML itself: Debian 12's jsonnet 0.18 parses block scalars wrong.)"""
    for key, values in FRAGMENTS.items():
        text = re.sub(rf"^( *)\$\{{{re.escape(key)}\}}[ \t]*$", lambda m, v=values: f"{m.group(1)}- __fragment__: {v}", text, flags=re.M)
    return templated(yaml.safe_load(text))


def mixin_files(path: Path = CONFIG) -> dict[str, str]:
    """The mixin's copies of this pack's sources (mixin/generated/: a mixin installed by
    jsonnet-bundler has only its own directory): the config as written (the mixin derives
    its windows itself, by the definition `derive` runs) and the templates as values."""
    raw = yaml.safe_load(path.read_text())
    raw.pop("variants", None)
    values = {name: template_values(source) for name, (_, source) in templates(raw).items()}
    return {
        "config.libsonnet": libsonnet("The defaults of the mixin's _config (less `variants:`)", "rules/config.yaml", "rules/generate.py", raw),
        "templates.libsonnet": libsonnet(
            "The rule templates as values, by the file each renders, `${section.key}` cut out of their strings (`templated`)",
            "rules/templates/*.rules.yml.tmpl",
            "rules/generate.py",
            values,
        ),
    }


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
        outputs[MIXIN / "generated"] = mixin_files(args.config)
    return sync({directory / name: text for directory, files in outputs.items() for name, text in files.items()}, args.check, "python rules/generate.py")


def sync(files: dict[Path, str], check: bool, command: str) -> int:
    """Each file written with its text, or with ``check`` compared with it: 0, or 1 once the
    stale ones are named with the command that renders them again (the three generators':
    rules/, grafana/ and deploy/kubernetes/)."""
    stale = []
    for path, text in files.items():
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(str(path.relative_to(HERE.parent)) if path.is_relative_to(HERE.parent) else str(path))
    if stale:
        print(f"stale, run `{command}`: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
