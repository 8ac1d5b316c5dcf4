"""The error-reply codes that mean "not now" (a failover, a resync, a Cluster settling; the
list and its reasons: store/errors.py), in a module of their own with no Redis import: the
nginx Lua door's plan (gate/nginx_lua.py) carries them, so every door classifies Redis'
answers alike. And the store room's branch of the error tree (core.errors), here for the
same reason: what needs no Redis can import it, the lease library's `LeaseError` and
`LeaseArgumentError` (raised by store.keys, which needs no Redis) included."""

from ..core.errors import LLMHealthError

RETRYABLE_CODES = frozenset({"NOREPLICAS", "READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "UNBLOCKED"})


class StoreError(LLMHealthError):
    """The store room's branch of the error tree (core.errors)."""


class LeaseError(StoreError):
    """The base of every error the lease library raises on its own (`llm_health.leases`):
    `LeaseLost`, `KeyspaceEventsOff`, `NotReplicated`. Redis' own errors pass through as
    redis-py raises them."""


class LeaseArgumentError(LeaseError, ValueError):
    """An argument the lease library cannot use (a TTL, a Redis URL); the message names it.
    A ValueError too, as Python's own checks of an argument are."""
