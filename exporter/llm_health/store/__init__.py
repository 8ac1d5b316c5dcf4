"""The Redis state: key names (`keys`), Lua scripts (the admission queue's in `scripts`, the policy's
in `policy`, the leases' in `lease_scripts`), one keyevent subscriber (`feed`), GPU leases (`leases`, `heartbeat`, `bulk`)
and the admission queue (`queue`). Needs the `redis` extra: pip install 'llm-health[redis]'."""
