"""The gate keeps a streamed answer's last 16 KiB (where `usage` is) without copying the
answer per chunk: what it keeps is exactly the stream's tail, whatever the chunk sizes."""

from __future__ import annotations

import json
import random

from llm_health.gate.app import Tail


def test_the_tail_is_the_streams_last_bytes_whatever_the_chunks():
    rng = random.Random(7)
    for size in (1, 10, 16384):
        tail, whole = Tail(size), b""
        for _ in range(400):
            chunk = rng.randbytes(rng.choice((0, 1, 3, size - 1 if size > 1 else 1, size, size + 5, 5000)))
            tail.add(chunk)
            whole += chunk
            assert b"".join(tail.chunks)[-size:] == whole[-size:]
            assert sum(map(len, tail.chunks)) == tail.length
            # no more chunks kept than the tail needs: without the first, it would be short
            assert tail.length - len(tail.chunks[0]) < size


def test_the_usage_of_the_last_event_is_read_from_the_tail():
    tail = Tail()
    for i in range(2000):  # about 100 KB of events, then the usage
        tail.add(b'data: {"choices": [{"text": "token %d"}]}\n\n' % i)
    tail.add(b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2000, "total_tokens": 2005}}).encode() + b"\n\n")
    tail.add(b"data: [DONE]\n\n")
    assert tail.units() == 2005
    assert Tail().units() == 0
