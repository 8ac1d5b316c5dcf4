"""The `llm-health` command as a user runs it: a subprocess, exit codes, messages."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.unit.test_config import GOOD


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llm_health", *args], capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    )


def test_config_check_command(tmp_path):
    good = tmp_path / "good.yml"
    good.write_text(GOOD)
    r = _cli("config", "check", str(good))
    assert r.returncode == 0 and "SUCCESS" in r.stdout and "2 backends" in r.stdout
    bad = tmp_path / "bad.yml"
    bad.write_text("backends:\n  - {name: a, url: 'http://x:1', kind: gpu}\n")
    r = _cli("config", "check", str(bad))
    assert r.returncode == 1 and "backends[0].kind" in r.stderr and str(bad) in r.stderr


def test_serve_refuses_bad_config(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("global: {interval: soon}\n")
    r = _cli("serve", "--config.file", str(bad), "--web.listen-address", "127.0.0.1:0")
    assert r.returncode == 2 and "global.interval" in r.stderr


def test_log_level_before_or_after_the_subcommand(tmp_path):
    good = tmp_path / "good.yml"
    good.write_text(GOOD)
    for args in (("--log.level", "debug", "config", "check", str(good)), ("config", "check", str(good), "--log.level", "debug")):
        r = _cli(*args)
        assert r.returncode == 0 and "SUCCESS" in r.stdout, (args, r.stderr)
    r = _cli("config", "check", str(good), "--log.level", "loud")
    assert r.returncode == 2 and "--log.level" in r.stderr


def test_config_check_tells_gate_and_restarter_configs(tmp_path):
    gate = tmp_path / "gate.yml"
    gate.write_text("gate:\n  routes:\n    chat: {upstream: 'http://127.0.0.1:1'}\n")
    r = _cli("config", "check", str(gate))
    assert r.returncode == 0 and "gate config, 1 routes" in r.stdout, r.stderr
    gate.write_text("gate:\n  routes:\n    chat: {upstream: 'http://127.0.0.1:1'}\n  admin_token_env: LLM_HEALTH_TEST_UNSET\n")
    r = _cli("config", "check", str(gate))
    assert r.returncode == 1 and "gate.admin_token_env" in r.stderr, r.stderr
