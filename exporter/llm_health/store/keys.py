"""Key names of the Redis data contract (docs/redis-schema.md). Pure: no Redis import,
so configuration can name keys without the `redis` extra installed."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LEASE_PREFIX = "gpu:lease:"
DEFAULT_QUEUE_PREFIX = "llm:admission:"
DEFAULT_RETENTION_MS = 15 * 60 * 1000


@dataclass(frozen=True)
class LeaseKeys:
    """Key names of the lease schema. Only ``lease_prefix`` must match the schedulers
    already running; the others are derived from it unless given."""

    lease_prefix: str = DEFAULT_LEASE_PREFIX
    info_prefix: str | None = None
    fence_prefix: str | None = None
    waiters_prefix: str | None = None

    def __post_init__(self) -> None:
        if not self.lease_prefix:
            raise ValueError("lease_prefix must not be empty")
        if self.lease_prefix.endswith("lease:"):
            ns = self.lease_prefix[: -len("lease:")]
            derived = (ns + "leaseinfo:", ns + "fence:", ns + "waiters:")
        else:
            # "gpulease_" -> "gpuleaseinfo:"; a prefix without a separator at its end
            # ("lease") derives names that start with it and is rejected below.
            base = self.lease_prefix.rstrip(":_-/.")
            derived = (base + "info:", base + "fence:", base + "waiters:")
        for name, value in zip(("info_prefix", "fence_prefix", "waiters_prefix"), derived):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("info_prefix", "fence_prefix", "waiters_prefix"):
            value = getattr(self, name)
            if not value:
                raise ValueError(f"{name} must not be empty")
            if value.startswith(self.lease_prefix):
                raise ValueError(
                    f"{name} {value!r} starts with lease_prefix {self.lease_prefix!r}, so its "
                    f"keys would look like leases; set {name} explicitly "
                    f"(a lease_prefix ending in 'lease:' derives safe ones)"
                )

    def lease(self, gpu: str) -> str:
        return self.lease_prefix + gpu

    def info(self, gpu: str) -> str:
        return f"{self.info_prefix}{gpu}"

    def fence(self, gpu: str) -> str:
        return f"{self.fence_prefix}{gpu}"

    def waiters(self, pool: str) -> str:
        return f"{self.waiters_prefix}{pool}"

    def gpu_of(self, key: str) -> str | None:
        """The GPU id of a lease key, None for any other key."""
        if key.startswith(self.lease_prefix):
            return key[len(self.lease_prefix) :]
        return None


@dataclass(frozen=True)
class QueueKeys:
    prefix: str = DEFAULT_QUEUE_PREFIX

    def record(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def route(self, route: str, what: str) -> str:
        return f"{self.prefix}route:{route}:{what}"

    def routes(self) -> str:
        return f"{self.prefix}routes"

    def route_keys(self, route: str) -> list[str]:
        """enqueued, deadline, retried, live, dup: the order the scripts expect."""
        return [self.route(route, w) for w in ("enqueued", "deadline", "retried", "live", "dup")]

    def tenant(self, tenant: str, minute: int) -> str:
        """Token units a tenant spent in one wall-clock minute."""
        return f"{self.prefix}tenant:{tenant}:{minute}"
