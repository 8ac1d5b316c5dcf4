"""The Redis state: key names (`keys`), Lua scripts (`scripts`, the admission policy's in
`policy`), one keyevent subscriber (`feed`), GPU leases (`leases`, `heartbeat`, `bulk`)
and the admission queue (`queue`). Needs the `redis` extra: pip install 'llm-health[redis]'."""
