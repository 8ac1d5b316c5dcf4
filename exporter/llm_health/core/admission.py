"""The age-first admission policy: age first, deadline second, utilisation last.

Pure: a function from what is known about one request and its route to a decision with a
reason. The gate (`llm_health.gate`) gathers the inputs and acts on the decision.

* `queue_age_ms`: age of the oldest request still queued on the route, at the admission
  edge. A new request can expect to wait about as long.
* `deadline_slack_ms`: time this request has left before its deadline (negative: late).
* `retry_count`: attempts of the same request id before this one.

Decisions, in order:

1. `reject_route_closed`: an operator set the route to `reject_all` (the rollback step).
2. `reject_retry_late`: a retry (`retry_count >= reject_if_retry_count_gte`) whose slack is
   `<= ignore_worker_util_when_slack_ms_lte`: it is already late; another copy only
   multiplies the work.
3. `reject_age_beats_slack`: the queue's age is at least the request's slack (it cannot be
   served in time) or at least `reject_if_queue_age_ms_gte`.
4. `reject_tenant_budget`: the tenant has spent its token-unit budget for the window.
5. otherwise `admit_once`.

Worker utilisation never admits what age rejects: spare capacity cannot create time. The
last upstream status (429: the worker protecting itself; 503: the route unsafe for more
copies) is recorded beside the retry count and lifts nothing.

Two more decisions belong to the gate, not to this function, when Redis cannot be reached
(the queue age is then unknown): `admit_unrecorded` (the route fails open; the request's
own deadline and retry count are still judged) and `reject_redis_down` (it fails closed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ADMIT = "admit_once"
ADMIT_UNRECORDED = "admit_unrecorded"
REJECT_REDIS_DOWN = "reject_redis_down"
DECISIONS = (
    ADMIT,
    "reject_retry_late",
    "reject_age_beats_slack",
    "reject_route_closed",
    "reject_tenant_budget",
    ADMIT_UNRECORDED,
    REJECT_REDIS_DOWN,
)
MODES = ("open", "reject_all")
REDIS_DOWN_MODES = ("open", "closed")


@dataclass(frozen=True)
class Policy:
    """The policy's configuration block (the `admission:` keys, under these names), plus
    per-route extras."""

    reject_if_queue_age_ms_gte: float = 3000.0
    reject_if_retry_count_gte: int = 1
    ignore_worker_util_when_slack_ms_lte: float = 0.0
    mode: str = "open"
    default_deadline_ms: float | None = None  # None: a request without a deadline gets 400
    late_status: int = 422  # not retried by common clients (the OpenAI SDK retries 408, 409, 429, 5xx)
    redis_down: str = "open"  # fail open or closed when Redis cannot be reached


@dataclass(frozen=True)
class Request:
    queue_age_ms: float
    deadline_slack_ms: float
    retry_count: int = 0
    worker_util: float | None = None
    last_upstream_status: int | None = None
    tenant_budget_left: float | None = None  # token units; None: no budget set


@dataclass(frozen=True)
class Decision:
    decision: str
    reason: str
    status: int  # HTTP status the gate answers with (200: forward)
    retry_after_s: float | None = None
    retryable: bool = False

    @property
    def admitted(self) -> bool:
        return self.decision in (ADMIT, ADMIT_UNRECORDED)


def decide(req: Request, policy: Policy) -> Decision:
    util = f"; worker util {req.worker_util:.2f} ignored: age first" if req.worker_util is not None else ""
    upstream = f"; last upstream {req.last_upstream_status}" if req.last_upstream_status else ""
    if policy.mode == "reject_all":
        return Decision("reject_route_closed", "route set to reject_all by an operator", 503, retry_after_s=30.0, retryable=True)
    slack, age = req.deadline_slack_ms, req.queue_age_ms
    if req.retry_count >= policy.reject_if_retry_count_gte and slack <= policy.ignore_worker_util_when_slack_ms_lte:
        return Decision(
            "reject_retry_late",
            f"retry {req.retry_count} with deadline slack {slack:.0f} ms <= {policy.ignore_worker_util_when_slack_ms_lte:g} ms{upstream}{util}",
            policy.late_status,
        )
    if age >= slack or age >= policy.reject_if_queue_age_ms_gte:
        why = (
            f"queue age {age:.0f} ms >= deadline slack {slack:.0f} ms"
            if age >= slack
            else f"queue age {age:.0f} ms >= {policy.reject_if_queue_age_ms_gte:g} ms"
        )
        # Still worth a retry later only if the request itself has time left.
        retryable = slack > age
        return Decision(
            "reject_age_beats_slack",
            f"{why}{upstream}{util}",
            503 if retryable else policy.late_status,
            retry_after_s=max(1.0, (slack - age) / 2000.0) if retryable else None,
            retryable=retryable,
        )
    if req.tenant_budget_left is not None and req.tenant_budget_left <= 0:
        return Decision("reject_tenant_budget", "tenant token-unit budget spent for this window", 429, retry_after_s=60.0, retryable=True)
    return Decision(ADMIT, f"queue age {age:.0f} ms < deadline slack {slack:.0f} ms{upstream}", 200)


@dataclass
class ReopenGuard:
    """The rollback's last step: reopen a closed route only when queue age stayed under the
    deadline for two sampling intervals in a row."""

    intervals_needed: int = 2
    good: int = 0
    history: list[bool] = field(default_factory=list)

    def observe(self, queue_age_ms: float, deadline_ms: float) -> bool:
        ok = queue_age_ms < deadline_ms
        self.good = self.good + 1 if ok else 0
        self.history.append(ok)
        return self.good >= self.intervals_needed
