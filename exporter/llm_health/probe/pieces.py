"""Turning a backend's `/metrics` body into a `Reading` without holding the event loop:
the text is parsed in pieces cut at line ends, and the loop gets a turn between pieces,
so a huge or hostile payload delays nothing but its own round.

The work per payload is bounded too: the body by `max_metrics_bytes` (the client), the
samples parsed by `Limits.max_samples`, the engines kept by `Limits.max_engines`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace

from ..core import engines
from ..core.engines import Limits, Reading
from ..core.exposition import Budget, ParseError, Samples, TooManySamples, parse

# Characters parsed between two turns of the event loop: about a millisecond of work on a
# regular payload, a few on a payload made of lines the parser reads the slow way.
PIECE = 16 * 1024


def _cut(parts: Sequence[str], size: int) -> Iterator[str]:
    """The text of `parts` (a body as it arrived) in pieces of about `size` characters
    cut at line ends; never one big copy."""
    carry = ""
    for part in parts:
        for start in range(0, len(part), size):
            text = carry + part[start : start + size]
            cut = text.rfind("\n") + 1
            if cut:
                yield text[:cut]
                carry = text[cut:]
            else:
                carry = text  # no line end yet: a long line grows until it has one
    if carry:
        yield carry


def pieces(parts: Sequence[str], size: int = PIECE) -> Iterator[tuple[str, int]]:
    """`_cut`'s pieces, each with the number of its first line."""
    line = 1
    for piece in _cut(parts, size):
        yield piece, line
        line += piece.count("\n")


async def read_payload(parts: Sequence[str], limits: Limits, size: int = PIECE) -> Reading:
    """The payload's Reading; ParseError, UnknownEngine or OverLimits as `engines.read`.
    Lines are counted only for a ParseError's message (the piece is parsed again, with
    its first line's number)."""
    samples: Samples = {}
    budget = Budget(limits.max_samples)
    names = engines.payload_names()
    for n, piece in enumerate(_cut(parts, size)):
        if n:
            await asyncio.sleep(0)
        try:
            parse(piece, names, budget=budget, into=samples)
        except TooManySamples as exc:
            raise engines.OverLimits(f"{exc}, more than max_samples") from None
        except ParseError:
            first_line = next(line for k, (_, line) in enumerate(pieces(parts, size)) if k == n)
            parse(piece, names, first_line=first_line)
            raise
    return engines.reduce(samples, limits)


async def read_fetched(parts: Sequence[str], start_header: float | None, limits: Limits) -> Reading:
    """`read_payload`, with the start time of the response header (the engine profile's
    `start_header`) where the payload has none."""
    reading = await read_payload(parts, limits)
    if reading.start_time is None and start_header is not None and math.isfinite(start_header) and start_header > 0:
        return replace(reading, start_time=start_header)
    return reading
