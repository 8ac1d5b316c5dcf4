"""A payload reduced to the `Reading` the state machine is fed, by the registered engines'
profiles (registry): how to tell the engines apart from a payload, and which series mean
running, waiting, progress, start time and sleep.

Pure: no I/O. A payload is parsed once with the targeted parser, asking for the series
of every profile (`payload_names()`); the profile is then told by the series present.

Numbers from an engine are evidence only when they can be: a running or waiting count
that is NaN, infinite or negative, a counter or gauge that is not a finite non-negative
number, a start time that is not a finite positive number, is read as unknown (NaN, or
None for the start time). An unknown value never makes an engine idle, never makes it
restarted, and never hides what the other values show.

A payload past the reader's `Limits` (engine units, wanted samples, unit label length)
is refused whole with `OverLimits`: the exporter keeps per-engine state, and one backend
must not make it keep unbounded state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import CoreError
from ..exposition import Budget, Names, Samples, TooManySamples, compile_names, parse
from . import registry
from .profile import START_TIME, Profile
from .registry import PROFILES


@dataclass(frozen=True)
class Limits:
    """What one payload may hold before it is refused (configurable per exporter)."""

    max_engines: int = 256  # engine units (model_name x data-parallel rank)
    max_samples: int = 10_000  # samples of the wanted series, and lines starting with `{`
    max_label_length: int = 512  # characters of a unit label value (model_name, engine)


class OverLimits(CoreError, ValueError):
    """The payload holds more than the reader's Limits allow."""


@dataclass(frozen=True)
class EngineReading:
    """One engine unit (a data-parallel rank of one model) at one instant. `running` and
    `waiting` are NaN where the engine's number was no evidence (NaN, infinite, negative)."""

    model_name: str
    engine: str
    running: float
    waiting: float
    steps: float | None
    generation_tokens: float | None
    counters: tuple[float, ...]  # in profile order, NaN where absent or no evidence
    gauges: tuple[float, ...]
    sleeping: bool = False
    output: tuple[float, ...] = ()  # the profile's output counters, NaN where absent or no evidence

    @property
    def key(self) -> tuple[str, str]:
        return (self.model_name, self.engine)

    @property
    def in_flight(self) -> bool:
        """Work is surely in flight: a known running or waiting count above zero."""
        return self.running > 0 or self.waiting > 0

    @property
    def known(self) -> bool:
        """Whether the engine's own numbers say if work is in flight."""
        return self.in_flight or not (math.isnan(self.running) or math.isnan(self.waiting))

    @property
    def fingerprint(self) -> tuple[float, ...]:
        return self.counters + self.gauges


@dataclass(frozen=True)
class Reading:
    """A parsed `/metrics` payload of one backend, reduced to what the decision needs."""

    profile: str
    start_time: float | None
    engines: dict[tuple[str, str], EngineReading] = field(default_factory=dict)
    # The engine's own refusals (`Profile.refusals`) by reason, summed over the backend;
    # None where the profile has no such counter or the payload holds none of it.
    refusals: dict[str, float] | None = None


class UnknownEngine(CoreError, ValueError):
    """The payload is text exposition but no profile's series are in it."""


_names: tuple[int, Names] | None = None


def payload_names() -> Names:
    """The series a payload is parsed for: every registered profile's wanted series and
    markers (made again when the registered engines change)."""
    global _names
    if _names is None or _names[0] != registry.version():
        markers = (name for p in PROFILES for name in (p.marker, *p.fallback_markers))
        _names = (registry.version(), compile_names(frozenset().union(*(p.wanted for p in PROFILES), markers)))
    return _names[1]


def detect(samples: Samples) -> Profile:
    """Choose the profile from the series present in the payload: a marker first, then
    the fallback markers (an older or partial payload)."""
    for profile in PROFILES:
        if profile.marker in samples:
            return profile
    for profile in PROFILES:
        if any(name in samples for name in profile.fallback_markers):
            return profile
    prefixes = ", ".join(dict.fromkeys(p.prefix for p in PROFILES))
    raise UnknownEngine(f"no known engine series ({prefixes}) in /metrics")


def _unit(labels: dict[str, str], unit_labels: tuple[str, ...]) -> tuple[str, str]:
    values = [labels.get(name, "") for name in unit_labels] + ["", ""]
    return (values[0], values[1])


def _sum_by_unit(samples: Iterable[tuple[dict[str, str], float]], unit_labels: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """Per unit, the sum of the samples; NaN for a unit with any value that is no evidence
    (not a finite number at or above zero: it cannot be a count, a counter or a usage)."""
    out: dict[tuple[str, str], float] = {}
    first, second = (*unit_labels, "", "")[:2]  # "" is no label name: labels.get gives ""
    inf, nan = math.inf, math.nan
    for labels, value in samples:
        key = (labels.get(first, ""), labels.get(second, ""))
        out[key] = out.get(key, 0.0) + (value if 0 <= value < inf else nan)
    return out


def read(text: str, limits: Limits | None = None) -> Reading:
    """Parse a whole payload and reduce it (for callers with the text at hand; the
    exporter parses in pieces, see probe.pieces)."""
    limits = limits or Limits()
    try:
        samples = parse(text, payload_names(), budget=Budget(limits.max_samples))
    except TooManySamples as exc:
        raise OverLimits(f"{exc}, more than max_samples") from None
    return reduce(samples, limits)


def reduce(samples: Samples, limits: Limits | None = None) -> Reading:
    """A payload's samples (of payload_names()) reduced to a `Reading`, one `EngineReading`
    per engine unit. Raises UnknownEngine, or OverLimits."""
    limits = limits or Limits()
    profile = detect(samples)
    start = samples.get(START_TIME)
    start_time = start[0][1] if start else None
    if start_time is not None and not (math.isfinite(start_time) and start_time > 0):
        start_time = None  # no evidence of a start time, so none of a restart either

    sums = {name: _sum_by_unit(samples.get(name, ()), profile.unit_labels) for name in profile.wanted}
    units: set[tuple[str, str]] = set()
    for name in (*profile.running, *profile.waiting, *profile.counters):
        units.update(sums[name])
    if not units:
        raise UnknownEngine(f"{profile.name} payload has none of {sorted(profile.running + profile.waiting)}")
    if len(units) > limits.max_engines:
        raise OverLimits(f"{len(units)} engine units (model_name, engine), more than max_engines {limits.max_engines}")
    longest = max(len(v) for key in units for v in key)
    if longest > limits.max_label_length:
        raise OverLimits(f"a unit label value of {longest} characters, more than max_label_length {limits.max_label_length}")

    awake: dict[tuple[str, str], float] = {}
    if profile.sleep_awake:
        for labels, value in samples.get(profile.sleep_awake, ()):
            if labels.get("sleep_state") == "awake":
                awake[_unit(labels, profile.unit_labels)] = value

    def total(names: tuple[str, ...], key: tuple[str, str]) -> float:
        return sum(sums[n].get(key, 0.0) for n in names)

    def one(name: str | None, key: tuple[str, str]) -> float | None:
        return sums[name].get(key, math.nan) if name else None

    engines = {}
    for key in sorted(units):
        engines[key] = EngineReading(
            model_name=key[0],
            engine=key[1],
            running=total(profile.running, key),
            waiting=total(profile.waiting, key),
            steps=one(profile.steps, key),
            generation_tokens=one(profile.generation_tokens, key),
            counters=tuple(sums[n].get(key, math.nan) for n in profile.counters),
            gauges=tuple(sums[n].get(key, math.nan) for n in profile.gauges),
            sleeping=awake.get(key, 1.0) == 0.0,
            output=tuple(sums[n].get(key, math.nan) for n in profile.output),
        )
    return Reading(profile=profile.name, start_time=start_time, engines=engines, refusals=_refusals(samples, profile))


def _refusals(samples: Samples, profile: Profile) -> dict[str, float] | None:
    """The profile's refusal counter summed per reason (one of `refusal_reasons`, else
    "other"); a value that is no count (NaN, infinite, negative) is left out."""
    if not profile.refusals or profile.refusals not in samples:
        return None
    out: dict[str, float] = {}
    for labels, value in samples[profile.refusals]:
        if 0 <= value < math.inf:
            reason = labels.get(profile.refusal_label, "")
            key = reason if reason in profile.refusal_reasons else "other"
            out[key] = out.get(key, 0.0) + value
    return out
