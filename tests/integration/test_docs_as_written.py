"""Every door starts from its docs: the commands, files and bodies of README.md,
docs/admission.md and docs/restarts.md marked `<!-- docs-as-written: NAME -->` are read from
the docs' own code blocks and run as written on real processes, with only their addresses,
ports and file paths moved to this test's (a doc that drifts fails here;
tests/unit/test_docs.py fails on a README command no test runs):

- the README's `llm-health.yml` and `serve`: its five-line configuration passes `config
  check` and `serve` on it gives each simulated backend its verdict; `check`: an idle
  server's verdict, exit 0, in JSON; `gate`: the gate's command with docs/admission.md's
  configuration; `restarter`: the restarter's command, accepting docs/restarts.md's
  notification with its token;

- `gate.yml` and `gate`: the gate's documented configuration and command, a request
  admitted and forwarded;
- `decide`: `llm-health decide` with its syslog address, behind the shipped nginx
  (deploy/nginx, the syslog address of llm-health-admitted.conf the one the doc gives):
  a request admitted and its end recorded through the syslog report;
- `nginx-lua`: the Lua door's install line (the packages the test machine's set-up installs),
  `llm-health nginx-lua` as written, and nginx on the shipped deploy/nginx/nginx-lua.conf
  with the directory the command wrote: a request admitted and its end recorded;
- `litellm`: the LiteLLM proxy with the shipped deploy/litellm files, started with the
  documented master key, answering and enforcing it;
- `notification.json` and `send`: the Alertmanager notification body, sent with the
  documented command to a real restarter, accepted;
- one default port per component: serve, gate, restarter and decide default to distinct
  ports, and the shipped configs point at the right one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llm_health.cli import parser
from llm_health.core.evidence import parse_evidence
from llm_health.core.webhook import parse_webhook
from llm_health.store.keys import DEFAULT_QUEUE_PREFIX
from tests.fixtures.litellm import VENV, installed
from tests.fixtures.nginx import Nginx, NginxLua
from tests.fixtures.paths import ROOT
from tests.fixtures.websec import RESTARTER_ENV, TOKEN, restarter_config
from tests.harness.processes import free_port
from tests.integration.test_gate import recorded, serve

README = ROOT / "README.md"
ADMISSION = ROOT / "docs" / "admission.md"
RESTARTS = ROOT / "docs" / "restarts.md"


def block(doc: Path, name: str) -> str:
    """The code block right after `<!-- docs-as-written: name -->` in ``doc``."""
    found = re.search(r"<!-- docs-as-written: " + re.escape(name) + r" -->\n```[a-z]*\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
    assert found, f"{doc.name}: no code block marked docs-as-written: {name}"
    return found.group(1)


def moved(text: str, moves: dict[str, str]) -> str:
    for old, new in moves.items():
        assert old in text, f"the documented text no longer has {old!r}:\n{text}"
        text = text.replace(old, new)
    return text


def default_address(command: str) -> tuple[str, int]:
    args, _ = parser().parse_known_args([command, "--config.file", "x.yml"])
    return args.web_listen_address


def test_each_component_has_its_own_default_port_and_the_shipped_files_point_at_it():
    ports = {c: default_address(c)[1] for c in ("serve", "gate", "restarter", "decide")}
    assert len(set(ports.values())) == len(ports), ports
    assert ports == {"serve": 9118, "gate": 9119, "restarter": 9120, "decide": 9122}  # as README.md and docs/admission.md list them
    assert {default_address(c)[0] for c in ports} == {"127.0.0.1"}  # "all on 127.0.0.1"
    decide, restarter = ports["decide"], ports["restarter"]
    assert f"server 127.0.0.1:{decide};" in (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    envoy = (ROOT / "deploy" / "envoy" / "envoy.yaml").read_text()
    assert f"port_value: {decide}" in envoy and f"127.0.0.1:{decide}" in envoy
    assert f"--web.listen-address 127.0.0.1:{decide}" in block(ADMISSION, "decide")
    assert f"http://127.0.0.1:{restarter}/alerts" in block(RESTARTS, "send")
    for example in (ROOT / "rules" / "alertmanager.example.yml", ROOT / "compose" / "alertmanager.yml"):
        assert f"http://restarter:{restarter}/alerts" in example.read_text(), example


async def test_the_gate_as_documented_with_the_documented_configuration(own_redis_server, tmp_path):
    await gate_as_documented(block(ADMISSION, "gate"), own_redis_server.url, tmp_path)


async def test_the_readmes_gate_command_with_the_documented_configuration(own_redis_server, tmp_path):
    await gate_as_documented(block(README, "gate"), own_redis_server.url, tmp_path)


async def gate_as_documented(command: str, redis_url: str, tmp_path: Path) -> None:
    """`command` (the gate's, as a doc gives it) on docs/admission.md's gate.yml: a request
    admitted and forwarded."""
    hits: list[str] = []

    async def engine(request: web.Request) -> web.Response:
        hits.append((await request.json())["model"])
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_post("/v1/completions", engine)
    runner, eurl = await serve(app)
    token = tmp_path / "gate-admin.token"
    token.write_text("admin-secret\n")
    moves = {"redis://127.0.0.1:6379/0": redis_url, "http://10.0.0.5:8000": eurl, "http://10.0.0.6:8000": eurl}
    (tmp_path / "gate.yml").write_text(moved(block(ADMISSION, "gate.yml"), {**moves, "/etc/llm-health/gate-admin.token": str(token)}))
    port = free_port()
    argv = moved(command.strip(), {"127.0.0.1:9119": f"127.0.0.1:{port}"}).split()
    assert argv[0] == "llm-health"
    proc = subprocess.Popen([sys.executable, "-m", "llm_health", *argv[1:]], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await until_answers(f"http://127.0.0.1:{port}/-/healthy")
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "llama-3-8b", "prompt": "hi"}) as r:
            assert r.status == 200 and r.headers["X-LLM-Health-Decision"].startswith("admit"), await r.text()
        assert hits == ["llama-3-8b"]
    finally:
        proc.terminate()
        proc.wait(10)
        await runner.cleanup()


async def engine_and_gate_file(hits: list[str], redis_url: str, tmp_path: Path) -> tuple[web.AppRunner, str, Path]:
    """An engine on loopback answering every request (its X-Request-Id appended to
    ``hits``) and a gate file routing `chat` to it: (its runner, its URL, the file)."""

    async def engine(request: web.Request) -> web.Response:
        hits.append(request.headers.get("X-Request-Id", ""))
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine)
    runner, eurl = await serve(app)
    gate = tmp_path / "gate.yml"
    gate.write_text(f"gate:\n  redis: {redis_url}\n  routes:\n    chat: {{upstream: '{eurl}', default_deadline_ms: 30000}}\n")
    return runner, eurl, gate


async def test_decide_as_documented_behind_the_shipped_nginx(own_redis_server, tmp_path):
    command = block(ADMISSION, "decide").strip()
    syslog = re.search(r"--syslog.listen-address (\S+)", command)
    assert syslog, command
    admitted = (ROOT / "deploy" / "nginx" / "llm-health-admitted.conf").read_text()
    assert f"syslog:server={syslog.group(1)}," in admitted, "the doc's syslog address is not the one nginx sends to"
    engine_hits: list[str] = []
    runner, eurl, gate = await engine_and_gate_file(engine_hits, own_redis_server.url, tmp_path)
    web_port, syslog_port = free_port(), free_port()
    argv = moved(command, {"gate.yml": str(gate), "127.0.0.1:9122": f"127.0.0.1:{web_port}", syslog.group(1): f"127.0.0.1:{syslog_port}"}).split()
    assert argv[0] == "llm-health"
    proc = subprocess.Popen([sys.executable, "-m", "llm_health", *argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await until_answers(f"http://127.0.0.1:{web_port}/-/healthy")
        with Nginx(tmp_path, decide_port=web_port, engine_port=int(eurl.rsplit(":", 1)[1]), syslog_port=syslog_port) as nginx:
            async with aiohttp.ClientSession() as s, s.post(nginx.url + "/v1/completions", json={"model": "m"}, headers={"X-Request-Id": "doc-1"}) as r:
                assert r.status == 200, await r.text()
            rec = await recorded(own_redis_server.url, DEFAULT_QUEUE_PREFIX, "doc-1", timeout=20)
            assert rec is not None and rec.state == "done" and rec.http_status == 200, rec  # the syslog report reached decide
        assert engine_hits == ["doc-1"]
    finally:
        proc.terminate()
        proc.wait(10)
        await runner.cleanup()


async def test_the_nginx_lua_door_as_documented(own_redis_server, tmp_path):
    install, generate, run = block(ADMISSION, "nginx-lua").strip().splitlines()
    packages = install.split()[2:]
    assert install.startswith("apt-get install ") and all(p in (ROOT / "scripts" / "install-test-deps.sh").read_text() for p in packages), install
    conf = (ROOT / "deploy" / "nginx" / "nginx-lua.conf").read_text()
    out = re.search(r"--out (\S+)", generate)
    assert out and f'lua_package_path "{out.group(1)}/?.lua;' in conf, "the doc's --out is not the directory the shipped nginx file reads"
    assert run == "nginx -c /etc/nginx/nginx-lua.conf"
    engine_hits: list[str] = []
    runner, eurl, gate = await engine_and_gate_file(engine_hits, own_redis_server.url, tmp_path)
    lua_dir = tmp_path / "lua"
    argv = moved(generate, {"/etc/llm-health/gate.yml": str(gate), out.group(1): str(lua_dir)}).split()
    assert argv[0] == "llm-health"
    done = subprocess.run([sys.executable, "-m", "llm_health", *argv[1:]], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    try:
        (tmp_path / "nginx").mkdir()
        with NginxLua(tmp_path / "nginx", engine_port=int(eurl.rsplit(":", 1)[1]), lua_dir=lua_dir) as nginx:
            async with aiohttp.ClientSession() as s, s.post(nginx.url + "/v1/completions", json={"model": "m"}, headers={"X-Request-Id": "doc-lua"}) as r:
                assert r.status == 200 and r.headers["X-LLM-Health-Decision"] == "admit_once", await r.text()
            rec = await recorded(own_redis_server.url, DEFAULT_QUEUE_PREFIX, "doc-lua", timeout=20)
            assert rec is not None and (rec.state, rec.http_status, rec.token_units) == ("done", 200, 2), rec
        assert engine_hits == ["doc-lua"]
    finally:
        await runner.cleanup()


async def until_answers(url: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with aiohttp.ClientSession() as s, s.get(url, headers=headers or {}) as r:
                return r.status
        except aiohttp.ClientError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@pytest.mark.skipif(not installed(), reason=f"{VENV}: run .ci/install-litellm.sh")
async def test_litellm_as_documented_starts_with_its_master_key(tmp_path):
    for name in ("config.yaml", "llm_health_callback.py"):
        shutil.copy(ROOT / "deploy" / "litellm" / name, tmp_path / name)
    (tmp_path / "gate.yml").write_text(
        "gate:\n  redis: redis://127.0.0.1:1\n  routes:\n    chat: {upstream: 'http://127.0.0.1:1', models: [llama], default_deadline_ms: 30000}\n"
    )
    port = free_port()
    script = moved(block(ADMISSION, "litellm"), {"--port 4000": f"--port {port}"})
    env = {
        "PATH": f"{VENV / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT / "exporter"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # this machine is offline: no model cost map fetched
    }
    log = (tmp_path / "litellm.log").open("wb")
    proc = subprocess.Popen(["bash", "-ec", script], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # up: LiteLLM's own liveliness probe answers 200
            assert proc.poll() is None, (tmp_path / "litellm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "litellm.log").read_text()[-3000:]
            with contextlib.suppress(aiohttp.ClientError):
                if await until_answers(f"http://127.0.0.1:{port}/health/liveliness", timeout=1) == 200:
                    break
            await asyncio.sleep(0.25)
        wrong = {"Authorization": "Bearer sk-not-the-master-key"}
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/v1/models", headers=wrong) as r:
            # Refused: the master key is in force (LiteLLM 1.106 answers a key that is not it,
            # with no key database, 400 `no_db_connection`; no key at all, a bare 500).
            assert 400 <= r.status < 500, await r.text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


async def test_the_documented_notification_is_accepted_by_a_real_restarter(tmp_path, llm_health):
    body = block(RESTARTS, "notification.json")
    hook = parse_webhook(body)
    (alert,) = hook.alerts
    assert alert.alertname == "LLMBackendHung" and parse_evidence(alert.annotations["evidence"])
    backend = alert.labels["backend"]
    proc = llm_health("restarter", "--config.file", restarter_config(tmp_path / "restarter.yml", [backend]), env=RESTARTER_ENV).wait_ready()
    (tmp_path / "notification.json").write_text(body)
    (tmp_path / "restarter-token").write_text(TOKEN + "\n")
    address = proc.url.split("://", 1)[1]
    script = moved(block(RESTARTS, "send"), {"/etc/llm-health/restarter-token": str(tmp_path / "restarter-token"), "127.0.0.1:9120": address})
    done = subprocess.run(["bash", "-ec", script], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["alerts"][0]["decision"] == "accepted", answer


def run_as_written(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`llm-health ...` as a doc gives it, by this Python (the package under test)."""
    assert argv[0] == "llm-health", argv
    return subprocess.run([sys.executable, "-m", "llm_health", *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


async def test_the_readmes_configuration_passes_config_check_and_serve_gives_each_verdict(tmp_path, sim_server, ticker):
    """The README's five-line `llm-health.yml`, its addresses moved to simulated servers:
    `config check` as written passes it, and `serve` as written gives gpu0 (twelve running)
    `busy` with no request sent to it, gpu1 `idle`, the proxy lb `up`."""
    busy = await sim_server("gpu0", scenario="saturated")
    ticker.append(busy)
    idle = await sim_server("gpu1", scenario="idle")
    proxied = await sim_server("lb", scenario="idle")
    moves = {"http://10.0.0.5:8000": busy.url, "http://10.0.0.6:8000": idle.url, "http://10.0.0.9:8000": proxied.url}
    (tmp_path / "llm-health.yml").write_text(moved(block(README, "llm-health.yml"), moves))
    check, serve_ = block(README, "serve").strip().splitlines()
    env = {**os.environ, "VLLM_API_KEY": "the-readmes-api-key-env"}  # gpu1's api_key_env names it
    done = run_as_written(shlex.split(check, comments=True), tmp_path, env)
    assert done.returncode == 0 and "SUCCESS: llm-health.yml: 3 backends" in done.stdout, done.stdout + done.stderr
    port = free_port()
    argv = shlex.split(moved(serve_, {"0.0.0.0:9118": f"127.0.0.1:{port}"}), comments=True)
    assert argv[0] == "llm-health"
    proc = subprocess.Popen([sys.executable, "-m", "llm_health", *argv[1:]], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await until_answers(f"http://127.0.0.1:{port}/-/healthy")
        want, states = {"gpu0": "busy", "gpu1": "idle", "lb": "up"}, {}
        deadline = time.monotonic() + 60  # the first rounds spread over one 10 s interval; busy takes two reads
        while states != want and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/status") as r:
                states = {b["backend"]: b["state"] for b in (await r.json())["backends"]}
        assert states == want
        assert busy.received == []  # nothing sent to the busy server
    finally:
        proc.terminate()
        proc.wait(10)


async def test_the_readmes_check_as_written(tmp_path, sim_server):
    """The README's `llm-health check`, its address moved to an idle simulated server: one
    1-token probe, `idle`, exit 0, one JSON object."""
    server = await sim_server("gpu0", scenario="idle")
    (command,) = block(README, "check").strip().splitlines()
    done = await asyncio.to_thread(run_as_written, shlex.split(moved(command, {"http://10.0.0.5:8000": server.url}), comments=True), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = json.loads(done.stdout)
    assert (verdict["state"], verdict["probes_sent"]) == ("idle", 1), verdict


async def test_the_readmes_restarter_as_written_accepts_the_documented_notification(tmp_path):
    """The README's `llm-health restarter`, with a restarter.yml naming docs/restarts.md's
    backend, its token file and its port moved: docs/restarts.md's notification, sent with
    that token, is accepted; without it, refused."""
    body = block(RESTARTS, "notification.json")
    (alert,) = parse_webhook(body).alerts
    restarter_config(tmp_path / "restarter.yml", [alert.labels["backend"]])
    (tmp_path / "restarter-token").write_text(TOKEN + "\n")
    port = free_port()
    (command,) = block(README, "restarter").strip().splitlines()
    argv = shlex.split(moved(command, {"127.0.0.1:9120": f"127.0.0.1:{port}"}), comments=True)
    assert argv[0] == "llm-health"
    env = {k: v for k, v in os.environ.items() if k not in RESTARTER_ENV}  # the token comes from the file alone
    proc = subprocess.Popen([sys.executable, "-m", "llm_health", *argv[1:]], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await until_answers(f"http://127.0.0.1:{port}/-/healthy")
        url, data = f"http://127.0.0.1:{port}/alerts", body.encode()
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 401, await r.text()
            async with s.post(url, data=data, headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 202, await r.text()
                answer = await r.json()
        assert answer["alerts"][0]["decision"] == "accepted", answer
    finally:
        proc.terminate()
        proc.wait(10)
