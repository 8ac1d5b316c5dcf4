"""Field validators shared by every configuration schema (exporter, Redis view, gate,
restarter), so that a duration, a count or a secret means the same thing everywhere and
every error names the file and the dotted key.

    s = Section(data, "llm-health.yml")
    interval = s.duration("interval", 10.0)
    for entry in s.items("backends"):          # Sections named backends[0], backends[1], ...
        name = entry.string("name")
        entry.done()                             # unknown keys are refused, naming the first
    s.done()

A key read with any accessor counts as known; `done()` refuses the rest. A key given as
`null` counts as absent. Numbers must be finite: `.nan` and `.inf` are refused, as is any
value outside the accessor's range.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from ..urls import BadTarget, parse_target
from .errors import ConfigError

T = TypeVar("T")


class _Missing:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Missing()

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def parse_duration(value: object) -> float:
    """Seconds from a number or a string with a unit (`500ms`, `10s`, `5m`, `1h`).
    ValueError (with what was wrong) if it is not one, or not finite."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 10s, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"expected a duration like 10s, 500ms or 5m, got {value!r}")
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"must be a finite duration, got {value!r}")
    return seconds


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


class Section:
    """One mapping of a configuration file, with the dotted path that names it."""

    def __init__(self, data: object, where: str, path: str = ""):
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(where, path or "(top level)", f"expected a mapping, got {_kind(data)}")
        self.data: dict[Any, Any] = data
        self.where = where
        self.path = path
        self._read: set[str] = set()

    # --- plumbing -----------------------------------------------------------------------
    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str, problem: str) -> ConfigError:
        return ConfigError(self.where, self.key(name), problem)

    def whole_error(self, problem: str) -> ConfigError:
        """An error about this section as a whole (a missing choice between keys...)."""
        return ConfigError(self.where, self.path or "(top level)", problem)

    def __contains__(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        """The value as written (None as absent), marked known."""
        return self._get(name, default)[1]

    def _get(self, name: str, default: Any) -> tuple[bool, Any]:
        """(given, value): the default when absent, an error when absent and REQUIRED."""
        self._read.add(name)
        value = self.data.get(name)
        if value is None:
            if default is REQUIRED:
                raise self.error(name, "missing")
            return False, default
        return True, value

    def done(self) -> None:
        """Refuse the first key no accessor read."""
        unknown = sorted(str(k) for k in self.data if str(k) not in self._read)
        if unknown:
            expected = ", ".join(sorted(self._read)) or "nothing"
            raise self.error(unknown[0], f"unknown key (expected one of {expected})")

    # --- scalars ------------------------------------------------------------------------
    def duration(self, name: str, default: Any = REQUIRED, *, minimum: float = 0.0, maximum: float = 7 * 86400.0, zero: bool = False) -> float:
        """Seconds, strictly above `minimum` (0 by default) and at most `maximum`; exactly 0
        too where `zero` (an off switch)."""
        given, value = self._get(name, default)
        if not given:
            return value if value is None else float(value)  # type: ignore[return-value]
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            raise self.error(name, str(exc)) from None
        if not (seconds > minimum or (zero and seconds == 0)):
            raise self.error(name, f"must be greater than {minimum:g}s{' (or 0s)' if zero else ''}, got {value!r}")
        if seconds > maximum:
            raise self.error(name, f"must be at most {maximum:g}s, got {value!r}")
        return seconds

    def integer(self, name: str, default: Any = REQUIRED, *, minimum: int = 1, maximum: int | None = None) -> int:
        given, value = self._get(name, default)
        if not given:
            return value if value is None else int(value)  # type: ignore[return-value]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
            wanted = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
            if maximum is not None:
                wanted += f" and at most {maximum}"
            raise self.error(name, f"expected {wanted}, got {value!r}")
        return value

    def number(self, name: str, default: Any = REQUIRED, *, minimum: float | None = None, maximum: float | None = None, above: float | None = None) -> float:
        """A finite number in [minimum, maximum] (and > `above` when given)."""
        given, value = self._get(name, default)
        if not given:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self.error(name, f"expected a finite number, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(name, f"must be >= {minimum:g}, got {value!r}")
        if maximum is not None and value > maximum:
            raise self.error(name, f"must be <= {maximum:g}, got {value!r}")
        if above is not None and not value > above:
            raise self.error(name, f"must be greater than {above:g}, got {value!r}")
        return float(value)

    def string(self, name: str, default: Any = REQUIRED, *, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
        given, value = self._get(name, default)
        if not given:
            return value
        if not isinstance(value, str | int | float) or isinstance(value, bool) or str(value) == "":
            raise self.error(name, f"expected a non-empty string, got {value!r}")
        text = str(value)
        if pattern is not None and not pattern.match(text):
            raise self.error(name, f"{text!r}: {what or 'not allowed here'}")
        return text

    def choice(self, name: str, choices: tuple[str, ...], default: Any = REQUIRED) -> str:
        value = self.raw(name, default)
        if value not in choices:
            raise self.error(name, f"{value!r}: expected one of {', '.join(choices)}")
        return str(value)

    def boolean(self, name: str, default: Any = REQUIRED) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def url(self, name: str, default: Any = REQUIRED) -> str:
        """An http(s) URL a server is read at: scheme, host, optional port and path prefix,
        no credentials, query or fragment (urls.parse_target)."""
        value = self.string(name, default)
        try:
            return parse_target(value, what="url")
        except BadTarget as exc:
            raise self.error(name, str(exc)) from None

    # --- lists and mappings -------------------------------------------------------------
    def strings(self, name: str, default: Any = REQUIRED, *, unique: bool = True, nonempty: bool = True) -> tuple[str, ...]:
        given, value = self._get(name, default)
        if not given:
            return value if value is None else tuple(value)  # type: ignore[return-value]
        if not isinstance(value, list) or (nonempty and not value):
            raise self.error(name, f"expected a {'non-empty ' if nonempty else ''}list of strings, got {value!r}")
        out: list[str] = []
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise self.error(f"{name}[{i}]", f"expected a non-empty string, got {item!r}")
            if unique and item in out:
                raise self.error(f"{name}[{i}]", f"{item!r} is listed twice")
            out.append(item)
        return tuple(out)

    def argv(self, name: str) -> tuple[str, ...]:
        """A command as a list, run without a shell."""
        value = self.raw(name, REQUIRED)
        if isinstance(value, str):
            raise self.error(name, f"expected a list (an argv, run without a shell), e.g. [systemctl, restart, vllm@gpu0], got the string {value!r}")
        if not isinstance(value, list) or not value:
            raise self.error(name, "expected a non-empty list (an argv), e.g. [systemctl, restart, vllm@gpu0]")
        out = []
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, str | int | float) or str(item) == "":
                raise self.error(f"{name}[{i}]", f"expected a non-empty string, got {item!r}")
            out.append(str(item))
        return tuple(out)

    def section(self, name: str) -> Section:
        """A nested mapping (absent: empty)."""
        return Section(self.raw(name, {}), self.where, self.key(name))

    def items(self, name: str, default: Any = ()) -> Iterator[Section]:
        """Each mapping of a list, as a Section named `name[i]`."""
        value = self.raw(name, default)
        if not isinstance(value, list | tuple):
            raise self.error(name, f"expected a list, got {_kind(value)}")
        for i, entry in enumerate(value):
            yield Section(entry, self.where, f"{self.key(name)}[{i}]")

    def entries(self, name: str) -> Iterator[tuple[str, Section]]:
        """Each (key, mapping) of a mapping of mappings, as Sections named `name.key`."""
        value = self.raw(name, {})
        if not isinstance(value, dict):
            raise self.error(name, f"expected a mapping, got {_kind(value)}")
        for key, entry in value.items():
            yield str(key), Section(entry, self.where, f"{self.key(name)}.{key}")

    def mapping(self, name: str) -> dict[str, Any]:
        value = self.raw(name, {})
        if not isinstance(value, dict):
            raise self.error(name, f"expected a mapping, got {_kind(value)}")
        return value

    # --- secrets ------------------------------------------------------------------------
    def secret(self, base: str, *, required: bool = False) -> str | None:
        """A secret from `<base>_env` (an environment variable's name) or `<base>_file`
        (a file). Its value never enters a message."""
        env_key, file_key = f"{base}_env", f"{base}_file"
        var, path = self.raw(env_key), self.raw(file_key)
        if var is not None and path is not None:
            raise self.error(env_key, f"give {env_key} or {file_key}, not both")
        if var is not None:
            value = os.environ.get(str(var), "").strip()
            if not value:
                raise self.error(env_key, f"environment variable {var} is not set or empty")
            return value
        if path is not None:
            return read_secret_file(str(path), self.where, self.key(file_key))
        if required:
            raise self.error(env_key, f"missing: give {env_key} or {file_key}")
        return None


def read_secret_file(path: str, where: str, key: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(where, key, f"cannot read {path}: {exc.strerror}") from None
    if not value:
        raise ConfigError(where, key, f"{path} is empty")
    return value
