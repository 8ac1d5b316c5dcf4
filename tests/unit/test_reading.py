"""A payload read in pieces, as the exporter reads it, gives what reading it whole gives."""

from __future__ import annotations

import random

import pytest

from llm_health.core import engines
from llm_health.core.engines import Limits, OverLimits
from llm_health.core.exposition import ParseError, parse
from llm_health.probe.pieces import pieces, read_payload
from tests.fixtures.paths import real_payloads


def cut(text: str, rng: random.Random) -> list[str]:
    """The text cut at random places (mid-line too), as a body arrives off the network."""
    out, start = [], 0
    while start < len(text):
        end = start + rng.randint(1, 3000)
        out.append(text[start:end])
        start = end
    return out


@pytest.mark.parametrize("path", real_payloads(), ids=lambda p: p.name)
async def test_pieces_read_like_the_whole(path):
    text = path.read_text()
    rng = random.Random(path.name)
    for size in (64, 1000, 16 * 1024):
        parts = cut(text, rng)
        assert "".join(piece for piece, _ in pieces(parts, size)) == text
        assert await read_payload(parts, Limits(), size) == engines.read(text)


async def test_line_numbers_of_pieces_are_the_payload_s():
    text = "a 1\n" * 500 + 'vllm:num_requests_running{x="1" 1\n'
    with pytest.raises(ParseError, match="line 501"):
        parse(text, ["vllm:num_requests_running"])
    with pytest.raises(ParseError, match="line 501"):
        await read_payload(cut(text, random.Random(1)), Limits(), 100)


async def test_sample_budget_spans_the_pieces():
    text = "\n".join(f'vllm:num_requests_running{{engine="{i}",model_name="m"}} 1' for i in range(300)) + "\n"
    with pytest.raises(OverLimits, match="more than 100"):
        await read_payload(cut(text, random.Random(2)), Limits(max_samples=100), 512)
    reading = await read_payload(cut(text, random.Random(2)), Limits(max_samples=1000, max_engines=300), 512)
    assert len(reading.engines) == 300
