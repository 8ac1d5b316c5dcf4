"""The one door to Redis: one server, Sentinel or Cluster, behind one interface.

Every Redis user of the package (lease client and heartbeat, waiters, the queue and the
gate, the exporter's view, the restarter's shared state) gets its client here, from the
URL alone (`store.target`): :func:`connect` picks the kind's class by the URL's scheme,

```
redis://  rediss://  unix://             SingleDeployment    (store.deployment_single)
redis+sentinel://  rediss+sentinel://    SentinelDeployment  (store.deployment_sentinel)
redis+cluster://  rediss+cluster://      ClusterDeployment   (store.deployment_cluster)
```

and each answers the `Deployment` interface (store.deployment_base) in its own way, the
three things that differ between deployments among them:

- `client`: the redis-py client for ordinary commands and pipelines (`Redis`, a
  Sentinel-managed `Redis` that follows the primary, or `RedisCluster` that follows
  slot moves);
- `run_confirmed(key, commands)`: commands sent on ONE connection to the primary that
  owns `key`, followed there by `WAIT` when the deployment has replicas to wait for: a
  write counts only once a replica has it (`NotReplicated` otherwise, with the replies,
  so the caller can undo it). On Cluster this follows `MOVED`, `ASK` (with `ASKING` on
  the same connection), `TRYAGAIN` and failovers itself; a script's `NOSCRIPT` (a
  primary that lost its script cache in a failover) is answered by sending the body;
- `keyevent_subscriber(...)`: the `del`/`expired` keyevent feed, which is node-local:
  one subscription on one server; on Sentinel one that leaves a server that is no longer
  the primary; on Cluster one per primary, following topology changes.

The kind is asked here, once, when the Deployment is made, and in no method.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.cluster import RedisCluster

from .deployment_base import Deployment, Dialing
from .deployment_cluster import ClusterDeployment
from .deployment_sentinel import SentinelDeployment
from .deployment_single import SingleDeployment
from .errors import NotReplicated
from .target import RedisTarget, TargetError, parse_target, redacted

__all__ = ["BY_SCHEME", "KINDS", "Deployment", "NotReplicated", "connect", "deployment_class", "wrap"]

KINDS: tuple[type[Deployment], ...] = (SingleDeployment, SentinelDeployment, ClusterDeployment)
BY_SCHEME: dict[str, type[Deployment]] = {scheme: kind for kind in KINDS for scheme in kind.schemes}


def deployment_class(url: str) -> type[Deployment]:
    """The Deployment class of ``url``'s scheme; TargetError (never repeating a password) if none."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    found = BY_SCHEME.get(scheme)
    if found is None:
        raise TargetError(f"{redacted(url)!r} is no Redis URL: it must start with one of {', '.join(s + '://' for s in BY_SCHEME)}")
    return found


def connect(
    url: str | RedisTarget,
    *,
    socket_timeout: float = 5.0,
    retries: int = 3,
    max_connections: int | None = None,
    blocking_timeout: float | None = None,
) -> Deployment:
    """A Deployment for ``url`` (any of the forms of `store.target`). Commands time out
    after ``socket_timeout``; a broken connection is retried ``retries`` times (every
    write of the package is idempotent, so a retry after a lost reply is safe).
    ``max_connections`` with ``blocking_timeout`` (one server only, the gate's bound):
    a caller waits that long for a free connection instead of opening more."""
    kind = deployment_class(url.url if isinstance(url, RedisTarget) else url)
    target = url if isinstance(url, RedisTarget) else parse_target(url)
    return kind.open(target, Dialing(socket_timeout, retries, max_connections, blocking_timeout))


def wrap(client: Any) -> Deployment:
    """A Deployment around a redis-py client made elsewhere: a ``Redis`` (one server, or
    a Sentinel ``master_for`` client: no WAIT unless given a Deployment) or a
    ``RedisCluster`` (the Cluster layout and routing, WAIT for one replica)."""
    if isinstance(client, RedisCluster):
        return ClusterDeployment.around(client)
    return SingleDeployment.around(client)
