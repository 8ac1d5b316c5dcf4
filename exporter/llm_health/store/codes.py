"""The error-reply codes that mean "not now" (a failover, a resync, a Cluster settling; the
list and its reasons: store/errors.py), in a module of their own with no Redis import: the
nginx Lua door's plan (gate/nginx_lua.py) carries them, so every door classifies Redis'
answers alike."""

RETRYABLE_CODES = frozenset({"NOREPLICAS", "READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "UNBLOCKED"})
