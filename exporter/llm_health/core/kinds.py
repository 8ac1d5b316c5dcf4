"""What a backend in the configuration is: `engine` (any engine with `/metrics`, told by
its payload: core.engines) or `proxy` (checked through `/v1/models` alone). `vllm` is the
old spelling of `engine`, still accepted everywhere a kind is (configuration, `check
--kind`, `/probe?kind=`) and read as `engine`. Pure."""

from __future__ import annotations

ENGINE = "engine"
PROXY = "proxy"
KINDS: tuple[str, ...] = (ENGINE, PROXY)
ALIASES: dict[str, str] = {"vllm": ENGINE}  # the old spelling, from before every engine was detected
ACCEPTED: tuple[str, ...] = (*KINDS, *ALIASES)


def normalize(kind: str) -> str:
    """The kind an accepted spelling means; ValueError naming the accepted ones otherwise."""
    kind = ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)} ({', '.join(f'{a}: {k}' for a, k in ALIASES.items())}), not {kind[:100]!r}")
    return kind
