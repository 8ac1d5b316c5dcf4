"""The gate forwards only the inference API: a real gate, a real redis-server, an upstream
that records every request it gets. Requests are written byte for byte on a socket, so
paths a client library would normalise (``..``, ``%73``, ``//``) reach the gate as sent."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from llm_health.config.fields import ConfigError
from llm_health.config.gate import parse_gate_config
from tests.integration.test_gate import serve, stack  # noqa: F401  (the fixture)


class Recorder:
    def __init__(self):
        self.seen: list[tuple[str, str]] = []

    async def any(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.raw_path))
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture
async def recorder():
    rec = Recorder()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", rec.any)
    runner, url = await serve(app)
    yield rec, url
    await runner.cleanup()


async def raw(url: str, method: str, target: str, body: bytes = b"{}") -> tuple[int, bytes, str]:
    """One HTTP/1.1 request written as is; (status, body, the Allow header)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode("latin-1") + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    allow = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("allow:")), "")
    return int(lines[0].split()[1]), rest, allow


NEVER_REACH = [
    ("POST", "/sleep?level=1"),
    ("POST", "/wake_up"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/metrics"),
    ("POST", "/collective_rpc"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/slots/0?action=erase"),
    ("POST", "/v1/completions/../../sleep"),
    ("POST", "/%73leep"),
    ("POST", "//sleep"),
    ("POST", "/v1/chat/completions%2F..%2F..%2Fsleep"),
    ("POST", "/v1/chat/completions/"),
    ("POST", "/anything/else"),
]


async def test_only_the_inference_api_reaches_the_engine(stack, recorder):  # noqa: F811
    rec, upstream = recorder
    url, _, gate = await stack(routes={"chat": {"upstream": upstream, "default_deadline_ms": 30000}})
    for method, target in NEVER_REACH:
        status, body, _ = await raw(url, method, target)
        assert status == 404 and b"not_forwarded" in body, (target, status, body)
    status, body, allow = await raw(url, "GET", "/v1/chat/completions")
    assert (status, allow) == (405, "POST") and b"only POST is forwarded" in body
    assert rec.seen == []
    # What is forwarded, forwarded as sent (the query too).
    status, _, _ = await raw(url, "POST", "/v1/chat/completions?x=1", b'{"model": "m", "messages": []}')
    assert status == 200
    assert rec.seen == [("POST", "/v1/chat/completions?x=1")]
    text = gate.registry.get_sample_value
    assert text("llm_gate_not_forwarded_total", {"code": "404"}) == len(NEVER_REACH)
    assert text("llm_gate_not_forwarded_total", {"code": "405"}) == 1


async def test_a_route_allow_list_replaces_the_default(stack, recorder):  # noqa: F811
    rec, upstream = recorder
    url, _, _ = await stack(routes={"chat": {"upstream": upstream, "default_deadline_ms": 30000, "allow": ["POST /v1/chat/completions"]}})
    assert (await raw(url, "POST", "/v1/completions"))[0] == 404
    assert (await raw(url, "POST", "/v1/chat/completions", b'{"model": "m"}'))[0] == 200
    assert rec.seen == [("POST", "/v1/chat/completions")]


async def test_a_body_over_max_body_bytes_is_a_413_that_reaches_nothing(stack, recorder):  # noqa: F811
    rec, upstream = recorder
    url, _, _ = await stack(routes={"chat": {"upstream": upstream, "default_deadline_ms": 30000}}, max_body_bytes=4096)
    status, body, _ = await raw(url, "POST", "/v1/chat/completions", b'{"model": "m", "prompt": "' + b"x" * 5000 + b'"}')
    assert status == 413 and b"Maximum request body size 4096 exceeded" in body
    assert (await raw(url, "POST", "/v1/chat/completions", b'{"model": "m"}'))[0] == 200
    assert rec.seen == [("POST", "/v1/chat/completions")]


def test_an_allow_entry_for_an_admin_endpoint_is_a_config_error():
    with pytest.raises(ConfigError, match=r"gate\.routes\.chat\.allow.*'POST /sleep': /sleep is an engine admin or dev endpoint, never forwarded"):
        parse_gate_config({"gate": {"routes": {"chat": {"upstream": "http://127.0.0.1:1", "allow": ["POST /sleep"]}}}}, "g.yml")
