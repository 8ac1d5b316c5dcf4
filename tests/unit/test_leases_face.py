"""The lease library's face, `llm_health.leases`: what other programs import, checked the way
httpx checks its own (`tests/test_exported_members.py`): every name listed is exported and
is the object the library uses; every error the library raises derives from one base."""

from __future__ import annotations

import redis.exceptions

import llm_health.leases as leases
from llm_health.store import errors, heartbeat, records
from llm_health.store import leases as store_leases


def test_all_exported_members_are_listed_and_importable():
    public = {name for name in dir(leases) if not name.startswith("_") and name not in ("annotations",)}
    assert set(leases.__all__) == public
    for name in leases.__all__:
        assert getattr(leases, name).__module__.startswith("llm_health.store"), name


def test_the_face_is_the_library_not_a_copy():
    assert leases.LeaseClient is store_leases.LeaseClient and leases.Heartbeat is heartbeat.Heartbeat
    assert leases.LeaseLost is records.LeaseLost and leases.NotReplicated is errors.NotReplicated
    assert callable(leases.LeaseClient.wait_for_gpu) and callable(leases.LeaseClient.from_url)


def test_one_exception_tree_the_old_bases_kept():
    for exc in (leases.LeaseLost, leases.KeyspaceEventsOff, leases.NotReplicated):
        assert issubclass(exc, leases.LeaseError)
    # existing callers' except clauses still catch them
    assert issubclass(leases.KeyspaceEventsOff, RuntimeError)
    assert issubclass(leases.NotReplicated, redis.exceptions.RedisError)
