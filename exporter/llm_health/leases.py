"""GPU leases in Redis, the library other programs import: one lease per GPU (`SET NX` with
a TTL, a fencing token), renewed by a heartbeat, released by its holder, expired by Redis
when the holder dies; waiters woken by the keyevents of a lease that vanished, never by
polling; a reconcile pass against what the workers report. One server, Sentinel or
Cluster, from the URL.

```python
from llm_health.leases import LeaseClient, LeaseError, Pool

leases = LeaseClient.from_url("redis://127.0.0.1:6379/0")
lease = await leases.wait_for_gpu(Pool("a100", ["gpu0", "gpu1"]), "worker-7", timeout=60)  # None: none freed in time
```

Everything a caller needs is here; the modules behind it (`llm_health.store`) may move.
Every error the library raises on its own derives from `LeaseError`: a bad argument
(`LeaseArgumentError`, a ValueError too) or Redis URL (`LeaseTargetError`) included.
"""

from __future__ import annotations

from .store.codes import LeaseArgumentError
from .store.errors import NotReplicated
from .store.heartbeat import Heartbeat
from .store.leases import LeaseClient, LeaseTargetError
from .store.records import KeyspaceEventsOff, Lease, LeaseError, LeaseLost, LeaseState, Pool, ReconcileReport

__all__ = [
    "Heartbeat",
    "KeyspaceEventsOff",
    "Lease",
    "LeaseArgumentError",
    "LeaseClient",
    "LeaseError",
    "LeaseLost",
    "LeaseState",
    "LeaseTargetError",
    "NotReplicated",
    "Pool",
    "ReconcileReport",
]
