"""One error tree (core.errors): every exception class the package defines derives from
LLMHealthError, through its room's branch, and keeps the built-in base callers catch."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import llm_health
from llm_health.cli.common import CliError
from llm_health.config.errors import ConfigError
from llm_health.core.errors import CoreError, LLMHealthError
from llm_health.gate.headers import GateError
from llm_health.probe.fast_http import ProbeError
from llm_health.sim.launch import SimError
from llm_health.store.codes import StoreError

BRANCHES = {
    "core": CoreError,
    "config": ConfigError,
    "probe": ProbeError,
    "store": StoreError,
    "gate": GateError,
    "cli": CliError,
    "sim": SimError,
}


def exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in a module of the package (each module imported)."""
    found = []
    for info in pkgutil.walk_packages(llm_health.__path__, "llm_health."):
        if info.name.endswith("__main__"):  # runs the command line
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                found.append(cls)
    return found


def test_every_exception_of_the_package_derives_from_the_root_through_its_room():
    classes = exception_classes()
    assert len(classes) >= 25, [c.__qualname__ for c in classes]  # the walk found them
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, LLMHealthError)]
    assert not outside, f"not under LLMHealthError (core.errors): {outside}"
    for cls in classes:
        room = cls.__module__.split(".")[1]
        branch = BRANCHES.get(room)
        if branch is not None and cls is not LLMHealthError:
            assert issubclass(cls, branch), f"{cls.__module__}.{cls.__qualname__} is not under its room's {branch.__qualname__}"


def test_a_class_keeps_the_built_in_base_callers_catch():
    from redis.exceptions import RedisError

    from llm_health.core.exposition import ParseError
    from llm_health.store.errors import NotReplicated, RedisDown
    from llm_health.store.records import LeaseError
    from llm_health.store.target import TargetError
    from llm_health.urls import BadTarget

    for cls in (ConfigError, ParseError, TargetError, BadTarget):
        assert issubclass(cls, ValueError) and issubclass(cls, LLMHealthError)
    assert issubclass(RedisDown, RedisError) and issubclass(NotReplicated, LeaseError) and issubclass(NotReplicated, RedisError)
    try:
        raise TargetError("redis://x: no")
    except LLMHealthError as e:
        assert str(e) == "redis://x: no"


def test_an_http_error_s_case_is_its_class():
    """probe.fast_http's failures: one subclass per case, its flag set, the others not."""
    from llm_health.probe.fast_http import BodyTooLarge, HttpClosed, HttpError, HttpRefused, HttpTimeout

    flags = ("timed_out", "refused", "too_large", "closed")
    for cls, flag in ((HttpTimeout, "timed_out"), (HttpRefused, "refused"), (BodyTooLarge, "too_large"), (HttpClosed, "closed")):
        e = cls("what happened")
        assert isinstance(e, HttpError) and str(e) == "what happened"
        assert [f for f in flags if getattr(e, f)] == [flag]
    assert not any(getattr(HttpError("x"), f) for f in flags)


def test_the_lease_library_keeps_its_promise_every_error_of_its_own_is_a_lease_error():
    """llm_health.leases says every error it raises on its own derives from LeaseError: a
    Redis URL it cannot use and a TTL that is not positive included, each still the
    ValueError (and the URL's the TargetError) a caller of the store may catch."""
    from llm_health.leases import LeaseArgumentError, LeaseClient, LeaseError, LeaseTargetError
    from llm_health.store.target import TargetError

    for url in ("redis+cluster://user:sekrit@", "http://127.0.0.1:6379", "redis://127.0.0.1:6379/notadb"):
        try:
            LeaseClient.from_url(url)
        except LeaseError as e:
            assert isinstance(e, LeaseTargetError) and isinstance(e, TargetError) and isinstance(e, ValueError)
            assert "sekrit" not in str(e), str(e)
        else:
            raise AssertionError(f"{url}: no error")
    try:
        LeaseClient.from_url("redis://127.0.0.1:1/0", ttl_ms=0)
    except LeaseArgumentError as e:
        assert isinstance(e, LeaseError) and isinstance(e, ValueError) and "ttl_ms" in str(e)
    else:
        raise AssertionError("ttl_ms=0: no error")
    from llm_health.store.keys import LeaseKeys

    for bad in ({"lease_prefix": ""}, {"lease_prefix": "lease"}, {"lease_prefix": "gpu:lease:", "fence_prefix": ""}):
        try:
            LeaseKeys(**bad)
        except LeaseArgumentError as e:
            assert isinstance(e, ValueError) and "prefix" in str(e)
        else:
            raise AssertionError(f"LeaseKeys({bad}): no error")
    try:
        LeaseClient.from_url("redis://127.0.0.1:1/0", feed_linger_s=-1)
    except LeaseArgumentError as e:
        assert "linger_s" in str(e)
    else:
        raise AssertionError("feed_linger_s=-1: no error")
