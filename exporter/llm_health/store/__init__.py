"""The Redis state: key names (`keys`), Lua scripts (`scripts`), one keyevent
subscriber (`feed`), GPU leases (`leases`, `heartbeat`, `reconcile`, `bulk`) and the
admission queue (`queue`). Needs the `redis` extra: pip install 'llm-health[redis]'."""
