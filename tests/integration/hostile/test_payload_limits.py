"""The exporter's per-payload limits `max_label_length` and `max_engines` (docs/limits.md,
"Per backend payload") at each bound and one past it: a real `llm-health serve` process
reads vLLM payloads served on loopback, rendered by the simulator's renderer in the
exposition format vLLM writes (tests/integration/test_sim_format.py checks it against real
payloads), and a healthy simulated vLLM beside them.

At the bound the backend is read as usual: its engines on /status and in the per-engine
series, label values whole. One past it the payload is refused whole: `no_metrics`, the
reason naming the limit, `llm_exporter_round_errors_total{reason="limits"}`, no per-engine
series; and the other backends go on being read.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from llm_health.core import engines
from llm_health.core.engines import Limits
from llm_health.sim.render import SimEngine, render_vllm
from tests.fixtures.exporter_status import get, settled, statuses

# The defaults as docs/limits.md states them (test_limits_doc.py holds the doc to the code):
# written out here, so that a default the code moves by one fails these tests too.
DEFAULT = Limits(max_engines=256, max_label_length=512)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # vLLM's /metrics (prometheus_client)


def families(text: str) -> list[tuple[list[str], list[str]]]:
    """A payload's families in order: each one's HELP and TYPE lines, and its samples."""
    out: list[tuple[list[str], list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            out.append(([line], []))
        elif line.startswith("#"):
            out[-1][0].append(line)
        else:
            out[-1][1].append(line)
    return out


@functools.cache
def payload(units: tuple[tuple[str, int], ...]) -> bytes:
    """A vLLM V1 payload with these (model_name, engines) units: engines `0`..`n-1` of each
    model, idle; each family's samples together, as prometheus_client writes a registry."""
    renders = [families(render_vllm([SimEngine(engine=str(i)) for i in range(n)], model, 1.7e9)) for model, n in units]
    lines: list[str] = []
    for i, (headers, _) in enumerate(renders[0]):
        lines += headers
        seen: set[str] = set()  # process_start_time_seconds is one series of the process
        for render in renders:
            assert render[i][0] == headers
            lines += [s for s in render[i][1] if s not in seen]
            seen.update(render[i][1])
    return ("\n".join(lines) + "\n").encode()


def engine_payload(label: str, value_length: int) -> bytes:
    """One engine whose `model_name` (or `engine`) label value has `value_length` characters."""
    if label == "model_name":
        return payload((("m" * value_length, 1),))
    return render_vllm([SimEngine(engine="e" * value_length)], "sim-model", 1.7e9).encode()


@dataclass
class Vllm:
    url: str
    body: bytes  # what /metrics answers now: a test may change it


async def serve_vllm(hostile, body: bytes) -> Vllm:
    """A loopback server answering as an idle vLLM with this /metrics body."""
    server = await hostile()
    served = Vllm(server.url, body)
    models = {"object": "list", "data": [{"id": "sim-model", "object": "model", "owned_by": "vllm"}]}

    async def metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(body=served.body, headers={"Content-Type": CONTENT_TYPE})

    server.on("GET", "/metrics", metrics)
    server.text("GET", "/v1/models", json.dumps(models), content_type="application/json")
    server.text("POST", "/v1/completions", '{"choices": [{"text": "x"}]}', content_type="application/json")
    return served


def config(tmp_path, backends: dict[str, str], global_extra: str = "", per_backend: dict[str, str] | None = None) -> str:
    lines = [
        "global: {interval: 1s, hung_after_seconds: 30, probe_interval: 600s, probe_timeout: 10s, metrics_timeout: 60s, "
        f"models_timeout: 10s, connect_timeout: 5s{global_extra}}}",
        "backends:",
    ]
    lines += [f"  - {{name: {name}, url: '{url}'{(per_backend or {}).get(name, '')}}}" for name, url in backends.items()]
    path = tmp_path / "llm-health.yml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


async def engine_series(exporter) -> tuple[dict[str, set[tuple[str, str]]], dict[tuple[str, str], float]]:
    """From /metrics: each backend's (model_name, engine) units with a state series, and the
    round errors by (backend, reason)."""
    units: dict[str, set[tuple[str, str]]] = {}
    errors: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(await get(exporter.url + "/metrics")):
        for s in family.samples:
            if s.name == "llm_backend_engine_state" and s.value == 1:
                units.setdefault(s.labels["backend"], set()).add((s.labels["model_name"], s.labels["engine"]))
            elif s.name == "llm_exporter_round_errors_total":
                errors[(s.labels["backend"], s.labels["reason"])] = s.value
    return units, errors


def read_whole(status: dict[str, Any], units: set[tuple[str, str]], errors: dict, want: set[tuple[str, str]]) -> None:
    """Within the limits: idle, every engine unit on /status and in /metrics, label values whole."""
    name = status["backend"]
    assert status["state"] == "idle" and "over limits" not in status["reason"], status["reason"][:300]
    assert {(e["model_name"], e["engine"]) for e in status["engines"]} == want
    assert units == want
    assert (name, "limits") not in errors


def refused(status: dict[str, Any], units: set[tuple[str, str]] | None, errors: dict, why: str) -> None:
    """Past a limit: refused whole, named, counted; no per-engine state."""
    assert status["state"] == "no_metrics" and f"/metrics over limits: {why}" in status["reason"], status["reason"][:300]
    assert status["engines"] == [] and units is None
    assert errors[(status["backend"], "limits")] >= 1


async def healthy_goes_on(exporter, name: str = "healthy") -> None:
    """The healthy backend's rounds go on, and it reads busy with its engine series."""
    before = (await statuses(exporter))[name]["rounds"]
    now = await settled(exporter, {name: "busy"}, rounds=before + 3)
    assert now[name]["engines"] and now[name]["engines"][0]["state"] == "busy"
    units, _ = await engine_series(exporter)
    assert units[name] == {("sim-model", "0")}


async def healthy(sim_server, ticker) -> str:
    server = await sim_server("healthy", scenario="saturated")
    ticker.append(server)
    return server.url


def test_the_payloads_hold_what_they_say():
    """What the tests serve is what they say: engine units and label lengths as the reader counts them."""
    for units, n in (((("model-a", 128), ("model-b", 128)), 256), ((("model-a", 128), ("model-b", 129)), 257)):
        reading = engines.read(payload(units).decode(), Limits(max_engines=10_000))
        assert len(reading.engines) == n and {m for m, _ in reading.engines} == {"model-a", "model-b"}
        assert reading.profile == "vllm_v1" and reading.start_time == 1.7e9
    for label in ("model_name", "engine"):
        for n in (511, 512, 513):
            [(model, engine)] = list(engines.read(engine_payload(label, n).decode(), Limits(max_label_length=10_000)).engines)
            assert len(model if label == "model_name" else engine) == n


async def test_max_label_length_at_and_one_past_the_bound(tmp_path, hostile, sim_server, ticker, llm_health):
    n = DEFAULT.max_label_length
    backends = {
        f"{label}-{length}": (await serve_vllm(hostile, engine_payload(label, length))).url for label in ("model_name", "engine") for length in (n, n + 1)
    }
    backends["healthy"] = await healthy(sim_server, ticker)
    exporter = llm_health("serve", "--config.file", config(tmp_path, backends)).wait_ready()
    want = {name: ("idle" if name.endswith(f"-{n}") else "no_metrics") for name in backends if name != "healthy"}
    status = await settled(exporter, {**want, "healthy": "busy"})
    units, errors = await engine_series(exporter)
    read_whole(status[f"model_name-{n}"], units.get(f"model_name-{n}", set()), errors, {("m" * n, "0")})
    read_whole(status[f"engine-{n}"], units.get(f"engine-{n}", set()), errors, {("sim-model", "e" * n)})
    why = f"a unit label value of {n + 1} characters, more than max_label_length {n}"
    for label in ("model_name", "engine"):
        refused(status[f"{label}-{n + 1}"], units.get(f"{label}-{n + 1}"), errors, why)
    await healthy_goes_on(exporter)


async def test_max_engines_at_and_one_past_the_bound(tmp_path, hostile, sim_server, ticker, llm_health):
    """Engine units are (model_name, engine) pairs: two models of 128 ranks are 256 units.
    A backend read at the bound that grows one rank past it is refused from then on."""
    n = DEFAULT.max_engines
    at = (("model-a", n // 2), ("model-b", n - n // 2))
    past = (("model-a", n // 2), ("model-b", n - n // 2 + 1))
    units_at = await serve_vllm(hostile, payload(at))
    backends = {"units-at": units_at.url, "units-past": (await serve_vllm(hostile, payload(past))).url}
    backends["healthy"] = await healthy(sim_server, ticker)
    exporter = llm_health("serve", "--config.file", config(tmp_path, backends)).wait_ready()
    status = await settled(exporter, {"units-at": "idle", "units-past": "no_metrics", "healthy": "busy"})
    units, errors = await engine_series(exporter)
    want = {(m, str(i)) for m, count in at for i in range(count)}
    assert len(want) == n
    read_whole(status["units-at"], units.get("units-at", set()), errors, want)
    why = f"{n + 1} engine units (model_name, engine), more than max_engines {n}"
    refused(status["units-past"], units.get("units-past"), errors, why)
    await healthy_goes_on(exporter)

    units_at.body = payload(past)
    status = await settled(exporter, {"units-at": "no_metrics"}, rounds=status["units-at"]["rounds"] + 1)
    units, errors = await engine_series(exporter)
    refused(status["units-at"], units.get("units-at"), errors, why)


async def test_configured_limits_are_honoured_globally_and_per_backend(tmp_path, hostile, sim_server, ticker, llm_health):
    """`global:` raises both limits by one (what the defaults refuse is read); a backend's
    own keys lower them by one (what the defaults read is refused, naming the backend's bound)."""
    n, e = DEFAULT.max_label_length, DEFAULT.max_engines
    at_engines = (("model-a", e // 2), ("model-b", e - e // 2))
    past_engines = (("model-a", e // 2), ("model-b", e - e // 2 + 1))
    backends = {
        "label-raised": (await serve_vllm(hostile, engine_payload("model_name", n + 1))).url,
        "units-raised": (await serve_vllm(hostile, payload(past_engines))).url,
        "label-lowered": (await serve_vllm(hostile, engine_payload("model_name", n))).url,
        "units-lowered": (await serve_vllm(hostile, payload(at_engines))).url,
        "healthy": await healthy(sim_server, ticker),
    }
    per_backend = {"label-lowered": f", max_label_length: {n - 1}", "units-lowered": f", max_engines: {e - 1}"}
    path = config(tmp_path, backends, f", max_label_length: {n + 1}, max_engines: {e + 1}", per_backend)
    exporter = llm_health("serve", "--config.file", path).wait_ready()
    want = {"label-raised": "idle", "units-raised": "idle", "label-lowered": "no_metrics", "units-lowered": "no_metrics", "healthy": "busy"}
    status = await settled(exporter, want)
    units, errors = await engine_series(exporter)
    read_whole(status["label-raised"], units.get("label-raised", set()), errors, {("m" * (n + 1), "0")})
    read_whole(status["units-raised"], units.get("units-raised", set()), errors, {(m, str(i)) for m, c in past_engines for i in range(c)})
    refused(status["label-lowered"], units.get("label-lowered"), errors, f"a unit label value of {n} characters, more than max_label_length {n - 1}")
    refused(status["units-lowered"], units.get("units-lowered"), errors, f"{e} engine units (model_name, engine), more than max_engines {e - 1}")
    await healthy_goes_on(exporter)
