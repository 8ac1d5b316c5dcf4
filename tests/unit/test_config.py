"""Configuration: defaults, durations, and errors that name the file and the key."""

from __future__ import annotations

import pytest

from llm_health.config import exporter as config
from llm_health.config.errors import ConfigError

GOOD = """
global:
  interval: 5s
  hung_after_seconds: 1m
backends:
  - name: gpu0
    url: http://10.0.0.5:8000/v1
  - name: lb
    url: http://10.0.0.9:8000
    kind: proxy
    interval: 500ms
"""


def test_good_config(tmp_path):
    f = tmp_path / "c.yml"
    f.write_text(GOOD)
    cfg = config.load(f)
    assert cfg.timing.interval == 5 and cfg.timing.hung_after_seconds == 60
    gpu0, lb = cfg.backends
    assert (gpu0.kind, gpu0.timing.interval) == ("engine", 5)
    assert (lb.kind, lb.timing.interval, lb.timing.hung_after_seconds) == ("proxy", 0.5, 60)


@pytest.mark.parametrize("spelling", ["engine", "vllm"])
def test_kind_engine_and_its_old_spelling(tmp_path, spelling):
    """`kind: engine` is any engine with /metrics, detected; `kind: vllm` is its old spelling, read as engine."""
    f = tmp_path / "c.yml"
    f.write_text(f"backends:\n  - {{name: a, url: 'http://x:1', kind: {spelling}}}\n")
    assert config.load(f).backends[0].kind == "engine"


@pytest.mark.parametrize(
    "text,key,problem",
    [
        ("backends: {}", "backends", "expected a list"),
        ("backends:\n  - url: http://x:1\n", "backends[0].name", "missing"),
        ("backends:\n  - {name: a, url: 'ftp://x'}\n", "backends[0].url", "not an http"),
        ("backends:\n  - {name: a, url: 'http://x:1', kind: gpu}\n", "backends[0].kind", "expected one of"),
        ("backends:\n  - {name: a, url: 'http://x:1', intervall: 5}\n", "backends[0].intervall", "unknown key"),
        ("backends:\n  - {name: a, url: 'http://x:1'}\n  - {name: a, url: 'http://y:1'}\n", "backends[1].name", "duplicate"),
        ("global: {interval: fast}\n", "global.interval", "duration"),
        ("global: {interval: -5}\n", "global.interval", "greater than 0"),
        ("global: {max_metrics_bytes: 1.5}\n", "global.max_metrics_bytes", "positive integer"),
        ("globals: {}\n", "globals", "unknown key"),
        ("backends:\n  - {name: a, url: 'http://x:1', api_key_env: LLM_HEALTH_TEST_UNSET_VAR}\n", "backends[0].api_key_env", "not set"),
        ("backends:\n  - {name: a, url: 'http://x:1', api_key_file: /nonexistent/key}\n", "backends[0].api_key_file", "cannot read"),
        ("backends: [\n", "line", "not valid YAML"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, key, problem):
    f = tmp_path / "bad.yml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.load(f)
    msg = str(err.value)
    assert str(f) in msg and key in msg and problem in msg


def test_api_key_from_env_never_in_repr(monkeypatch):
    monkeypatch.setenv("K", "sk-very-secret")
    cfg = config.parse({"backends": [{"name": "a", "url": "http://x:1", "api_key_env": "K"}]})
    assert cfg.backends[0].api_key == "sk-very-secret"
    assert "sk-very-secret" not in repr(cfg)
