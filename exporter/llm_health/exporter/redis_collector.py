"""Renders the exporter's Redis view (pools and routes) without I/O: the metric families
and the `/status` section.

Emits (labels `pool` and `route` come from configuration, never from keys):

- `llm_redis_up`: 1 if the last refresh read Redis, else 0 (then only the counters
  below are exported besides it);
- `llm_redis_engine_age_publish_failures_total`: rounds whose publication of the engine
  queue ages did not land;
- per pool: `llm_gpu_pool_size`, `llm_gpu_leases_held`, `llm_gpu_free`,
  `llm_gpu_waiters`, `llm_gpu_lease_ttl_min_seconds` and
  `llm_gpu_lease_age_max_seconds` (absent while no lease is held),
  `llm_gpu_lease_releases_total{reason="del"|"expired"}`,
  `llm_gpu_lease_drift{kind="lease_on_idle_backend"|"busy_without_lease"}`;
- per route: `llm_admission_queue_depth`, `llm_admission_queue_age_seconds` (0 when
  empty), `llm_admission_deadline_slack_seconds` (absent when empty),
  `llm_admission_past_deadline`, `llm_admission_retried_requests`,
  `llm_admission_token_duplication_ratio_max` (absent until an id has token units).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..collector_base import SnapshotCollector
from ..core.drift import DRIFT_KINDS
from ..store.feed import RELEASE_REASONS
from ..urls import redact_url
from .redis_view import RedisView, Snapshot

STATUS_LIST_CAP = 50  # GPU ids listed per drift kind in /status


class RedisCollector(SnapshotCollector):
    def __init__(self, view: RedisView):
        self.view = view

    def status(self) -> dict[str, Any]:
        return redis_status(self.view)

    def families(self, describing: bool) -> Iterator[Metric]:
        """Metric families of the last snapshot. No I/O."""
        v = self.view
        up = GaugeMetricFamily("llm_redis_up", "1 if the last refresh read Redis, 0 if it failed.")
        up.add_metric([], 1.0 if v.up else 0.0)
        yield up
        info = GaugeMetricFamily("llm_redis_deployment_info", "The Redis deployment the exporter reads: single, sentinel or cluster.", labels=["deployment"])
        info.add_metric([v.deployment.kind], 1.0)
        yield info
        failovers = CounterMetricFamily(
            "llm_redis_failovers",
            "Primary changes the exporter followed: a Sentinel failover, or a Cluster topology change (failover, slot moves between primaries).",
        )
        failovers.add_metric([], float(v.deployment.failovers_seen))
        yield failovers
        gaps = CounterMetricFamily(
            "llm_redis_keyevent_feed_gaps",
            "Times the keyevent feed was lost (a dead connection, a failover); releases of the gap are counted after it is back.",
        )
        gaps.add_metric([], float(v.gaps))
        yield gaps
        publish = CounterMetricFamily(
            "llm_redis_engine_age_publish_failures",
            "Rounds whose publication of the backends' engine queue ages (the doors' QueueKeys.engine_age keys) did not land, "
            "whole or in part; the keys then expire after 3 rounds and read as unknown.",
        )
        publish.add_metric([], float(v.publish_failures))
        yield publish

        releases = CounterMetricFamily(
            "llm_gpu_lease_releases",
            "GPU leases that ended, by reason: del (released) or expired (TTL ran out: a "
            "holder that crashed or failed to renew). Counted from keyspace events by a "
            "background subscriber; releases missed while it was disconnected are counted "
            "after it reconnects.",
            labels=["pool", "reason"],
        )
        for pool, counts in sorted(v.releases.items()):
            for reason in RELEASE_REASONS:
                releases.add_metric([pool, reason], float(counts[reason]))
        yield releases

        snap = v.snapshot
        if describing:
            snap = Snapshot({}, {}, 0.0)
        elif not v.up or snap is None:
            return

        def gauge(name: str, doc: str, label: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=[label])

        size = gauge("llm_gpu_pool_size", "GPUs in the pool (from configuration or its Redis set).", "pool")
        held = gauge("llm_gpu_leases_held", "GPUs of the pool with a lease key.", "pool")
        free = gauge("llm_gpu_free", "GPUs of the pool without a lease key.", "pool")
        waiters = gauge("llm_gpu_waiters", "Callers waiting for a GPU of the pool (deadline not passed).", "pool")
        ttl_min = gauge("llm_gpu_lease_ttl_min_seconds", "Smallest remaining TTL of the pool's leases; absent when none is held.", "pool")
        age_max = gauge(
            "llm_gpu_lease_age_max_seconds",
            "Age of the pool's oldest lease (claim time from the lease's side hash); absent when none is held or no lease has a claim time.",
            "pool",
        )
        drift = GaugeMetricFamily(
            "llm_gpu_lease_drift",
            "GPUs whose lease disagrees with the engine: lease_on_idle_backend (the same "
            "lease held over two rounds while the backend was idle in both; needs the "
            "previous round), busy_without_lease (backend busy, stalled, hung or unknown "
            "with no lease: a job that never claimed its GPU).",
            labels=["pool", "kind"],
        )
        for name, p in sorted(snap.pools.items()):
            size.add_metric([name], p.size)
            held.add_metric([name], p.held)
            free.add_metric([name], p.size - p.held)
            waiters.add_metric([name], p.waiters)
            if p.ttl_min_ms is not None:
                ttl_min.add_metric([name], p.ttl_min_ms / 1000)
            if p.age_max_ms is not None:
                age_max.add_metric([name], max(p.age_max_ms, 0) / 1000)
            for kind in DRIFT_KINDS:
                drift.add_metric([name, kind], len(p.drift[kind]))
        yield from (size, held, free, waiters, ttl_min, age_max, drift)

        depth = gauge("llm_admission_queue_depth", "Requests waiting on the route.", "route")
        age = gauge("llm_admission_queue_age_seconds", "Age of the oldest waiting request (a resent id keeps its first enqueue time); 0 when empty.", "route")
        slack = gauge(
            "llm_admission_deadline_slack_seconds", "Smallest deadline slack of the waiting requests (negative: past its deadline); absent when empty.", "route"
        )
        past = gauge("llm_admission_past_deadline", "Waiting requests past their deadline.", "route")
        retried = gauge("llm_admission_retried_requests", "Waiting requests with retry_count >= 1.", "route")
        dup = gauge(
            "llm_admission_token_duplication_ratio_max",
            "Largest token units of one request id (all attempts) over the units of one "
            "attempt, over the ids of the retention window; absent until an id has units.",
            "route",
        )
        for route, s in sorted(snap.routes.items()):
            depth.add_metric([route], s.depth)
            age.add_metric([route], max(s.oldest_age_ms or 0, 0) / 1000)
            if s.smallest_slack_ms is not None:
                slack.add_metric([route], s.smallest_slack_ms / 1000)
            past.add_metric([route], s.past_deadline)
            retried.add_metric([route], s.retried)
            if s.token_duplication_ratio_max is not None:
                dup.add_metric([route], s.token_duplication_ratio_max)
        yield from (depth, age, slack, past, retried, dup)


def redis_status(v: RedisView) -> dict[str, Any]:
    """For the JSON /status page. Times in ms: `queue_age_ms`, `deadline_slack_ms`."""
    out: dict[str, Any] = {
        "up": v.up,
        "error": v.error,
        "url": redact_url(v.config.url),
        "refresh_duration_ms": None if v.last_duration_s is None else round(v.last_duration_s * 1000, 3),
        "round_trips": v.round_trips_last,
        "commands": v.commands_last,
        "keyspace_events": {
            "flags": v.keyspace_flags,
            "ok": v.keyspace_fix is None if v.keyspace_flags is not None else None,
            "fix": v.keyspace_fix,
        },
        "subscriber": {
            "connected": v.subscriber.connected,
            "gaps": v.gaps,
            "error": v.sub_error,
            "repaired_releases": dict(v.repaired),
        },
        "pools": {},
        "routes": {},
    }
    snap = v.snapshot
    for pool in v.config.pools:
        entry: dict[str, Any] = {"releases": dict(v.releases.get(pool.name, {}))}
        p = snap.pools.get(pool.name) if snap else None
        if p is not None:
            entry.update(
                size=p.size,
                leases_held=p.held,
                free=p.size - p.held,
                waiters=p.waiters,
                lease_ttl_min_ms=p.ttl_min_ms,
                lease_age_max_ms=p.age_max_ms,
                leases_without_ttl=p.without_ttl,
                drift={kind: {"count": len(gpus), "gpus": gpus[:STATUS_LIST_CAP]} for kind, gpus in p.drift.items()},
            )
        out["pools"][pool.name] = entry
    if snap:
        for route, s in snap.routes.items():
            out["routes"][route] = {
                "queue_depth": s.depth,
                "queue_age_ms": s.oldest_age_ms or 0,
                "deadline_slack_ms": s.smallest_slack_ms,
                "past_deadline": s.past_deadline,
                "retried_requests": s.retried,
                "token_duplication_ratio_max": s.token_duplication_ratio_max,
            }
    out["stale"] = not v.up and snap is not None
    return out
