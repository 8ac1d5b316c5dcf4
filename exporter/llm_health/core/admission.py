"""The age-first admission policy: age first, deadline second, utilisation last.

Pure: a function from what is known about one request and its route to a decision with a
reason. The gate (`llm_health.gate`) gathers the inputs and acts on the decision.

* `queue_age_ms`: age of the oldest request still queued on the route, at the admission
  edge. A new request can expect to wait about as long.
* `deadline_slack_ms`: time this request has left before its deadline (negative: late).
* `retry_count`: attempts of the same request id before this one.

Decisions, in order:

1. `reject_retry_late`: a retry (`retry_count >= reject_if_retry_count_gte`) whose slack is
   `<= ignore_worker_util_when_slack_ms_lte`: it is already late; another copy only
   multiplies the work. First, so that a late retry on a closed route is told it is late
   (not to come back in 30 s).
2. `reject_route_closed`: an operator set the route to `reject_all` (the rollback step).
3. `reject_age_beats_slack`: the queue's age, plus the route's `expected_service_ms` (how
   long a request takes once it runs while the engine is full; default 0), is at least the
   request's slack (it cannot be served in time) or, where no wait is projected, the age
   is at least `reject_if_queue_age_ms_gte`. A request admitted with less time left than
   its own service wastes the engine's work on an answer that comes too late.
4. `reject_wait_beats_slack`: the wait projected for this request (`wait_ms`: the requests
   ahead of it, each taking `expected_service_ms` on one of the engine's running
   sequences; core.queue_age.door_wait; projected only with `expected_service_ms` set),
   plus its service, is at least its slack, or the wait is at least
   `reject_if_queue_age_ms_gte` (the age it would reach). The head's age lags a burst
   sent since the engine's last read, and stays over the cap after the queue behind it
   has shortened; the wait does neither, so a door at many times the engine's capacity
   keeps a queue as short as the cap, and the engine busy, instead of admitting a round's
   arrivals at once and then refusing everything until the queue has drained.
5. `reject_tenant_budget`: the tenant has spent its token-unit budget for the window.
6. otherwise `admit_once`.

Worker utilisation never admits what age rejects: spare capacity cannot create time. The
last upstream status (429: the worker protecting itself; 503: the route unsafe for more
copies) is recorded beside the retry count and lifts nothing.

A refusal that asks the client to come back (`Retry-After`) never sends it past its own
deadline: when the wait it names is at least the request's slack, the refusal becomes
non-retryable (`late_status`, no `Retry-After`; `bounded`). The OpenAI SDK waits exactly a
`Retry-After` of up to 120 s and retries every 5xx and 429, so a 503 with `Retry-After: 30`
to a request with 3 s left would bring it back 27 s late.

More decisions belong to the gate, not to this function, when a figure the policy needs
cannot be read: `admit_unrecorded` (Redis unreachable, the route fails open; the request's
own deadline and retry count are still judged), `reject_redis_down` (it fails closed) and
`reject_queue_age_unknown` (no backend of the route has a known engine queue age and the
route fails closed; `unknown_age`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

ADMIT = "admit_once"
ADMIT_UNRECORDED = "admit_unrecorded"
REJECT_REDIS_DOWN = "reject_redis_down"
REJECT_AGE_UNKNOWN = "reject_queue_age_unknown"
DECISIONS = (
    ADMIT,
    "reject_retry_late",
    "reject_age_beats_slack",
    "reject_wait_beats_slack",
    "reject_route_closed",
    "reject_tenant_budget",
    ADMIT_UNRECORDED,
    REJECT_REDIS_DOWN,
    REJECT_AGE_UNKNOWN,
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
    # No backend of the route has a known engine queue age: open (decide on the route's
    # own Redis queue) or closed (503 reject_queue_age_unknown); None: as redis_down.
    engine_age_unknown: str | None = None
    # How long after its deadline a request's first copy can still be recognised by its
    # retries when the client sends no id (the retry fingerprint's life): the OpenAI SDK
    # honours a Retry-After of up to 120 s.
    retry_match_window_ms: float = 120_000.0
    # How long a request takes once it runs (its prefill and decode), added to the queue's
    # age before it is weighed against the slack: a request that would start in time but
    # finish late is refused before the engine works on it. 0: age against slack alone.
    expected_service_ms: float = 0.0

    @property
    def unknown_age_mode(self) -> str:
        return self.engine_age_unknown or self.redis_down


@dataclass(frozen=True)
class Request:
    queue_age_ms: float
    deadline_slack_ms: float
    retry_count: int = 0
    worker_util: float | None = None
    last_upstream_status: int | None = None
    tenant_budget_left: float | None = None  # token units; None: no budget set
    wait_ms: float | None = None  # the wait projected for this request (core.queue_age.door_wait); None: none


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


def bounded(decision: Decision, slack_ms: float, policy: Policy) -> Decision:
    """A refusal whose `Retry-After` (whole seconds, as sent) would bring the client back at
    or after its deadline becomes non-retryable: `late_status`, no `Retry-After`."""
    if decision.admitted or decision.retry_after_s is None:
        return decision
    wait_s = retry_after_header(decision.retry_after_s)
    if wait_s * 1000 < slack_ms:
        return decision
    return replace(
        decision,
        reason=f"{decision.reason}; a retry in {wait_s} s would come after the deadline (slack {slack_ms:.0f} ms): not retryable",
        status=policy.late_status,
        retry_after_s=None,
        retryable=False,
    )


def retry_after_header(seconds: float) -> int:
    """The `Retry-After` value sent for a wait: whole seconds, rounded up, at least 1."""
    return max(1, math.ceil(seconds))


def unknown_age(slack_ms: float, policy: Policy) -> Decision:
    """The route fails closed while no backend's engine queue age is known."""
    d = Decision(REJECT_AGE_UNKNOWN, "engine queue age unknown for every backend of the route; route fails closed", 503, retry_after_s=5.0, retryable=True)
    return bounded(d, slack_ms, policy)


def decide(req: Request, policy: Policy) -> Decision:
    return bounded(_decide(req, policy), req.deadline_slack_ms, policy)


def _decide(req: Request, policy: Policy) -> Decision:
    util = f"; worker util {req.worker_util:.2f} ignored: age first" if req.worker_util is not None else ""
    upstream = f"; last upstream {req.last_upstream_status}" if req.last_upstream_status else ""
    slack, age = req.deadline_slack_ms, req.queue_age_ms
    service = policy.expected_service_ms
    if req.retry_count >= policy.reject_if_retry_count_gte and slack <= policy.ignore_worker_util_when_slack_ms_lte:
        return Decision(
            "reject_retry_late",
            f"retry {req.retry_count} with deadline slack {slack:.0f} ms <= {policy.ignore_worker_util_when_slack_ms_lte:g} ms{upstream}{util}",
            policy.late_status,
        )
    if policy.mode == "reject_all":
        return Decision("reject_route_closed", "route set to reject_all by an operator", 503, retry_after_s=30.0, retryable=True)
    wait = req.wait_ms
    # With a projected wait, the cap is judged on it: the head's age lags the queue by the
    # head's own wait, and stays over the cap after the queue behind it has shortened.
    tail = f"{upstream}{util}"
    if age + service >= slack or (wait is None and age >= policy.reject_if_queue_age_ms_gte):
        plus = f" + expected service {service:g} ms" if service else ""
        return _beats("reject_age_beats_slack", f"queue age {age:.0f} ms", plus, age, slack, policy, tail)
    if wait is not None and (wait + service >= slack or wait >= policy.reject_if_queue_age_ms_gte):
        return _beats("reject_wait_beats_slack", f"projected wait {wait:.0f} ms", f" + expected service {service:g} ms", wait, slack, policy, tail)
    if req.tenant_budget_left is not None and req.tenant_budget_left <= 0:
        return Decision("reject_tenant_budget", "tenant token-unit budget spent for this window", 429, retry_after_s=60.0, retryable=True)
    plus = f" + expected service {service:g} ms" if service else ""
    return Decision(ADMIT, f"queue age {age:.0f} ms{plus} < deadline slack {slack:.0f} ms{upstream}", 200)


def _beats(name: str, what: str, plus: str, ms: float, slack: float, policy: Policy, tail: str) -> Decision:
    """A refusal because ``ms`` (the queue's age, or the projected wait; ``what`` names it)
    and the service beat the slack, or ``ms`` reached the cap: still worth a retry later
    (503, `Retry-After`) only if the request itself has time left, else the late status."""
    service = policy.expected_service_ms
    why = f"{what}{plus} >= deadline slack {slack:.0f} ms" if ms + service >= slack else f"{what} >= {policy.reject_if_queue_age_ms_gte:g} ms"
    retryable = slack > ms + service
    return Decision(
        name,
        f"{why}{tail}",
        503 if retryable else policy.late_status,
        retry_after_s=max(1.0, (slack - ms - service) / 2000.0) if retryable else None,
        retryable=retryable,
    )


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
