"""The queue-age alerts (LLMEngineQueueAgeOverDeadline, VLLMEngineQueueAgeOverDeadline)
through promtool at 15 s, 30 s and 60 s scrapes and at the `fast` variant's (vLLM 15 s,
exporter 5 s), on rules rendered for that interval with the routes of
tests/fixtures/queue_age_rules.py: silent on a deep but young queue, firing on an old one
from the evaluation after the truth says so, silent while the figure is unknown (absent,
failed scrapes, a restart between the samples compared) and once the queue drains
(tests/fixtures/queue_age_rules.py says what each engine and backend does)."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from tests.fixtures.paths import RULES, load_script
from tests.fixtures.queue_age_rules import ROUTES, suite
from tests.fixtures.stack import PROMTOOL, run_tool

pytestmark = pytest.mark.skipif(not PROMTOOL, reason="promtool is not installed (apt-get install prometheus)")

generate = load_script(RULES / "generate.py", "rules_generate_queue_age")


def config_for(vllm_s: int, exporter_s: int) -> dict:
    raw = yaml.safe_load((RULES / "config.yaml").read_text())
    raw = copy.deepcopy(raw)
    raw["scrape_intervals"].update({"vllm": f"{vllm_s}s", "llamacpp": f"{vllm_s}s", "exporter": f"{exporter_s}s"})
    raw["routes"] = {route: {"deadline": f"{deadline}s", "backends": backends} for route, (deadline, backends) in ROUTES.items()}
    return generate.derive(raw)


CASES = [(15, 15), (30, 30), (60, 60), (15, 5)]


@pytest.mark.parametrize(("vllm_s", "exporter_s"), CASES, ids=[f"vllm-{v}s-exporter-{e}s" for v, e in CASES])
def test_queue_age_alerts_at_every_evaluation(tmp_path, vllm_s, exporter_s):
    config = config_for(vllm_s, exporter_s)
    window = int(generate.seconds(config["vllm"]["queue_age_window"], "vllm.queue_age_window"))
    assert window == max(30, 2 * vllm_s)
    files = []
    for name, text in generate.render_all(config).items():
        if name in {"vllm.rules.yml", "llm-health.rules.yml"}:
            (tmp_path / name).write_text(text)
            files.append(tmp_path / name)
    test_file, firing = suite(tmp_path / "queue-age.test.yml", files, window, vllm_s, exporter_s)
    assert firing > 300, "the suite must see both alerts fire, many times"
    result = run_tool(PROMTOOL, "test", "rules", str(test_file), timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[:6000]


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ("{chat: {deadline: 30s}}", "needs exactly `deadline` and `backends`"),
        ("{chat: {deadline: soon, backends: [a]}}", "routes.chat.deadline"),
        ("{chat: {deadline: 30s, backends: []}}", "routes.chat.backends: a non-empty list"),
        ("{chat: {deadline: 30s, backends: ['a\"b']}}", "is not a backend name"),
        ("{chat: {deadline: 30s, backends: [a, a]}}", "a backend is named twice"),
        ("{'ch at': {deadline: 30s, backends: [a]}}", "routes.ch at: a route name"),
        ("[chat]", "routes: must be a mapping"),
    ],
)
def test_generator_refuses_a_bad_route(tmp_path, routes, message):
    raw = (RULES / "config.yaml").read_text()
    head, _, tail = raw.partition("\nroutes:\n")
    tail = tail[tail.index("\n# GPU faults") :]
    bad = tmp_path / "config.yaml"
    bad.write_text(f"{head}\nroutes: {routes}\n{tail}")
    result = run_tool(sys.executable, str(RULES / "generate.py"), "--config", str(bad), "--out", str(tmp_path / "out"))
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_no_routes_leaves_the_alert_nothing_to_read(tmp_path):
    raw = (RULES / "config.yaml").read_text()
    head, _, tail = raw.partition("\nroutes:\n")
    tail = tail[tail.index("\n# GPU faults") :]
    empty = tmp_path / "config.yaml"
    empty.write_text(f"{head}\nroutes: {{}}\n{tail}")
    out = tmp_path / "out"
    result = run_tool(sys.executable, str(RULES / "generate.py"), "--config", str(empty), "--out", str(out))
    assert result.returncode == 0, result.stderr
    text = (out / "llm-health.rules.yml").read_text()
    assert "- record: route:llm" not in text
    assert "No routes in rules/config.yaml" in text
    check = subprocess.run([PROMTOOL, "check", "rules", str(out / "llm-health.rules.yml")], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
