"""Key names of the Redis data contract (docs/redis-schema.md). Pure: no Redis import,
so configuration can name keys without the `redis` extra installed."""

from __future__ import annotations

from dataclasses import dataclass

from .codes import LeaseArgumentError

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
    # Redis Cluster: each GPU id is a hash tag (`gpu:lease:{gpu0}`), so the three keys of
    # one GPU share a slot and a claim script can touch them together.
    hash_tag: bool = False

    def tagged(self) -> LeaseKeys:
        """The Cluster layout of these keys (docs/redis-schema.md)."""
        return LeaseKeys(self.lease_prefix, self.info_prefix, self.fence_prefix, self.waiters_prefix, hash_tag=True)

    def _id(self, name: str) -> str:
        return "{" + name + "}" if self.hash_tag else name

    def __post_init__(self) -> None:
        if not self.lease_prefix:
            raise LeaseArgumentError("lease_prefix must not be empty")
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
                raise LeaseArgumentError(f"{name} must not be empty")
            if value.startswith(self.lease_prefix):
                raise LeaseArgumentError(
                    f"{name} {value!r} starts with lease_prefix {self.lease_prefix!r}, so its "
                    f"keys would look like leases; set {name} explicitly "
                    f"(a lease_prefix ending in 'lease:' derives safe ones)"
                )

    def lease(self, gpu: str) -> str:
        return self.lease_prefix + self._id(gpu)

    def info(self, gpu: str) -> str:
        return f"{self.info_prefix}{self._id(gpu)}"

    def fence(self, gpu: str) -> str:
        return f"{self.fence_prefix}{self._id(gpu)}"

    def waiters(self, pool: str) -> str:
        return f"{self.waiters_prefix}{self._id(pool)}"

    def gpu_of(self, key: str) -> str | None:
        """The GPU id of a lease key, None for any other key."""
        if not key.startswith(self.lease_prefix):
            return None
        rest = key[len(self.lease_prefix) :]
        if self.hash_tag:
            return rest[1:-1] if len(rest) > 2 and rest[0] == "{" and rest[-1] == "}" else None
        return rest


@dataclass(frozen=True)
class QueueKeys:
    prefix: str = DEFAULT_QUEUE_PREFIX

    def tagged(self) -> QueueKeys:
        """The Cluster layout: the whole queue in one hash tag (its scripts touch a
        request's record and its route's sets together, and a record is found by id
        alone), `{llm:admission}:...`. A prefix that already has a tag is kept."""
        if "{" in self.prefix and "}" in self.prefix.split("{", 1)[1]:
            return self
        base = self.prefix.rstrip(":")
        return QueueKeys("{" + base + "}" + self.prefix[len(base) :])

    def record(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def route(self, route: str, what: str) -> str:
        return f"{self.prefix}route:{route}:{what}"

    def routes(self) -> str:
        return f"{self.prefix}routes"

    def route_keys(self, route: str) -> list[str]:
        """enqueued, deadline, retried, live, dup: the order the scripts expect."""
        return [self.route(route, w) for w in ("enqueued", "deadline", "retried", "live", "dup")]

    def engine_age(self, backend: str) -> str:
        """The age of the oldest request waiting inside one backend's engine, in ms (a
        decimal integer), written by the exporter every round with an expiry of a few
        rounds and deleted while unknown: absent means unknown, never 0. The doors read it
        in their one round trip for the routes that name the backend (`backends:`)."""
        return f"{self.prefix}engine:{backend}:queue_age_ms"

    def engine_waiting(self, backend: str) -> str:
        """One backend's engine waiting and running counts, when the exporter read them and
        what it runs when full, `"W R READ_MS S"` (Unix ms; S the most sequences it ran at
        once, 0 until a read has found it full since it started; absent from an older
        exporter, read as R), beside `engine_age` with the same expiry: a door reads the
        age from the requests it sent and has not seen end (`route_inflight`) with these
        counts (`core.queue_age.door_age`), which stays true when clients give up."""
        return f"{self.prefix}engine:{backend}:waiting"

    def route_inflight(self, route: str) -> tuple[str, str, str]:
        """The requests a door sent on for `route` and has not seen end, scored by when they
        were sent (Unix ms); the same scored by when they leave unheard, their deadline
        plus their own budget, a minute at most (`core.queue_age.keep_until`): added by the
        decision script, removed by the attempt's end (an answer, an error, the client
        giving up) or a refusal, and at that score at the latest; and the attempts that
        ended, scored by when (kept two minutes), one whose client gave up (or that stayed
        in flight unheard until then) a minute later: the engine holds such a request until it notices, which for
        a waiting request may be only when it would have run it."""
        return self.route(route, "inflight"), self.route(route, "inflight_ends"), self.route(route, "ended")

    def retry_match(self, digest: str) -> str:
        """The first copies of requests sent without an id with this retry fingerprint
        (`gate.headers.retry_fingerprint`): a sorted set of their queue ids scored by
        arrival (Unix ms), kept until the last one's deadline plus the route's
        `retry_match_window_ms`. A retry without an id is matched in the decision script
        to the oldest one that has not had a retry at its count (scripts.DECIDE_LUA)."""
        return f"{self.prefix}fp:{digest}"

    def tenant(self, tenant: str, minute: int) -> str:
        """Token units a tenant spent in one wall-clock minute."""
        return f"{self.prefix}tenant:{tenant}:{minute}"
