"""The registered engines, in the order a payload is matched against them.

Adding an engine: a module beside this one with its `Profile`, and one line here
(docs/architecture.md, "Adding an engine", lists the other places). Order matters only
where a payload could carry two markers: V1 before V0 (a V1 engine of some versions still
lists the deprecated gauge).
"""

from __future__ import annotations

from .llamacpp import LLAMACPP
from .profile import Profile
from .sglang import SGLANG
from .tgi import TGI
from .triton import TRITON
from .vllm import VLLM_V0, VLLM_V1

PROFILES: tuple[Profile, ...] = (VLLM_V1, VLLM_V0, SGLANG, TGI, LLAMACPP, TRITON)
BY_NAME: dict[str, Profile] = {p.name: p for p in PROFILES}
# Response headers of `/metrics` that carry a process start, and the engine sending each.
BY_START_HEADER: dict[str, Profile] = {p.start_header.lower(): p for p in PROFILES if p.start_header}


def _unique(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


ROUTES: tuple[str, ...] = _unique([r for p in PROFILES for r in p.routes])
NEVER: tuple[str, ...] = _unique([n for p in PROFILES for n in p.never])
