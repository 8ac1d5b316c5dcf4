"""A test engine with raw rules, "abacus", added here and nowhere else: its profile and a
captured payload. Registered (core.engines.register), its payload proves its series
(tests/unit/test_engine_signals.py's check), its rules are written from its profile by
rules/generate.py (rules/templates/engine.tmpl: it has no template of its own), pass
`promtool check rules` and a `promtool test rules` case (hung pages, busy does not), and
the exporter serves its verdicts from that payload read over HTTP. Adding an engine is
its profile, its payloads and its rules section (docs/architecture.md, "Adding an engine")."""

from __future__ import annotations

import asyncio
import time

import pytest
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llm_health.config.exporter import Backend, Config, Timing
from llm_health.core import engines
from llm_health.core.engines import Profile
from llm_health.exporter.app import Exporter
from tests.fixtures.paths import RULES, load_script
from tests.fixtures.stack import PROMTOOL, run_tool
from tests.unit.test_engine_signals import rules_read, unknown, unproven

ABACUS = Profile(
    name="abacus",
    title="Abacus",
    prefix="abacus_",
    marker="abacus_busy_slots",
    running=("abacus_busy_slots",),
    waiting=("abacus_queue_depth",),
    steps="abacus_passes_total",
    generation_tokens="abacus_tokens_total",
    counters={"abacus_passes_total": "passes", "abacus_tokens_total": "tokens"},
    gauges={"abacus_busy_slots": "busy", "abacus_queue_depth": "queued"},
    unit_labels=("model",),
    rules="abacus",
    rules_by=("model",),
    payloads=("abacus-*.prom",),
)

# Its captured payload (the numbers a test moves: passes and tokens).
PAYLOAD = """# HELP abacus_busy_slots Slots computing.
# TYPE abacus_busy_slots gauge
abacus_busy_slots{model="m"} 2
# HELP abacus_queue_depth Requests waiting for a slot.
# TYPE abacus_queue_depth gauge
abacus_queue_depth{model="m"} 1
# HELP abacus_passes_total Forward passes.
# TYPE abacus_passes_total counter
abacus_passes_total{model="m"} {passes}
# HELP abacus_tokens_total Tokens produced.
# TYPE abacus_tokens_total counter
abacus_tokens_total{model="m"} {tokens}
"""

SECTION = {"rate_window": "5m", "progress_window": "1m", "hung_for": "0s", "eval_interval": "5s", "down_for": "2m"}

generate = load_script(RULES / "generate.py", "rules_generate_abacus")
needs_promtool = pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (apt-get install prometheus)")


def payload(passes: int = 100, tokens: int = 600) -> str:
    return PAYLOAD.replace("{passes}", str(passes)).replace("{tokens}", str(tokens))


@pytest.fixture
def abacus(tmp_path):
    engines.register(ABACUS)
    try:
        yield tmp_path
    finally:
        engines.unregister("abacus")
    assert "abacus" not in engines.BY_NAME


@pytest.fixture
def rules(abacus):
    """Its rules, rendered by rules/generate.py from the pack's config with its section."""
    raw = yaml.safe_load((RULES / "config.yaml").read_text())
    raw["scrape_intervals"]["abacus"], raw["selectors"]["abacus"], raw["abacus"] = "30s", 'job="abacus"', SECTION
    config = abacus / "config.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert generate.main(["--config", str(config), "--out", str(abacus / "rules")]) == 0
    return abacus / "rules"


def test_its_payload_proves_its_series(abacus):
    (abacus / "abacus-idle.prom").write_text(payload())
    assert unproven(ABACUS, abacus) == []
    assert engines.read(payload()).profile == "abacus"


def test_its_rules_are_written_from_its_profile(rules):
    text = (rules / "abacus.rules.yml").read_text()
    assert "from rules/templates/engine.tmpl" in text and "For these scrape intervals: abacus 30s." in text
    assert unknown("abacus", text) == [] and rules_read(text) == set(ABACUS.wanted) - {engines.START_TIME}
    for series, name in {**ABACUS.counters, **ABACUS.gauges}.items():
        assert f'{series}{{job="abacus"}}[1m30s]' in text and f'"signal", "{name}"' in text
    groups = yaml.safe_load(text)["groups"]
    assert [r["alert"] for g in groups for r in g["rules"] if "alert" in r] == ["AbacusServerHung", "AbacusServerDown", "AbacusScrapeTooSlow"]
    assert {g["name"] for g in yaml.safe_load((rules / "prometheusrule.yaml").read_text().split("\n", 2)[2])["spec"]["groups"]} >= {
        "abacus.rules",
        "abacus.alerts",
    }


def hung_case(text: str) -> dict:
    """A promtool case: target h:1 busy and still for 20 minutes (it pages), b:1 busy and
    moving (it does not)."""
    hung = next(r for g in yaml.safe_load(text)["groups"] for r in g["rules"] if r.get("alert") == "AbacusServerHung")
    labels = {"job": "abacus", "instance": "h:1", "host": "h", "model": "m"}
    annotations = dict(hung["annotations"])
    for word, value in (("{{ $labels.instance }}", "h:1"), ("{{ $labels.job }}", "abacus"), ("{{ $value }}", "3")):
        annotations = {k: v.replace(word, value) for k, v in annotations.items()}
    series = []
    for instance, passes in (("h:1", "100x40"), ("b:1", "100+10x40")):
        target = f'job="abacus", instance="{instance}"'
        series += [
            {"series": f"up{{{target}}}", "values": "1x40"},
            {"series": f'abacus_busy_slots{{{target}, model="m"}}', "values": "2x40"},
            {"series": f'abacus_queue_depth{{{target}, model="m"}}', "values": "1x40"},
            {"series": f'abacus_passes_total{{{target}, model="m"}}', "values": passes},
            {"series": f'abacus_tokens_total{{{target}, model="m"}}', "values": "600x40"},
        ]
    return {
        "rule_files": ["abacus.rules.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "30s",
                "input_series": series,
                "alert_rule_test": [
                    {
                        "eval_time": "10m",
                        "alertname": "AbacusServerHung",
                        "exp_alerts": [{"exp_labels": {**labels, "severity": "critical"}, "exp_annotations": annotations}],
                    },
                    {"eval_time": "10m", "alertname": "AbacusServerDown", "exp_alerts": []},
                ],
            }
        ],
    }


@needs_promtool
def test_its_rules_pass_promtool(rules):
    checked = run_tool(PROMTOOL, "check", "rules", str(rules / "abacus.rules.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (rules / "abacus.test.yml").write_text(yaml.safe_dump(hung_case((rules / "abacus.rules.yml").read_text()), sort_keys=False))
    tested = run_tool(PROMTOOL, "test", "rules", "abacus.test.yml", cwd=rules)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def states(text: str) -> dict[str, str]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "llm_backend_state" and s.value == 1:
                out[s.labels["backend"]] = s.labels["state"]
            if s.name == "llm_backend_info":
                out["profile"] = s.labels["profile"]
    return out


async def test_the_exporter_serves_its_verdicts(abacus, aiohttp_server, aiohttp_client):
    """Its payload over HTTP, moving and then still: the exporter reads it through its
    profile and says busy, then hung."""
    moved = {"passes": 100}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=payload(moved["passes"]), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app)
    timing = Timing(interval=0.2, hung_after_seconds=0.4, probe_interval=60, probe_timeout=0.5, metrics_timeout=1.0, models_timeout=1.0)
    client = await aiohttp_client(
        Exporter(Config(timing=timing, backends=(Backend("abacus-1", str(server.make_url("")).rstrip("/"), "engine", timing),))).app()
    )

    async def until(state: str, move: bool) -> dict[str, str]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            moved["passes"] += move
            seen = states(await (await client.get("/metrics")).text())
            if seen.get("abacus-1") == state:
                return seen
            await asyncio.sleep(0.1)
        raise AssertionError(f"never {state}: {seen}")

    assert (await until("busy", move=True))["profile"] == "abacus"
    await until("hung", move=False)
