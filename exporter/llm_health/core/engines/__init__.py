"""The engines' room: one module per inference engine (vllm, sglang, tgi, llamacpp,
triton), each filling a `Profile` (profile) with everything the rest of the product asks
of that engine; the registry listing them; and the reading of a payload by them
(reading). Nothing outside this package compares an engine's name (tests/unit/
test_engine_names.py holds it). Pure: no I/O.

Callers import from here (`from llm_health.core.engines import Reading, BY_NAME`).
"""

from __future__ import annotations

from .llamacpp import LLAMACPP
from .profile import START_TIME, Profile
from .reading import (
    EngineReading,
    Limits,
    OverLimits,
    Reading,
    UnknownEngine,
    detect,
    payload_names,
    read,
    reduce,
)
from .registry import BY_NAME, BY_START_HEADER, NEVER, PROFILES, ROUTES, register, unregister
from .sglang import SGLANG
from .tgi import TGI
from .triton import TRITON
from .vllm import VLLM_V0, VLLM_V1

__all__ = [
    "BY_NAME",
    "BY_START_HEADER",
    "LLAMACPP",
    "NEVER",
    "PROFILES",
    "ROUTES",
    "SGLANG",
    "START_TIME",
    "TGI",
    "TRITON",
    "VLLM_V0",
    "VLLM_V1",
    "EngineReading",
    "Limits",
    "OverLimits",
    "Profile",
    "Reading",
    "UnknownEngine",
    "detect",
    "payload_names",
    "read",
    "reduce",
    "register",
    "unregister",
]
