"""The connection the exporter keeps for a backend's next `/metrics` read, against a REAL
vLLM at its defaults: uvicorn keeps an idle connection for 5 s
(VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so two reads a second apart share one; vLLM then closes
it, the exporter's side sees the close and drops it, and the next read opens another one
without an error; after two reads that found their kept connection closed, the reads say
`Connection: close` (what every read said before connections were kept).
"""

from __future__ import annotations

import asyncio

from llm_health.probe import fast_http
from tests.harness import vllm as harness

TIMEOUT = 30.0


async def read(target: fast_http.Target) -> fast_http.Response:
    resp = await fast_http.get(target, connect_timeout=TIMEOUT, timeout=TIMEOUT, max_bytes=16 << 20)
    assert resp.status == 200 and "vllm:num_requests_running" in "".join(resp.parts)
    return resp


async def dropped_by_the_server(target: fast_http.Target) -> None:
    async with asyncio.timeout(TIMEOUT):  # 5 s by vLLM's default; the margin is for a loaded machine
        while target._idle is not None:
            await asyncio.sleep(0.1)


async def test_a_real_vllm_keeps_the_connection_for_5_s_and_the_reads_follow(idle_vllm_server: harness.VLLMServer):
    target = fast_http.Target(idle_vllm_server.url, "/metrics", {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip"}, keepalive=True)
    await read(target)
    first = target._idle
    assert first is not None, "vLLM's answer could not be kept (not HTTP/1.1 framed by length or chunks?)"
    await asyncio.sleep(1.0)
    await read(target)
    assert target._idle is first  # the same connection carried the second read, and is kept again
    await dropped_by_the_server(target)
    assert not first.open
    for _ in range(2):  # two reads that find their kept connection gone
        await read(target)
        if target._idle is not None:
            await dropped_by_the_server(target)
    assert target._idle is None and target._plain == fast_http.PLAIN_READS - 1  # this read said Connection: close
    await read(target)  # a plain read: vLLM closes the connection after answering
    assert target._idle is None and target._plain == fast_http.PLAIN_READS - 2
    target.close()
