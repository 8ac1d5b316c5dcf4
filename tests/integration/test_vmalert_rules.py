"""The shipped rules in VictoriaMetrics (docs/victoriametrics.md): every rule file loads in
vmalert, and the evidence clauses count scrapes in MetricsQL as in Prometheus.

* `vmalert -dryRun` on every shipped rule file (rules/*.rules.yml, rules/fast/*.rules.yml):
  each expression parsed by MetricsQL, each template by vmalert, unknown rule fields
  refused; so a Prometheus-only construct added later fails here. A rule file that uses
  one (`keep_firing_for`, Prometheus >= 2.42) is refused: the check has teeth.
* compose/prometheus.yml's scrape part (tests.fixtures.victoriametrics.scrape_config)
  loads as victoria-metrics' `-promscrape.config` (`-promscrape.config.dryRun`).
* The evidence clauses: `instance:*_scrapes:count<W>` (`count_over_time(up[W]) or up * 0`)
  and `min_over_time(instance:*_scrapes:count<W>[W])` against `<job>.evidence_samples`,
  evaluated in victoria-metrics as vmalert evaluates them (instant queries at times
  aligned to the group's 5s interval, `step=300s`, the recording rule's results written
  back at those times), over 30 minutes of imported `up` series per job at 5, 15, 30 and
  60 s scrapes, at two phases, every scrape up to 0.3 s early or late. MetricsQL counts
  the samples in (t-W, t], Prometheus 3's left-open range, at every evaluation; so the
  hung alert has its evidence at every evaluation at the interval its rules were made
  for and at faster ones, and the `*ScrapeTooSlow` warning's condition holds at every
  evaluation at slower ones (as in Prometheus: tests/integration/test_rule_intervals.py).

* VLLMEngineHungGPUFault, which reads the `ALERTS` vmalert writes to its -remoteWrite.url
  back through -datasource.url, fires in vmalert for the faulted pod only (the series of
  rules/tests/dcgm-vllm.test.yml, kept fresh for two minutes).

Needs Debian's victoria-metrics (victoria-metrics, vmalert); seconds, and two minutes for
VLLMEngineHungGPUFault.
"""

from __future__ import annotations

import concurrent.futures
import random
import re
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.ci import require
from tests.fixtures.paths import ROOT, RULES, load_script
from tests.fixtures.stack import start_sink, wait_until
from tests.fixtures.victoriametrics import (
    VICTORIA_METRICS,
    dry_run,
    install_problem,
    run_tool,
    scrape_config,
    start_victoria_metrics,
    start_vmalert,
)

generate = load_script(RULES / "generate.py", "rules_generate_vm")
RULE_FILES = sorted(RULES.glob("*.rules.yml")) + sorted((RULES / "fast").glob("*.rules.yml"))
CONFIG = yaml.safe_load((RULES / "config.yaml").read_text())
MADE_FOR = {"rules": CONFIG["scrape_intervals"], "rules/fast": CONFIG["variants"]["fast"]["scrape_intervals"]}
# Each evidence record's scrape job: its rule file, the job its `up` carries, the config key.
JOBS = {"vllm.rules.yml": ("vllm", "vllm"), "llamacpp.rules.yml": ("llamacpp", "llamacpp"), "llm-health.rules.yml": ("llm-health", "exporter")}
SCRAPES = (5, 15, 30, 60)
PHASES = (0.0, 2.5)  # seconds after an evaluation time: 0 puts each scrape on a window's edge
JITTER_S = 0.3
SPAN_S = 30 * 60
EVAL_S = 5  # every group that reads these records is evaluated every 5s (rules/config.yaml)
T0 = (int(time.time()) // 3600 - 2) * 3600  # an hour's start (a multiple of every interval here), inside the default retention


def test_every_shipped_rule_file_is_checked():
    assert {p.relative_to(RULES).as_posix() for p in RULE_FILES} >= {f"{d}{n}" for d in ("", "fast/") for n in JOBS}


@pytest.mark.parametrize("rule_file", RULE_FILES, ids=lambda p: p.relative_to(RULES).as_posix())
def test_vmalert_loads_the_shipped_rules(rule_file: Path):
    require(install_problem("vmalert"))
    result = dry_run(rule_file)
    assert result.returncode == 0, result.stdout + result.stderr


def test_vmalert_refuses_a_prometheus_only_field(tmp_path: Path):
    require(install_problem("vmalert"))
    rules = yaml.safe_load((RULES / "llm-health.rules.yml").read_text())
    rules["groups"][0]["rules"][0]["keep_firing_for"] = "5m"
    (tmp_path / "bad.rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    result = dry_run(tmp_path / "bad.rules.yml")
    assert result.returncode != 0 and "keep_firing_for" in result.stdout + result.stderr, result.stdout + result.stderr


def test_compose_scrape_config_loads_in_victoria_metrics(tmp_path: Path):
    require(install_problem("victoria-metrics"))
    assert VICTORIA_METRICS
    cfg = scrape_config(yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text()))
    (tmp_path / "scrape.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    result = run_tool(VICTORIA_METRICS, f"-promscrape.config={tmp_path / 'scrape.yml'}", "-promscrape.config.dryRun", "-loggerLevel=ERROR")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [j["job_name"] for j in cfg["scrape_configs"]][:3] == ["llm-health", "vllm", "llamacpp"]


def _evidence(rule_file: Path) -> tuple[dict, dict, str]:
    """The file's scrape-count record, its ScrapeTooSlow alert, and the hung alert's clause
    on that record (`min_over_time(<record>[W]) >= N`)."""
    rules = [r for g in yaml.safe_load(rule_file.read_text())["groups"] for r in g["rules"]]
    (record,) = [r for r in rules if re.fullmatch(r"instance:\w+_scrapes:count\w+", r.get("record", ""))]
    (too_slow,) = [r for r in rules if r.get("alert", "").endswith("ScrapeTooSlow")]
    clause = re.escape(f"min_over_time({record['record']}[") + r"\w+\]\) >= \d+"
    hung = [m.group(0) for r in rules if r.get("alert", "").endswith("Hung") for m in [re.search(clause, r["expr"])] if m]
    assert len(set(hung)) <= 1, hung
    return record, too_slow, hung[0] if hung else ""


def _stamps(every: int, phase: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [round((T0 + phase + k * every + rng.uniform(-JITTER_S, JITTER_S)) * 1000) for k in range(int(SPAN_S // every))]


@pytest.mark.parametrize("variant", sorted(MADE_FOR))
def test_evidence_clauses_count_in_metricsql_as_in_prometheus(variant: str, tmp_path: Path):
    require(install_problem("victoria-metrics"))
    vm = start_victoria_metrics(tmp_path)
    try:
        files = [ROOT / variant / name for name in JOBS]
        stamps: dict[tuple[str, str], list[int]] = {}
        lines = []
        for i, (job, _) in enumerate(JOBS.values()):
            for every in SCRAPES:
                for phase in PHASES:
                    instance = f"s{every}-p{phase}:1"
                    stamps[job, instance] = _stamps(every, phase, seed=hash((i, every, phase)) & 0xFFFF)
                    lines += [f'up{{job="{job}",instance="{instance}"}} 1 {ms}' for ms in stamps[job, instance]]
        vm.import_prometheus("\n".join(lines))
        evals = list(range(T0, T0 + SPAN_S + 1, EVAL_S))

        def at_every_eval(expr: str) -> list[list]:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda t: vm.query(expr, at=t), evals))

        for path in files:
            checked = 0
            record, too_slow, hung_clause = _evidence(path)
            job, key = JOBS[path.name]
            window = generate.seconds(record["record"].rsplit(":count", 1)[1], record["record"])
            made_for = generate.seconds(MADE_FOR[variant][key], key)
            # (1) the record, as vmalert writes it: one sample per evaluation
            written = []
            for t, result in zip(evals, at_every_eval(record["expr"])):
                for series in result:
                    labels = series["metric"]
                    count = float(series["value"][1])
                    left_open = sum(1 for ms in stamps[job, labels["instance"]] if (t - window) * 1000 < ms <= t * 1000)
                    assert count == left_open, (path.name, labels["instance"], t - T0, count, left_open)
                    written.append(f'{record["record"]}{{job="{job}",instance="{labels["instance"]}"}} {count:g} {t * 1000}')
                    checked += 1
            assert checked >= len(evals) * len(SCRAPES) * len(PHASES) * 0.9, (path.name, checked)
            vm.import_prometheus("\n".join(written))
            # (2) the warning's condition and the hung alert's clause, after two windows and a scrape
            warm = T0 + 2 * window + max(SCRAPES)
            too_slow_at = at_every_eval(too_slow["expr"])
            hung_at = at_every_eval(hung_clause) if hung_clause else [[] for _ in evals]
            for every in SCRAPES:
                for phase in PHASES:
                    instance = f"s{every}-p{phase}:1"
                    slow = [t for t, res in zip(evals, too_slow_at) if t >= warm and any(s["metric"]["instance"] == instance for s in res)]
                    evident = [t for t, res in zip(evals, hung_at) if t >= warm and any(s["metric"]["instance"] == instance for s in res)]
                    n_evals = sum(1 for t in evals if t >= warm)
                    if every <= made_for:
                        assert slow == [], (path.name, instance, "too slow at", [t - T0 for t in slow[:5]])
                        if hung_clause:
                            assert len(evident) == n_evals, (path.name, instance, "evidence missing at some evaluations")
                    else:
                        assert len(slow) == n_evals, (path.name, instance, f"too slow at only {len(slow)} of {n_evals}")
                        assert evident == [], (path.name, instance, "evidence at", [t - T0 for t in evident[:5]])
    finally:
        vm.stop()


@pytest.mark.parametrize("variant", sorted(MADE_FOR))
def test_llm_backend_hung_fires_in_vmalert_with_its_evidence(variant: str, tmp_path: Path):
    """LLMBackendHung of the shipped file, evaluated by vmalert on a hung backend's series:
    it fires, and its `evidence` annotation (vmalert's `query`, `sortByLabel` and `printf`
    templates) parses, with the restarter's own parser, to the exporter's 48-bit digest.
    vmalert's templates differ from Prometheus' where a label is missing (`$labels.x` is
    nil there, "" in Prometheus), so an annotation can render in one and not the other;
    vmalert then drops the alert."""
    require(install_problem("victoria-metrics", "vmalert"))
    from llm_health.core.evidence import DIGEST_BITS, parse_evidence

    digest = (1 << DIGEST_BITS) - 12345
    vm = start_victoria_metrics(tmp_path)
    sink = start_sink()
    vmalert = None
    try:
        now = int(time.time())
        base = 'job="llm-health",instance="127.0.0.1:9118",backend="gpu0"'
        engine = f'{base},model_name="m",engine="0"'
        series = {
            f'llm_backend_state{{{base},state="hung"}}': 1,
            f'llm_backend_engine_state{{{engine},state="hung"}}': 1,
            f"llm_backend_engine_progress_digest{{{engine}}}": digest,
            'up{job="llm-health",instance="127.0.0.1:9118"}': 1,
        }
        vm.import_prometheus("\n".join(f"{name} {value} {(now - age) * 1000}" for name, value in series.items() for age in range(0, 181, 5)))
        vmalert = start_vmalert(tmp_path, [ROOT / variant / "llm-health.rules.yml"], vm.url, notifiers=[sink.url], evaluation_interval="5s")

        def fired() -> dict | None:
            return next((a for a in vmalert.alerts() if a["labels"]["alertname"] == "LLMBackendHung" and a["state"] == "firing"), None)

        try:
            alert = wait_until(fired, timeout=90, interval=1, what="LLMBackendHung firing in vmalert")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; vmalert's log:\n{vmalert.log()}") from None
        assert parse_evidence(alert["annotations"]["evidence"]).digests == {digest}, alert["annotations"]
        assert alert["labels"]["backend"] == "gpu0" and alert["labels"]["severity"] == "critical", alert["labels"]

        def notified() -> bool:
            # Alertmanager's v2 API: the body is the list of alerts
            calls = [c["body"] for c in list(sink.received) if c["path"] == "/api/v2/alerts" and isinstance(c["body"], list)]
            return any(a["labels"]["alertname"] == "LLMBackendHung" for body in calls for a in body)

        wait_until(notified, timeout=60, what="vmalert's notification of LLMBackendHung")
    finally:
        stop_all(vmalert, sink, vm)


def stop_all(*servers) -> None:
    """Each server stopped, in order (one not started, None, skipped)."""
    for server in servers:
        if server is not None:
            server.stop()


def fed(vm, scrape, stop: threading.Event) -> threading.Thread:
    """``scrape(at)``'s series imported into ``vm`` ten minutes back, then "scraped" every
    5 s by a thread until ``stop`` is set: the thread, started."""

    def scraping() -> None:
        while not stop.wait(5 - time.time() % 5):
            vm.import_prometheus(scrape(time.time()))

    now = time.time()
    vm.import_prometheus("\n".join(scrape(now - age) for age in range(600, 0, -5)))
    scraper = threading.Thread(target=scraping, daemon=True)
    scraper.start()
    return scraper


def _raw_fault_case() -> list[tuple[str, str]]:
    """rules/tests/dcgm-vllm.test.yml's first case (two frozen vLLM pods, one on a GPU with
    XID 79, and a target outside Kubernetes): its series and their constant values."""
    doc = yaml.safe_load((RULES / "tests" / "dcgm-vllm.test.yml").read_text())
    series = []
    for s in doc["tests"][0]["input_series"]:
        value, times = s["values"].split("x")
        assert times.isdigit(), s  # every series of the case is a constant
        series.append((s["series"], value))
    return series


def test_vllm_engine_hung_gpu_fault_fires_in_vmalert_from_its_own_alerts(tmp_path: Path):
    """VLLMEngineHungGPUFault reads `ALERTS`, which vmalert writes to its -remoteWrite.url
    and reads back through -datasource.url (docs/victoriametrics.md). rules/fast's
    vllm.rules.yml and dcgm.rules.yml in one vmalert, on the series of the promtool case
    (imported ten minutes back, then "scraped" every 5 s while the test runs): VLLMGPUFault
    fires for the faulted pod's target, VLLMEngineHung for both frozen pods, and
    VLLMEngineHungGPUFault for the faulted pod's engine only, with the hung engine's labels
    (so that Alertmanager routes it to the pager: rules/alertmanager.example.yml), and is
    notified."""
    require(install_problem("victoria-metrics", "vmalert"))

    series = _raw_fault_case()
    faulted, healthy = "10.2.1.5:8000", "10.2.1.6:8000"
    vm = start_victoria_metrics(tmp_path)
    sink = start_sink()
    vmalert = None
    stop = threading.Event()

    def scrape(at: float) -> str:
        return "\n".join(f"{name} {value} {int(at * 1000)}" for name, value in series)

    scraper = fed(vm, scrape, stop)
    try:
        rule_files = [ROOT / "rules" / "fast" / "vllm.rules.yml", ROOT / "rules" / "fast" / "dcgm.rules.yml"]
        vmalert = start_vmalert(tmp_path, rule_files, vm.url, notifiers=[sink.url], evaluation_interval="5s")

        def firing(name: str) -> list[dict]:
            return [a for a in vmalert.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"]

        try:
            paged = wait_until(lambda: firing("VLLMEngineHungGPUFault"), timeout=240, interval=2, what="VLLMEngineHungGPUFault firing in vmalert")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; vmalert's log:\n{vmalert.log()}") from None
        hung = firing("VLLMEngineHung")
        assert sorted(a["labels"]["instance"] for a in hung) == [faulted, healthy], hung
        assert [a["labels"]["instance"] for a in firing("VLLMGPUFault")] == [faulted]
        assert len(paged) == 1, paged
        labels = paged[0]["labels"]
        assert (labels["job"], labels["instance"], labels["model_name"], labels["engine"], labels["severity"]) == ("vllm", faulted, "m", "0", "critical"), (
            labels
        )
        assert "GPU 0" in paged[0]["annotations"]["gpus"] and "79" in paged[0]["annotations"]["gpus"], paged[0]["annotations"]

        def notified() -> bool:
            calls = [c["body"] for c in list(sink.received) if c["path"] == "/api/v2/alerts" and isinstance(c["body"], list)]
            return any(a["labels"]["alertname"] == "VLLMEngineHungGPUFault" for body in calls for a in body)

        wait_until(notified, timeout=60, what="vmalert's notification of VLLMEngineHungGPUFault")
        # Later evaluations: still exactly the faulted pod's engine.
        time.sleep(10)
        assert [a["labels"]["instance"] for a in firing("VLLMEngineHungGPUFault")] == [faulted]
    finally:
        stop.set()
        scraper.join(timeout=10)
        stop_all(vmalert, sink, vm)


def test_queue_age_alerts_fire_in_vmalert(tmp_path: Path):
    """LLMEngineQueueAgeOverDeadline (rules/llm-health.rules.yml: its route records, made
    of `label_replace(vector(...))`, and a `group_left` match) and
    VLLMEngineQueueAgeOverDeadline (rules/fast/vllm.rules.yml: sample differences through
    `offset`, `resets`, `changes`) evaluated by vmalert on the old queues of
    rules/tests/queue-age.test.yml, scraped every 5 s: both fire, with their annotations
    rendered (vmalert drops an alert whose template fails), and the young engine does not.
    The records are read back through VictoriaMetrics, so the alerts come a search latency
    (about 30 s) after their records."""
    require(install_problem("victoria-metrics", "vmalert"))
    vm = start_victoria_metrics(tmp_path)
    sink = start_sink()  # vmalert starts only with a notifier
    vmalert = None
    stop = threading.Event()
    start = time.time() - 600

    def scrape(at: float) -> str:
        t, ms = int(at - start), int(at * 1000)
        lines = [
            f'llm_backend_queue_age_seconds{{job="llm-health",instance="127.0.0.1:9118",backend="gpu0"}} {60 + t} {ms}',
            f'up{{job="llm-health",instance="127.0.0.1:9118"}} 1 {ms}',
        ]
        for name, waiting, running, finished in (("old", 10, 1, 50 + t // 60), ("young", 20, 8, 100 + 12 * (t // 15))):
            unit = f'job="vllm",instance="{name}:8000",model_name="m",engine="0"'
            lines += [
                f"vllm:num_requests_waiting{{{unit}}} {waiting} {ms}",
                f"vllm:num_requests_running{{{unit}}} {running} {ms}",
                f'vllm:request_success_total{{{unit},finished_reason="stop"}} {finished} {ms}',
                f"vllm:num_preemptions_total{{{unit}}} 0 {ms}",
                f'process_start_time_seconds{{job="vllm",instance="{name}:8000"}} 1000 {ms}',
                f'up{{job="vllm",instance="{name}:8000"}} 1 {ms}',
            ]
        return "\n".join(lines)

    scraper = fed(vm, scrape, stop)
    try:
        vmalert = start_vmalert(
            tmp_path, [RULES / "llm-health.rules.yml", RULES / "fast" / "vllm.rules.yml"], vm.url, notifiers=[sink.url], evaluation_interval="5s"
        )

        def firing() -> dict[str, dict] | None:
            found = {a["labels"]["alertname"]: a for a in vmalert.alerts() if a["state"] == "firing" and "QueueAge" in a["labels"]["alertname"]}
            return found if len(found) == 2 else None

        try:
            alerts = wait_until(firing, timeout=180, interval=2, what="both queue-age alerts firing in vmalert")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; vmalert's log:\n{vmalert.log()}") from None
        route = alerts["LLMEngineQueueAgeOverDeadline"]
        assert (route["labels"]["route"], route["labels"]["backends"], route["labels"]["severity"]) == ("chat", "gpu0", "critical"), route["labels"]
        description = route["annotations"]["description"]
        assert "route chat (gpu0)" in description and "deadline of 30s" in description, route["annotations"]
        raw = alerts["VLLMEngineQueueAgeOverDeadline"]
        assert raw["labels"]["instance"] == "old:8000" and "were already" in raw["annotations"]["description"], raw
        engines = {a["labels"].get("instance") for a in vmalert.alerts() if a["labels"]["alertname"] == "VLLMEngineQueueAgeOverDeadline"}
        assert engines == {"old:8000"}, engines
    finally:
        stop.set()
        scraper.join(timeout=10)
        stop_all(vmalert, sink, vm)
