"""Turning a backend's `/metrics` body into a `Reading` without holding the event loop:
the text is parsed in pieces cut at line ends, and the loop gets a turn between pieces,
so a huge or hostile payload delays nothing but its own round.

The work per payload is bounded too: the body by `max_metrics_bytes` (the client), the
samples parsed by `Limits.max_samples`, the engines kept by `Limits.max_engines`.
"""

from __future__ import annotations

import asyncio

from ..core import engines
from ..core.engines import Limits, Reading
from ..core.exposition import Budget, Samples, TooManySamples, parse, split_lines

# Characters parsed between two turns of the event loop: about a millisecond of work on a
# regular payload, a few on a payload made of lines the parser reads the slow way.
PIECE = 16 * 1024


async def read_payload(text: str, limits: Limits, piece: int = PIECE) -> Reading:
    """The payload's Reading; ParseError, UnknownEngine or OverLimits as `engines.read`."""
    if len(text) <= piece:
        return engines.read(text, limits)
    samples: Samples = {}
    budget = Budget(limits.max_samples)
    for chunk, first_line in split_lines(text, piece):
        try:
            parse(chunk, engines.PAYLOAD_NAMES, first_line=first_line, budget=budget, into=samples)
        except TooManySamples as exc:
            raise engines.OverLimits(f"{exc}, more than max_samples") from None
        await asyncio.sleep(0)
    return engines.reduce(samples, limits)
