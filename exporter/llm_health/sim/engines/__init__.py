"""The simulated engines: one module per engine (its `SimFlavor`), listed here by the
kind `SimServer(kind=...)` takes. Adding one: a module beside these and a line below."""

from __future__ import annotations

from .base import Served, SimFlavor
from .llamacpp import LlamaCppSim
from .vllm import VllmSim

FLAVORS: dict[str, type[SimFlavor]] = {f.kind: f for f in (VllmSim, LlamaCppSim)}


def flavor(kind: str) -> SimFlavor:
    """The simulation of the engine `kind`; ValueError naming the kinds there are."""
    try:
        return FLAVORS[kind]()
    except KeyError:
        raise ValueError(f"kind {kind!r}: one of {', '.join(FLAVORS)}") from None


__all__ = ["FLAVORS", "Served", "SimFlavor", "flavor"]
