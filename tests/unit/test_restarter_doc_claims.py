"""Claims of docs/restarts.md about the restarter's configuration and bookkeeping, checked
on the functions that hold them: the defaults the doc's configuration block lists (read
from the doc itself, so it cannot drift), the default listen address, how long an alert
acted on is remembered, and the warning when a restart command's output file is cut."""

from __future__ import annotations

import logging
import re
from dataclasses import fields

import yaml

from llm_health.cli import parser
from llm_health.config.restarter import RestarterConfig, Target, Verify, parse_config
from llm_health.core import restart_policy
from llm_health.core.restart_policy import Budget, Policy
from llm_health.core.webhook import Alert
from llm_health.restarter.runner import OutputFiles
from tests.fixtures.paths import ROOT

RESTARTS_MD = ROOT / "docs" / "restarts.md"
NOT_IN_THE_RESTARTER_SECTION = {"targets", "redis", "source"}


def doc_config_block() -> dict:
    """The YAML block of docs/restarts.md's "## Configuration" section."""
    text = RESTARTS_MD.read_text()
    section = text[text.index("\n## Configuration\n") :]
    m = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert m, "no yaml block under ## Configuration"
    data = yaml.safe_load(m.group(1))
    assert "every key optional; these are the defaults" in m.group(1).splitlines()[0]
    return data


def test_the_restarter_defaults_are_those_the_doc_lists(monkeypatch):
    """docs/restarts.md: `restarter:  # every key optional; these are the defaults`."""
    monkeypatch.setenv("VLLM_API_KEY", "k")  # the block's gpu0 reads it
    doc = doc_config_block()
    documented = parse_config(doc, "docs/restarts.md")
    minimal = parse_config({"backends": [{"name": "gpu0", "url": "http://10.0.0.5:8000", "restart": ["/bin/true"]}]}, "minimal")
    listed = set(doc["restarter"])
    # the doc lists every key of the section...
    assert listed == {f.name for f in fields(RestarterConfig)} - NOT_IN_THE_RESTARTER_SECTION
    assert set(doc["restarter"]["budget"]) == {f.name for f in fields(Budget)}
    assert set(doc["restarter"]["verify"]) == {f.name for f in fields(Verify)}
    # ...and each at its default, but output_dir: "(default: a private temp dir)"
    for key in sorted(listed - {"output_dir"}):
        assert getattr(documented, key) == getattr(minimal, key), key
    assert minimal.output_dir is None and "default: a private temp dir" in RESTARTS_MD.read_text()
    # a backend's: `restart_timeout: 120s  # default 120s`; instance "default: host:port of url"
    gpu0 = documented.targets[0]
    assert (minimal.targets[0].restart_timeout, minimal.targets[0].instance, minimal.targets[0].kind) == (gpu0.restart_timeout, gpu0.instance, "engine")


def test_the_default_listen_address_is_loopback_9120():
    """docs/restarts.md: `--web.listen-address` (default `127.0.0.1:9120`)."""
    args = parser().parse_args(["restarter", "--config.file", "restarter.yml"])
    assert args.web_listen_address == ("127.0.0.1", 9120)


def test_an_alert_acted_on_is_remembered_for_24_hours():
    """docs/restarts.md: "An alert that led to a restart (any outcome, dry run included) is
    remembered for 24 h. Every later delivery of it is a `duplicate`." """
    assert restart_policy.KEY_TTL == 24 * 3600
    gpu0 = Target("gpu0", "http://10.0.0.5:8000", "10.0.0.5:8000", restart=("/bin/true",))
    policy = Policy([gpu0], Budget(max_restarts=100, window=3600, cooldown=1, backoff=1))
    assert policy.key_ttl == restart_policy.KEY_TTL
    alert = Alert("LLMBackendHung", "firing", {"alertname": "LLMBackendHung", "backend": "gpu0"}, "2024-05-01T10:00:00Z", "f1", {})
    assert policy.admit(alert, 0.0).decision == "accepted"
    policy.finish("gpu0", alert.key, True, 0.0)
    assert policy.admit(alert, 24 * 3600 - 1).decision == "duplicate"
    assert policy.admit(alert, 24 * 3600 + 1).decision == "accepted"


def test_an_output_file_cut_at_its_cap_warns_to_redirect_the_servers_output(tmp_path, caplog):
    """docs/restarts.md: the file is truncated when it passes `max_output_file_bytes` "(and a
    warning says to redirect that server's output)"."""
    caplog.set_level(logging.WARNING, logger="llm_health.restarter")
    files = OutputFiles(tmp_path / "out", keep=5, max_bytes=1000)
    path = files.new("gpu0", 1)
    path.write_bytes(b"x" * 1000)
    files.enforce()
    assert caplog.records == [] and path.stat().st_size == 1000  # at the cap, not past it
    path.write_bytes(b"x" * 1001)  # a server the command left running writes on
    files.enforce()
    assert path.stat().st_size == 0
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and str(path) in record.getMessage()
    assert "redirect that server's output" in record.getMessage()
