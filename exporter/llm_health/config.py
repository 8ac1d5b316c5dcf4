"""The exporter's YAML configuration, checked with errors that name the file and the key.

```yaml
global:                      # every key optional; these are the defaults
  interval: 10s              # seconds between rounds per backend
  hung_after_seconds: 60     # least time without progress before `hung`
  probe_interval: 60s        # at most one 1-token probe per idle backend per this
  probe_timeout: 5s
  connect_timeout: 3s
  metrics_timeout: 30s       # a slow /metrics is load, not death: keep this generous
  models_timeout: 10s
  max_metrics_bytes: 16777216
  max_probe_targets: 1000    # state kept for /probe?target=... (least recently used dropped)
backends:
  - name: gpu0               # the `backend` label
    url: http://10.0.0.5:8000
    kind: vllm               # vllm (any engine with /metrics) or proxy (/v1/models only)
    interval: 10s            # optional, overrides global
    api_key_env: VLLM_API_KEY      # or api_key_file: /etc/llm-health/gpu0.key
redis: {...}                 # optional: see docs/redis-schema.md
```
Durations are seconds, or strings with a unit: `500ms`, `10s`, `5m`, `1h`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import ConfigError
from .health import Settings

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
KINDS = ("vllm", "proxy")


def duration(value, where: str, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(where, key, f"expected a duration like 10s, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(where, key, f"expected a duration like 10s, 500ms or 5m, got {value!r}")
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if seconds <= 0:
        raise ConfigError(where, key, f"must be greater than 0, got {value!r}")
    return seconds


def _positive_int(value, where, key) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(where, key, f"expected a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Timing:
    interval: float = 10.0
    hung_after_seconds: float = 60.0
    probe_interval: float = 60.0
    probe_timeout: float = 5.0
    connect_timeout: float = 3.0
    metrics_timeout: float = 30.0
    models_timeout: float = 10.0
    max_metrics_bytes: int = 16 * 1024 * 1024
    max_probe_targets: int = 1000

    def settings(self) -> Settings:
        return Settings(hung_after_seconds=self.hung_after_seconds, probe_interval=self.probe_interval)


@dataclass(frozen=True)
class Backend:
    name: str
    url: str
    kind: str = "vllm"
    timing: Timing = field(default_factory=Timing)
    api_key: str | None = field(default=None, repr=False)  # never printed


@dataclass(frozen=True)
class Config:
    timing: Timing
    backends: tuple[Backend, ...]
    redis: dict | None = None
    source: str = "<config>"


_DURATION_KEYS = ("interval", "hung_after_seconds", "probe_interval", "probe_timeout", "connect_timeout", "metrics_timeout", "models_timeout")
_INT_KEYS = ("max_metrics_bytes", "max_probe_targets")
_BACKEND_KEYS = {"name", "url", "kind", "api_key_env", "api_key_file", *_DURATION_KEYS}


def _timing(section: dict, where: str, prefix: str, base: Timing) -> Timing:
    values = {}
    for key in _DURATION_KEYS:
        if key in section:
            values[key] = duration(section[key], where, f"{prefix}{key}")
    for key in _INT_KEYS:
        if key in section:
            values[key] = _positive_int(section[key], where, f"{prefix}{key}")
    return Timing(**{**base.__dict__, **values})


def read_api_key(entry: dict, where: str, prefix: str) -> str | None:
    """An API key from an environment variable or a file; the value never enters a message."""
    if "api_key_env" in entry and "api_key_file" in entry:
        raise ConfigError(where, f"{prefix}api_key_env", "give api_key_env or api_key_file, not both")
    if "api_key_env" in entry:
        var = str(entry["api_key_env"])
        value = os.environ.get(var)
        if not value:
            raise ConfigError(where, f"{prefix}api_key_env", f"environment variable {var} is not set or empty")
        return value.strip()
    if "api_key_file" in entry:
        path = Path(str(entry["api_key_file"]))
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(where, f"{prefix}api_key_file", f"cannot read {path}: {exc.strerror}") from None
        if not value:
            raise ConfigError(where, f"{prefix}api_key_file", f"{path} is empty")
        return value
    return None


def parse(data, where: str = "<config>") -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(where, "(top level)", f"expected a mapping, got {type(data).__name__}")
    unknown = set(data) - {"global", "backends", "redis"}
    if unknown:
        raise ConfigError(where, sorted(unknown)[0], "unknown key (expected global, backends, redis)")
    glob = data.get("global")
    if glob is None:
        glob = {}
    if not isinstance(glob, dict):
        raise ConfigError(where, "global", "expected a mapping")
    bad = set(glob) - set(_DURATION_KEYS) - set(_INT_KEYS)
    if bad:
        raise ConfigError(where, f"global.{sorted(bad)[0]}", "unknown key")
    timing = _timing(glob, where, "global.", Timing())

    raw = data.get("backends")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise ConfigError(where, "backends", "expected a list of backends")
    backends, seen = [], set()
    for i, entry in enumerate(raw):
        prefix = f"backends[{i}]."
        if not isinstance(entry, dict):
            raise ConfigError(where, f"backends[{i}]", "expected a mapping with name and url")
        bad = set(entry) - _BACKEND_KEYS
        if bad:
            raise ConfigError(where, f"{prefix}{sorted(bad)[0]}", f"unknown key (expected one of {', '.join(sorted(_BACKEND_KEYS))})")
        for key in ("name", "url"):
            if not entry.get(key):
                raise ConfigError(where, f"{prefix}{key}", "missing")
        name = str(entry["name"])
        if not _NAME.match(name):
            raise ConfigError(where, f"{prefix}name", f"{name!r}: use letters, digits and _ . : - only")
        if name in seen:
            raise ConfigError(where, f"{prefix}name", f"duplicate backend name {name!r}")
        seen.add(name)
        url = str(entry["url"])
        if not re.match(r"^https?://[^/\s]+", url):
            raise ConfigError(where, f"{prefix}url", f"{url!r} is not an http(s) URL")
        kind = entry.get("kind", "vllm")
        if kind not in KINDS:
            raise ConfigError(where, f"{prefix}kind", f"{kind!r}: expected one of {', '.join(KINDS)}")
        backends.append(
            Backend(name=name, url=url, kind=kind, timing=_timing(entry, where, prefix, timing), api_key=read_api_key(entry, where, prefix))
        )
    redis = data.get("redis")
    if redis is not None and not isinstance(redis, dict):
        raise ConfigError(where, "redis", "expected a mapping")
    return Config(timing=timing, backends=tuple(backends), redis=redis, source=where)


def load_yaml(path: str | os.PathLike):
    """A YAML file's data; a ConfigError naming the file and the line where it is not YAML.
    Shared by every config the package reads (exporter, gate, restarter)."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(where, "(file)", f"cannot read: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(parse)"
        raise ConfigError(where, at, f"not valid YAML: {getattr(exc, 'problem', exc)}") from None


def load(path: str | os.PathLike) -> Config:
    return parse(load_yaml(path), str(path))
