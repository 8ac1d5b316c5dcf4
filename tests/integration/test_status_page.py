"""The exporter's status page (`/`) in a real browser: Debian's headless Chromium
(tests/fixtures/browser.py) on a real `llm-health serve` process, behind basic auth, on
simulated backends and a real redis-server.

Proven here, from the DOM Chromium rendered:

* the page refreshes in place: a backend that was busy when the page loaded is shown
  `hung` once the exporter has proved the hang, in the same document (no reload), after
  the page's own refresh ran, through the same basic auth as the other endpoints;
* a model name built to inject HTML is shown as text and adds no element;
* the GPU pool and the admission route read from Redis are shown with their figures.
* with JavaScript off, the page's <noscript> meta refresh reloads it.

With LLM_HEALTH_SCREENSHOT=PATH the screenshot of that page is also written to PATH: the
docs/status-page.png is made so (docs/exporter.md, "The status page").
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path
from typing import Any

import yaml

from llm_health.exporter import page
from llm_health.sim import servers as sim
from llm_health.store.leases import LeaseClient
from llm_health.store.queue import AdmissionQueue, now_ms
from tests.fixtures.browser import Chromium
from tests.fixtures.websec import bcrypt_hash, call, poll, web_config

USER, PASSWORD = "oncall", "page-test-password-5c1d"
# Served by a backend as its model_name label (no double quote or backslash: the
# simulator writes label values unescaped): it must reach the page as text.
HOSTILE = "</td><img src=x onerror=window.__injected=1><script>window.__injected=2</script>'&amp;"
HUNG = "vllm-c"  # busy when the page loads, hung later


async def fleet(sim_server: Any, ticker: list[sim.SimServer]) -> dict[str, sim.SimServer]:
    plan = {
        "vllm-a": {"scenario": "saturated", "engines": 2},
        "vllm-b": {"scenario": "batch"},
        HUNG: {"scenario": "saturated"},
        "llama-d": {"scenario": "idle", "kind": "llamacpp"},
        "vllm-e": {"scenario": "sleeping", "model": HOSTILE},
    }
    servers = {name: await sim_server(name, **kw) for name, kw in plan.items()}
    ticker.extend(servers.values())
    return servers


async def fill_redis(url: str) -> None:
    """Two of the pool's four GPUs leased (by vllm-a's and vllm-c's jobs), one caller
    waiting; on route chat one request queued 47 s ago and one resent past its deadline."""
    leases = LeaseClient.from_url(url, ttl_ms=600_000)
    queue = AdmissionQueue.from_url(url)
    try:
        assert await leases.claim("gpu0", "job-a", job_id="train-a") is not None
        assert await leases.claim("gpu2", "job-c", job_id="serve-c") is not None
        wall = now_ms()
        await leases.redis.zadd(leases.keys.waiters("a100"), {"waiter-1": wall + 600_000})
        await queue.enqueue("req-old", "chat", "team-x", deadline_ms=wall + 600_000, enqueued_ms=wall - 47_000)
        await queue.enqueue("req-late", "chat", "team-y", deadline_ms=wall - 2_000, enqueued_ms=wall - 3_000)
        await queue.enqueue("req-late", "chat", "team-y", deadline_ms=wall - 2_000)  # resent: a retry
    finally:
        await leases.aclose()
        await queue.aclose()


def exporter_config(path: Path, servers: dict[str, sim.SimServer], redis_url: str) -> str:
    backends = [{"name": n, "url": s.url} for n, s in servers.items()]  # kind vllm: llama.cpp is told by its payload
    backends.append({"name": "vllm-f", "url": sim.dead_url()})
    config = {
        "global": {"interval": "1s", "hung_after_seconds": "2s", "probe_interval": "1h", "metrics_timeout": "3s", "models_timeout": "3s"},
        "backends": backends,
        "redis": {
            "url": redis_url,
            "pools": [{"name": "a100", "gpus": ["gpu0", "gpu1", "gpu2", "gpu3"], "backends": {"gpu0": "vllm-a", "gpu2": HUNG}}],
            "routes": ["chat"],
        },
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


async def states(url: str) -> dict[str, dict[str, Any]]:
    answer = await call(url + "/status", user=(USER, PASSWORD))
    assert answer.status == 200, answer
    return {b["backend"]: b for b in answer.json()["backends"]}


def row(backend: str, what: str) -> str:
    """A JavaScript expression: `what` of the backend's row, or null without one."""
    return f"(() => {{ const r = document.querySelector('#page tr[data-backend={json.dumps(backend)}]'); return r ? {what} : null; }})()"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    return width, height


async def test_status_page_refreshes_in_place_in_chromium(chromium: Chromium, tmp_path, sim_server, ticker, llm_health, redis_url):
    servers = await fleet(sim_server, ticker)
    await fill_redis(redis_url)
    headers = "http_server_config:\n  headers: {Content-Security-Policy: \"default-src 'self'\", X-Frame-Options: DENY}\n"
    web = web_config(tmp_path / "web.yml", None, None, {USER: bcrypt_hash(PASSWORD)}, extra=headers)
    exporter = llm_health("serve", "--config.file", exporter_config(tmp_path / "exporter.yml", servers, redis_url), "--web.config.file", web)
    await asyncio.to_thread(exporter.wait_ready)
    assert (await call(exporter.url + "/")).status == 401  # the page is behind the same auth as /status
    answer = await call(exporter.url + "/", user=(USER, PASSWORD))
    assert answer.status == 200 and answer.headers["Content-Security-Policy"] == page.CSP, answer.headers  # the page's own
    assert answer.headers["X-Frame-Options"] == "DENY"  # the web config's other headers still apply
    assert (await call(exporter.url + "/status", user=(USER, PASSWORD))).headers["Content-Security-Policy"] == "default-src 'self'"

    async def settled() -> dict[str, dict[str, Any]] | None:
        now = await states(exporter.url)
        want = {"vllm-a": "busy", "vllm-b": "busy", HUNG: "busy", "llama-d": "idle", "vllm-e": "sleeping", "vllm-f": "down"}
        return now if all(now[b]["state"] == s and now[b]["rounds"] >= 2 for b, s in want.items()) else None

    await poll(settled, "every backend in its state")

    # The credentials a user types at the browser's prompt: Chromium keeps them for the
    # origin and sends them with the page's own refreshes.
    await chromium.navigate(exporter.url.replace("http://", f"http://{USER}:{PASSWORD}@") + "/")
    assert await chromium.evaluate("document.title") == "llm-health exporter"
    assert await chromium.evaluate(row(HUNG, "r.querySelector('.st').textContent")) == "busy"
    await chromium.evaluate("window.__sameDocument = 'yes'")

    sim.hang(servers[HUNG])  # the engine stops dead with 12 requests in flight
    shown = row(HUNG, "r.dataset.state + ':' + r.querySelector('.st').textContent")
    hung = f"{shown} === 'hung:hung'"
    refreshed = "Number(document.getElementById('page').dataset.refreshes) >= 1"
    text = "document.getElementById('page').dataset.refreshes + ' refreshes: ' + document.body.innerText"
    await chromium.wait_for(f"{hung} && {refreshed}", f"{HUNG} shown hung after a refresh in place", shown=text)
    assert (await states(exporter.url))[HUNG]["state"] == "hung"

    # in place: the same document, its refreshes authenticated, no error shown
    assert await chromium.evaluate("window.__sameDocument") == "yes"
    assert await chromium.evaluate("document.getElementById('refresh-error').textContent") == ""
    reason = await chromium.evaluate(row(HUNG, "r.querySelector('td.reason').textContent"))
    assert "no engine progress" in reason, reason
    assert await chromium.evaluate(row("vllm-a", "r.querySelectorAll('ul.eng li').length")) == 2  # both engine ranks

    # the hostile model name is text: no element, no script ran
    assert await chromium.evaluate(row("vllm-e", "r.querySelector('ul.eng li').textContent.startsWith(" + json.dumps(HOSTILE) + ")"))
    assert await chromium.evaluate("document.querySelectorAll('#page img, #page script').length") == 0
    assert await chromium.evaluate("document.querySelectorAll('script').length") == 1  # the page's own
    assert await chromium.evaluate("window.__injected === undefined")

    # pools and routes from Redis
    pool = await chromium.evaluate("[...document.querySelectorAll('#pools tr[data-pool=\"a100\"] td')].map(td => td.textContent)")
    assert pool[:5] == ["a100", "4", "2", "2", "1"], pool  # GPUs, leased, free, waiters
    route = await chromium.evaluate("[...document.querySelectorAll('#routes tr[data-route=\"chat\"] td')].map(td => td.textContent)")
    assert route[0] == "chat" and route[1] == "2" and route[3].startswith("-") and route[4] == "1" and route[5] == "1", route
    assert float(route[2].removesuffix(" s")) >= 47.0, route  # the oldest request's age, in seconds past 10 s

    shot = await chromium.screenshot()
    width, height = png_size(shot)
    assert width == chromium.width and height > 400, (width, height)
    (tmp_path / "status-page.png").write_bytes(shot)
    if target := os.environ.get("LLM_HEALTH_SCREENSHOT"):
        Path(target).write_bytes(shot)

    # JavaScript off: the <noscript> meta refresh reloads the page (a new document)
    await chromium.call("Emulation.setScriptExecutionDisabled", value=True)
    await chromium.navigate(exporter.url.replace("http://", f"http://{USER}:{PASSWORD}@") + "/")
    first = await chromium.evaluate("performance.timeOrigin")
    assert await chromium.evaluate("document.getElementById('page').dataset.refreshes") == "0"
    await chromium.wait_for(f"performance.timeOrigin > {first} && document.readyState === 'complete'", "the page reloaded by its meta refresh")
    assert await chromium.evaluate(row(HUNG, "r.dataset.state")) == "hung"
