"""The registered engines, in the order a payload is matched against them.

Adding an engine: a module beside this one with its `Profile`, and one line here
(docs/architecture.md, "Adding an engine", lists the other places). Order matters only
where a payload could carry two markers: V1 before V0 (a V1 engine of some versions still
lists the deprecated gauge).

`register` adds an engine at run time (a plugin, a test engine); `PROFILES`, `BY_NAME`
and `BY_START_HEADER` are updated in place, so every module holding them sees it, and
`version()` changes, so what is derived from them (core.engines.payload_names) is made
again. The doors' allowlists (core.forwarding) are read once, when they load: an engine
registered at run time has no routes of its own and no paths never forwarded.
"""

from __future__ import annotations

from .llamacpp import LLAMACPP
from .profile import Profile
from .sglang import SGLANG
from .tgi import TGI
from .triton import TRITON
from .vllm import VLLM_V0, VLLM_V1

PROFILES: list[Profile] = [VLLM_V1, VLLM_V0, SGLANG, TGI, LLAMACPP, TRITON]
BY_NAME: dict[str, Profile] = {}
# Response headers of `/metrics` that carry a process start, and the engine sending each.
BY_START_HEADER: dict[str, Profile] = {}
_version = 0


def _unique(items: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


ROUTES: tuple[str, ...] = _unique([r for p in PROFILES for r in p.routes])
NEVER: tuple[str, ...] = _unique([n for p in PROFILES for n in p.never])


def _rebuild() -> None:
    global _version
    BY_NAME.clear()
    BY_NAME.update({p.name: p for p in PROFILES})
    BY_START_HEADER.clear()
    BY_START_HEADER.update({p.start_header.lower(): p for p in PROFILES if p.start_header})
    _version += 1


def version() -> int:
    """Changes whenever the registered engines do."""
    return _version


def register(profile: Profile) -> None:
    """Add an engine after those registered. ValueError where its name, marker or start
    header is another engine's, or where it has routes or never-forwarded paths (the
    doors read those when they load)."""
    if profile.name in BY_NAME:
        raise ValueError(f"engine {profile.name!r} is registered already")
    if profile.routes or profile.never:
        raise ValueError(f"engine {profile.name!r}: routes and never-forwarded paths are read when the doors load; list it in the registry")
    for other in PROFILES:
        if profile.marker in (other.marker, *other.fallback_markers):
            raise ValueError(f"engine {profile.name!r}: its marker {profile.marker} tells {other.name} already")
    if profile.start_header and profile.start_header.lower() in BY_START_HEADER:
        raise ValueError(f"engine {profile.name!r}: the start header {profile.start_header} is {BY_START_HEADER[profile.start_header.lower()].name}'s")
    PROFILES.append(profile)
    _rebuild()


def unregister(name: str) -> Profile:
    """Remove a registered engine (a test's, at its end); KeyError where none has the name."""
    profile = BY_NAME[name]
    PROFILES.remove(profile)
    _rebuild()
    return profile


_rebuild()
