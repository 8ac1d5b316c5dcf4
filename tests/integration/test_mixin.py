"""The monitoring mixin (mixin/), rendered as its users render it: by the `jsonnet` command
(Debian's, 0.18: scripts/install-test-deps.sh installs it) and by the jsonnet Python
package (pyproject's test extra, the C++ 0.20+ library rules/generate.py derives its
windows with). With its defaults it is the committed rule files and dashboards; through
its `_config` it is what `rules/generate.py --set` renders; its alerts pass mixtool's lint
rules, its rules promtool's unit tests, and its PrometheusRule is deploy/kubernetes's.
docs/deploy.md's mixin section is run as written (less `jb`, which no Debian or PyPI package
ships: the test puts the mixin where `jb install` puts it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import _jsonnet
import pytest
import yaml

from tests.fixtures.paths import RULES, load_script
from tests.fixtures.stack import PROMTOOL, run_tool

ROOT = Path(__file__).resolve().parents[2]
MIXIN = ROOT / "mixin"
JSONNET = shutil.which("jsonnet")
generate = load_script(RULES / "generate.py", "rules_generate_mixin")

pytestmark = pytest.mark.skipif(not PROMTOOL or not JSONNET, reason="promtool and jsonnet are not installed (apt-get install prometheus jsonnet)")

RENDER = "local m = (import 'mixin/mixin.libsonnet') + {{ _config+:: {config} }}; {{alerts: m.prometheusAlerts, rules: m.prometheusRules, dashboards: m.grafanaDashboards}}"


def render(config: str = "{}", cli: bool = False) -> dict:
    """The mixin's three outputs with `config` merged into its _config."""
    snippet = RENDER.format(config=config)
    if cli:
        out = subprocess.run([JSONNET or "jsonnet", "-J", str(ROOT), "-e", snippet], capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)
    return json.loads(_jsonnet.evaluate_snippet("test", snippet, jpathdir=[str(ROOT)]))


def groups_of(rendered: dict) -> dict[str, dict]:
    found = [*rendered["alerts"]["groups"], *rendered["rules"]["groups"]]
    by_name = {g["name"]: g for g in found}
    assert len(by_name) == len(found), "a group name twice: kube-prometheus joins alerts and rules into one PrometheusRule"
    return by_name


def file_groups(directory: Path) -> dict[str, dict[str, dict]]:
    """{rule file name: {group name: group}} of the committed (or rendered) rule files."""
    return {p.name: {g["name"]: g for g in yaml.safe_load(p.read_text())["groups"]} for p in sorted(directory.glob("*.rules.yml"))}


def all_groups(directory: Path) -> dict[str, dict]:
    return {name: g for groups in file_groups(directory).values() for name, g in groups.items()}


def intervals(variant: str) -> str:
    """A _config override: the scrape intervals of one of rules/config.yaml's variants."""
    spec = yaml.safe_load((RULES / "config.yaml").read_text())["variants"][variant]["scrape_intervals"]
    return f"{{scrape_intervals+: {json.dumps(spec)}}}"


@pytest.mark.parametrize("cli", [True, False], ids=["jsonnet-command", "jsonnet-python"])
def test_with_its_defaults_the_mixin_is_the_committed_rules_and_dashboards(cli):
    rendered = render(cli=cli)
    assert groups_of(rendered) == all_groups(RULES)
    # Alerts: every group with an alert, whole (the records its alerts read evaluated with
    # them); rules: the groups of records alone.
    for g in rendered["alerts"]["groups"]:
        assert any("alert" in r for r in g["rules"]), g["name"]
    for g in rendered["rules"]["groups"]:
        assert all("record" in r for r in g["rules"]), g["name"]
    assert rendered["rules"]["groups"] and rendered["alerts"]["groups"]
    committed = {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "grafana" / "dashboards").glob("*.json"))}
    assert rendered["dashboards"] == committed


def test_an_override_through_config_is_what_generate_set_renders(tmp_path):
    """A different vLLM selector and 60 s scrapes, through _config and through
    `rules/generate.py --set`: the same rules, and not the defaults (the windows moved)."""
    sets = {"selectors.vllm": 'job="vllm-prod"', "scrape_intervals.vllm": "60s", "scrape_intervals.exporter": "60s"}
    out = subprocess.run(
        [sys.executable, str(RULES / "generate.py"), "--out", str(tmp_path), *(f"--set={k}={v}" for k, v in sets.items())],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    config = '{selectors+: {vllm: \'job="vllm-prod"\'}, scrape_intervals+: {vllm: "60s", exporter: "60s"}}'
    mixin = groups_of(render(config, cli=True))
    assert mixin == all_groups(tmp_path)
    assert mixin != all_groups(RULES)
    vllm = json.dumps(mixin["vllm.alerts"])
    assert 'job=\\"vllm-prod\\"' in vllm and "[3m]" in vllm, "the selector and the 60 s progress window (3 scrapes) reach the alerts"
    # The dashboards read the same values: the vLLM selector and its derived rate window.
    fleet = json.dumps(render(config)["dashboards"]["fleet.json"])
    assert 'job=\\"vllm-prod\\"' in fleet and 'job=\\"vllm\\"' not in fleet


def test_every_alert_passes_mixtools_lint_rules():
    """mixtool's rules: a CamelCase name, severity critical, warning or info, and a summary,
    description and runbook_url, the runbook's own section of that alert."""
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    headings = set(re.findall(r"^## (\w+)", runbook, re.M))
    alerts = [r for g in render()["alerts"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) > 30
    for a in alerts:
        name = a["alert"]
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]*", name), name
        assert a.get("labels", {}).get("severity") in ("critical", "warning", "info"), name
        for key in ("summary", "description", "runbook_url"):
            assert a["annotations"].get(key, "").strip(), (name, key)
        assert a["annotations"]["runbook_url"] == f"docs/runbook.md#{name.lower()}" and name in headings, name
    # runbookURLPattern moves every link.
    moved = render("{runbookURLPattern: 'https://runbooks.example/llm-health#%s'}")
    urls = {r["annotations"]["runbook_url"] for g in moved["alerts"]["groups"] for r in g["rules"] if "alert" in r}
    assert all(u.startswith("https://runbooks.example/llm-health#") for u in urls) and len(urls) == len(alerts)


def test_the_dashboards_take_their_uids_and_data_source_from_config():
    dashboards = render("{dashboards+: {uids+: {'fleet.json': 'my-fleet'}, datasource: 'thanos'}}")["dashboards"]
    assert dashboards["fleet.json"]["uid"] == "my-fleet" and dashboards["admission.json"]["uid"] == "llm-health-admission"
    for d in dashboards.values():
        (var,) = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
        assert var["current"] == {"text": "thanos", "value": "thanos"}


def test_promtool_unit_tests_pass_on_the_rendered_rules(tmp_path):
    """rules/tests/*.test.yml, each on rule files written from the mixin's output (the
    committed files' layout: the defaults in rules/, the `fast` variant's intervals in
    rules/fast/), not on the committed files."""
    layout = {"": "{}", "fast": intervals("fast")}
    for sub, config in layout.items():
        rendered = groups_of(render(config))
        out = tmp_path / "rules" / sub
        out.mkdir(parents=True, exist_ok=True)
        for name, groups in file_groups(RULES / sub).items():
            (out / name).write_text(yaml.safe_dump({"groups": [rendered[g] for g in groups]}, sort_keys=False))
    tests = tmp_path / "rules" / "tests"
    shutil.copytree(RULES / "tests", tests)
    files = sorted(tests.glob("*.test.yml"))
    assert len(files) >= 10
    result = run_tool(PROMTOOL or "promtool", "test", "rules", *(str(f) for f in files), timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert result.stdout.count("SUCCESS") >= len(files), result.stdout[-3000:]


def test_a_prometheusrule_from_the_mixin_is_deploy_kubernetes_own():
    """The PrometheusRule kube-prometheus makes of the mixin (its alerts' and rules' groups),
    at the intervals deploy/kubernetes scrapes (the `fast` variant), is
    deploy/kubernetes/prometheusrule.yaml's."""
    shipped = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml").read_text())
    rendered = render(intervals("fast"))
    groups = [*rendered["alerts"]["groups"], *rendered["rules"]["groups"]]
    assert {g["name"]: g for g in groups} == {g["name"]: g for g in shipped["spec"]["groups"]}
    assert len(groups) == len(shipped["spec"]["groups"])


def test_the_documented_mixin_section_as_written(tmp_path):
    """docs/deploy.md's mixin section: its `_config` override in a file of its own, the mixin
    where `jb install` puts it (vendor/<the import path>), then its jsonnet commands, run as
    written: rules for the user's own job names and scrape interval, no generated file edited."""
    doc = (ROOT / "docs" / "deploy.md").read_text()
    section = doc[doc.index("## The monitoring mixin") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    (install,) = [b for lang, b in blocks if lang == "sh" and "jb install" in b]
    (mine,) = [b for lang, b in blocks if lang == "jsonnet"]
    (commands,) = [b for lang, b in blocks if lang == "sh" and "jsonnet " in b]
    path = re.search(r"jb install (\S+)@\S+", install)
    assert path, install
    # What `jb install` writes (legacyImports, `jb init`'s default): the package under its
    # path, and a link named after its last element, the name the doc imports.
    vendor = tmp_path / "vendor"
    shutil.copytree(MIXIN, vendor / path[1], ignore=shutil.ignore_patterns("out"))
    (vendor / Path(path[1]).name).symlink_to(vendor / path[1])
    (tmp_path / "mine.jsonnet").write_text(mine)
    for line in commands.strip().splitlines():
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, (line, result.stderr[-3000:])
    alerts, rules = (yaml.safe_load((tmp_path / name).read_text()) for name in ("alerts.yaml", "rules.yaml"))
    text = json.dumps([alerts, rules])
    # The override's own job names and its 60 s vLLM scrape (a 3m progress window).
    assert 'job=\\"vllm-prod\\"' in text and 'job=\\"vllm\\"' not in text
    (hung,) = [r for g in alerts["groups"] for r in g["rules"] if r.get("alert") == "VLLMEngineHung"]
    assert "[3m]" in json.dumps(hung)
    assert len(list((tmp_path / "dashboards").glob("*.json"))) == 3
    check = run_tool(PROMTOOL or "promtool", "check", "rules", str(tmp_path / "alerts.yaml"), str(tmp_path / "rules.yaml"))
    assert check.returncode == 0, check.stdout + check.stderr


def test_make_mixin_writes_the_defaults_rendering(tmp_path):
    """`make mixin`, as written, in a copy of the Makefile and the mixin: the committed
    rules and dashboards."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copytree(MIXIN, tmp_path / "mixin", ignore=shutil.ignore_patterns("out"))
    result = subprocess.run(["make", "mixin"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "mixin" / "out"
    groups = [*yaml.safe_load((out / "alerts.yaml").read_text())["groups"], *yaml.safe_load((out / "rules.yaml").read_text())["groups"]]
    assert {g["name"]: g for g in groups} == all_groups(RULES)
    committed = {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "grafana" / "dashboards").glob("*.json"))}
    assert {p.name: json.loads(p.read_text()) for p in sorted((out / "dashboards").glob("*.json"))} == committed


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{scrape_intervals+: {vllm: 'soon'}}", "scrape_intervals.vllm: 'soon' is not a Prometheus duration"),
        ("{routes+: {chat: {deadline: '30s'}}}", "routes.chat: needs exactly `deadline` and `backends`"),
        ("{evidence+: {still_scrapes: 1}}", "evidence.still_scrapes must be a whole number of scrapes, at least 2"),
    ],
)
def test_a_bad_override_is_an_error_that_names_it(config, message):
    """The mixin's errors are the generator's: a bad value in _config names its key."""
    with pytest.raises(RuntimeError, match=re.escape(message)):
        render(config)
