"""Several exporters for one fleet, the Prometheus way, on real processes.

Three `llm-health serve` processes share one simulated fleet: shard 0 of 2 twice (an HA
pair) and shard 1 of 2 once, each given the whole backend list. A real Prometheus scrapes
the three under one job with the shipped rules (rendered for 1 s scrapes, as the stack
tests do). Proven here:

* every backend is exported once per replica that owns it (twice for shard 0, once for
  shard 1), none by a replica that does not;
* the split is the one Prometheus' own `hashmod` relabelling makes of the same names
  (read back from Prometheus' target labels, for 300 names and 7 shards), and the
  sharded `/probe` job of docs/scaling.md keeps exactly shard 0's targets;
* `LLMBackendHung` fires once per hung backend, with each digest once in its evidence,
  and never for a busy one; the fleet dashboard's totals count each backend once;
* `config check` refuses a shard that cannot cover the fleet, naming the key.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import yaml

from llm_health.core.shard import Shard, hashmod
from tests.fixtures.paths import ROOT
from tests.fixtures.stack import free_port, render_rules
from tests.integration.test_stack import FAST
from tests.integration.test_stack_full import panel_queries

NAMES = [f"gpu-{i}" for i in range(10)]


def exporter_config(servers: dict[str, str], shard: tuple[int, int]) -> str:
    return yaml.safe_dump(
        {
            "global": {"interval": "1s", "hung_after_seconds": "2s", "probe_interval": "1h", "metrics_timeout": "3s", "models_timeout": "3s"},
            "backends": [{"name": n, "url": url} for n, url in servers.items()],
            "shard": {"index": shard[0], "total": shard[1]},
        }
    )


def hashmod_job(names: list[str], modulus: int, dead: str) -> dict:
    """A scrape job whose only purpose is its relabelling: one target per name, labelled
    `shard` by Prometheus' hashmod of the `backend` label. Scraped hourly at a closed port:
    the labels are made at discovery, whatever the scrape does."""
    return {
        "job_name": "hashmod",
        "scrape_interval": "1h",
        "scrape_timeout": "1s",
        "static_configs": [{"targets": [dead], "labels": {"backend": n}} for n in names],
        "relabel_configs": [{"source_labels": ["backend"], "modulus": modulus, "target_label": "shard", "action": "hashmod"}],
    }


def documented_probe_shard_job(urls: list[str], dead: str) -> dict:
    """docs/scaling.md's /probe job for shard 0 of 2, as written there, on these targets, its
    exporter address a closed port, scraped hourly (only its relabelling is under test)."""
    text = (ROOT / "docs" / "scaling.md").read_text()
    block = re.search(r"```yaml\n(# /probe targets split the same way.*?)```", text, re.S)
    assert block, "docs/scaling.md's sharded /probe job is gone"
    (job,) = yaml.safe_load(block.group(1))
    assert job["relabel_configs"][0]["action"] == "hashmod" and job["relabel_configs"][1]["regex"] == "0"
    job["relabel_configs"][-1]["replacement"] = dead
    return {**job, "job_name": "doc-probe-shard-0", "scrape_interval": "1h", "scrape_timeout": "1s", "static_configs": [{"targets": urls}]}


async def test_two_shards_and_an_ha_pair_give_one_answer_per_backend(tmp_path, prometheus_factory, sim_server, ticker, llm_health):
    owner = {n: hashmod(n, 2) for n in NAMES}
    assert set(owner.values()) == {0, 1}, owner  # both shards hold backends
    by_shard = {i: [n for n in NAMES if owner[n] == i] for i in (0, 1)}
    hung = {by_shard[0][0], by_shard[1][0]}  # one hung backend in each shard
    busy = {by_shard[0][1], by_shard[1][1]} if len(by_shard[1]) > 1 else {by_shard[0][1]}
    servers = {}
    for n in NAMES:
        s = await sim_server(n, scenario="hung" if n in hung else "saturated" if n in busy else "idle")
        ticker.append(s)
        servers[n] = s.url

    replicas = {}
    for label, shard in (("a", (0, 2)), ("b", (0, 2)), ("c", (1, 2))):
        f = tmp_path / f"exporter-{label}.yml"
        f.write_text(exporter_config(servers, shard))
        replicas[label] = llm_health("serve", "--config.file", str(f))
    for p in replicas.values():
        await asyncio.to_thread(p.wait_ready)
    addrs = {label: p.url.removeprefix("http://") for label, p in replicas.items()}

    names300 = [f"backend-{i}" for i in range(300)] + NAMES
    probe_urls = [f"http://10.0.{i // 200}.{i % 200}:8000" for i in range(60)]
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p.resolve()) for p in render_rules(tmp_path / "rules", FAST)],
        "scrape_configs": [
            {"job_name": "llm-health", "static_configs": [{"targets": list(addrs.values())}]},
            hashmod_job(names300, 7, f"127.0.0.1:{free_port()}"),
            documented_probe_shard_job(probe_urls, f"127.0.0.1:{free_port()}"),
        ],
    }
    prom = prometheus_factory({}, config=config)

    async def query(expr: str) -> list:
        return await asyncio.to_thread(prom.query, expr)

    # --- the split is Prometheus' hashmod ------------------------------------------------------
    def discovered(job: str, every: list[dict]) -> list[dict]:
        return [t for t in every if t["labels"].get("job") == job]

    every: list[dict] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # discovery may hand the two jobs over apart
        every = await asyncio.to_thread(prom.targets)
        if len(discovered("hashmod", every)) == len(names300) and discovered("doc-probe-shard-0", every):
            break
        await asyncio.sleep(0.5)
    theirs = {t["labels"]["backend"]: int(t["labels"]["shard"]) for t in discovered("hashmod", every)}
    assert theirs == {n: hashmod(n, 7) for n in names300}
    assert all(Shard(theirs[n], 7).owns(n) for n in names300)
    kept = {t["labels"]["instance"] for t in discovered("doc-probe-shard-0", every)}
    assert kept == {u for u in probe_urls if Shard(0, 2).owns(u)} and 0 < len(kept) < len(probe_urls)

    # --- each backend once per replica that owns it --------------------------------------------
    want_counts = {n: 2 if owner[n] == 0 else 1 for n in NAMES}
    want_instances = {n: {addrs["a"], addrs["b"]} if owner[n] == 0 else {addrs["c"]} for n in NAMES}
    counts: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and counts != want_counts:
        counts = {r["metric"]["backend"]: int(float(r["value"][1])) for r in await query('count by (backend) (llm_backend_up{job="llm-health"})')}
        await asyncio.sleep(0.5)
    assert counts == want_counts
    instances: dict[str, set[str]] = {}
    for r in await query('llm_backend_up{job="llm-health"}'):
        instances.setdefault(r["metric"]["backend"], set()).add(r["metric"]["instance"])
    assert instances == want_instances

    # --- one LLMBackendHung per hung backend, none for a busy one ------------------------------
    def hung_alerts() -> list[dict]:
        return [a for a in prom.alerts() if a["labels"]["alertname"] == "LLMBackendHung" and a["state"] == "firing"]

    fired: list[dict] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        fired = await asyncio.to_thread(hung_alerts)
        assert not [a for a in fired if a["labels"]["backend"] not in hung], fired
        if {a["labels"]["backend"] for a in fired} == hung:
            break
        await asyncio.sleep(1.0)
    assert sorted(a["labels"]["backend"] for a in fired) == sorted(hung), fired
    # It stays one per backend over further evaluations (the HA pair's second proof
    # arrives at its own round and must not make a second alert).
    for _ in range(8):
        await asyncio.sleep(1.0)
        again = await asyncio.to_thread(hung_alerts)
        assert sorted(a["labels"]["backend"] for a in again) == sorted(hung), again
    for a in again:
        assert "instance" not in a["labels"], a
        digests = a["annotations"]["evidence"].split()
        assert len(digests) == 1 and digests[0].isdigit(), a  # one engine per simulated server: one digest, once
    states = {r["metric"]["backend"] for r in await query('llm_backend_state{state="busy"} == 1')}
    assert busy <= states

    # --- the fleet dashboard's totals count each backend once -----------------------------------
    fleet = [(panel, expr) for board, panel, expr in panel_queries() if board == "fleet.json"]
    answering = [e for p, e in fleet if p == "Backends answering"]
    values = [float((await query(e))[0]["value"][1]) for e in answering]
    assert values == [len(NAMES), len(NAMES)], (answering, values)  # answering, watched
    hung_total = next(e for p, e in fleet if p == "Backends hung")
    assert float((await query(hung_total))[0]["value"][1]) == len(hung)
    running_expr = next(e for p, e in fleet if p == "Requests running and waiting")
    running = {r["metric"]["backend"]: float(r["value"][1]) for r in await query(running_expr)}
    for n in busy:
        direct = {float(r["value"][1]) for r in await query(f'llm_backend_requests_running{{backend="{n}"}}')}
        assert len(direct) == 1 and running[n] == direct.pop(), (n, running)  # not doubled by the HA pair


def test_config_check_refuses_a_shard_that_cannot_cover_the_fleet(tmp_path):
    f = tmp_path / "bad.yml"
    f.write_text("backends:\n  - {name: gpu0, url: 'http://127.0.0.1:1'}\nshard: {index: 2, total: 2}\n")
    out = subprocess.run([sys.executable, "-m", "llm_health", "config", "check", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "shard.index" in out.stderr and "must be below shard.total (2)" in out.stderr, out
    f.write_text("backends:\n  - {name: gpu0, url: 'http://127.0.0.1:1'}\n  - {name: gpu1, url: 'http://127.0.0.1:2'}\nshard: {index: 1, total: 2}\n")
    out = subprocess.run([sys.executable, "-m", "llm_health", "config", "check", str(f)], capture_output=True, text=True, timeout=60)
    watched = sum(1 for n in ("gpu0", "gpu1") if hashmod(n, 2) == 1)
    assert out.returncode == 0 and f"{watched} backends (shard 1/2 of 2 configured)" in out.stdout, out
