"""`llm-health serve` raises its soft RLIMIT_NOFILE to the hard limit (one connection per
backend: 10,000 backends are past the usual soft limit of 1024), logs it, and warns when
even the hard limit is short."""

from __future__ import annotations

import logging
import resource

from llm_health.cli import serve


def test_the_soft_limit_is_raised_to_the_hard_one_and_logged(monkeypatch, caplog):
    limits = {"now": (1024, 65536)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))
    with caplog.at_level(logging.INFO, logger="t"):
        assert serve.raise_nofile(10_000, logging.getLogger("t")) == (65536, 65536)
    assert limits["now"] == (65536, 65536)
    assert "raised the RLIMIT_NOFILE soft limit from 1024 to the hard limit 65536" in caplog.text
    assert "WARNING" not in caplog.text


def test_a_short_hard_limit_is_warned_of(monkeypatch, caplog):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (4096, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: (_ for _ in ()).throw(AssertionError("nothing to raise")))
    with caplog.at_level(logging.INFO, logger="t"):
        serve.raise_nofile(10_000, logging.getLogger("t"))
    assert "RLIMIT_NOFILE is 4096, under the 10256 descriptors 10000 backends want" in caplog.text


def test_a_refused_raise_is_warned_of_and_changes_nothing(monkeypatch, caplog):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 2048))

    def refuse(which, value):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    with caplog.at_level(logging.INFO, logger="t"):
        assert serve.raise_nofile(10, logging.getLogger("t")) == (1024, 2048)
    assert "could not raise the RLIMIT_NOFILE soft limit from 1024 to 2048" in caplog.text
