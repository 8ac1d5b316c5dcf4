"""The simulated engines: one module per engine (its `SimFlavor`), listed here by the
kind `SimServer(kind=...)` takes. Adding one: a module beside these and a line below;
at run time (a test engine), `register`."""

from __future__ import annotations

from .base import OpenAIFlavor, Served, SimFlavor, StepEngine
from .llamacpp import LlamaCppSim
from .sglang import SGLangSim
from .tgi import TgiSim
from .triton import TritonSim
from .vllm import VllmSim

FLAVORS: dict[str, type[SimFlavor]] = {f.kind: f for f in (VllmSim, LlamaCppSim, SGLangSim, TgiSim, TritonSim)}


def flavor(kind: str) -> SimFlavor:
    """The simulation of the engine `kind`; ValueError naming the kinds there are."""
    try:
        return FLAVORS[kind]()
    except KeyError:
        raise ValueError(f"kind {kind!r}: one of {', '.join(FLAVORS)}") from None


def register(simulation: type[SimFlavor]) -> None:
    """Add a simulation at run time; ValueError where its kind is taken."""
    if simulation.kind in FLAVORS:
        raise ValueError(f"simulated kind {simulation.kind!r} is registered already")
    FLAVORS[simulation.kind] = simulation


def unregister(kind: str) -> type[SimFlavor]:
    """Remove a simulation (a test's, at its end); KeyError where none has the kind."""
    return FLAVORS.pop(kind)


__all__ = ["FLAVORS", "OpenAIFlavor", "Served", "SimFlavor", "StepEngine", "flavor", "register", "unregister"]
