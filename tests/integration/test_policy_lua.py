"""The one decision: the age-first policy every door runs inside its decision script
(`store.policy.POLICY_LUA`, in `store.scripts.DECIDE_LUA`) agrees with the Python
reference (`core.admission`) on every input hypothesis generates: the decision, its reason
word for word, the status, the Retry-After wait and whether it may be retried. Run on a
real redis-server's Lua (EVAL), as every door runs it; with the route's backends' queue
age unknown too (the `engine_age_unknown` step, open and closed).
"""

from __future__ import annotations

import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_health.core import admission
from llm_health.store.policy import POLICY_LUA, Verdict, policy_args
from tests.fixtures.redis_server import RedisServer

# POLICY_LUA's functions on ARGV: the settings (policy_args), then age, slack, retries,
# worker util, last upstream status, tenant budget left, projected wait ('' none), and '1'
# where the backends' queue age is unknown.
HARNESS = (
    POLICY_LUA
    + """
local P = read_policy(ARGV, 1)
local function num(s) if s == '' then return nil end return tonumber(s) end
local name, reason, status, after, retryable = policy(P, tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]), num(ARGV[11]), num(ARGV[12]),
                                                      num(ARGV[13]), num(ARGV[14]))
if ARGV[15] == '1' then name, reason, status, after, retryable = unknown_age(P, name, reason, status, after, retryable, tonumber(ARGV[9])) end
return verdict(name, reason, status, after, retryable)
"""
)

ms = st.floats(min_value=-1e6, max_value=1e7, allow_nan=False, allow_infinity=False)
some = st.one_of(st.integers(min_value=-100_000, max_value=10_000_000).map(float), ms)  # whole milliseconds, as doors send, and any
policies = st.builds(
    admission.Policy,
    reject_if_queue_age_ms_gte=st.one_of(st.sampled_from([0.0, 3000.0, 30000.0]), st.floats(min_value=0, max_value=1e6)),
    reject_if_retry_count_gte=st.integers(min_value=0, max_value=3),
    ignore_worker_util_when_slack_ms_lte=st.one_of(st.sampled_from([0.0, 500.0]), st.floats(min_value=-5000, max_value=5000)),
    mode=st.sampled_from(admission.MODES),
    late_status=st.sampled_from([422, 408, 410, 504]),
    engine_age_unknown=st.sampled_from(["open", "closed", None]),
    expected_service_ms=st.one_of(st.sampled_from([0.0, 255.0]), st.floats(min_value=0, max_value=5000)),
)
requests = st.builds(
    admission.Request,
    queue_age_ms=st.one_of(st.integers(min_value=0, max_value=200_000).map(float), st.floats(min_value=0, max_value=1e7)),
    deadline_slack_ms=some,
    retry_count=st.integers(min_value=0, max_value=5),
    worker_util=st.one_of(st.none(), st.floats(min_value=0, max_value=1)),
    last_upstream_status=st.sampled_from([None, 200, 408, 429, 499, 503, 529]),
    tenant_budget_left=st.one_of(st.none(), st.floats(min_value=-100, max_value=100)),
    wait_ms=st.one_of(st.none(), st.integers(min_value=0, max_value=100_000).map(float), st.floats(min_value=0, max_value=1e7)),
)


def reference(req: admission.Request, policy: admission.Policy, unknown: bool) -> admission.Decision:
    """What the Python doors decided before the script did (gate.decision, the route with
    backends whose queue age is unknown included)."""
    d = admission.decide(req, policy)
    if unknown:
        if policy.unknown_age_mode == "closed":
            return admission.unknown_age(req.deadline_slack_ms, policy) if d.admitted else d
        return admission.Decision(
            d.decision, f"{d.reason}; engine queue age unknown, failing open on the route's own queue", d.status, d.retry_after_s, d.retryable
        )
    return d


def opt(x: float | int | None) -> str:
    return "" if x is None else repr(x)


def run(client: redis.Redis, req: admission.Request, p: admission.Policy, unknown: bool) -> Verdict:
    args = policy_args(p)
    args += [repr(req.queue_age_ms), repr(req.deadline_slack_ms), str(req.retry_count)]
    args += [opt(req.worker_util), opt(req.last_upstream_status), opt(req.tenant_budget_left), opt(req.wait_ms), "1" if unknown else "0"]
    return Verdict.read(client.eval(HARNESS, 0, *args))


def same(got: Verdict, want: admission.Decision) -> None:
    assert (got.decision, got.reason, got.status, got.retry_after_s, got.retryable) == (
        want.decision,
        want.reason,
        want.status,
        want.retry_after_s,
        want.retryable,
    )


@settings(max_examples=1500, deadline=None)
@given(req=requests, policy=policies, unknown=st.booleans())
def test_the_script_decides_as_the_reference_on_every_input(redis_server: RedisServer, req: admission.Request, policy: admission.Policy, unknown: bool):
    client = redis.Redis.from_url(redis_server.url)  # the session's server: the script reads and writes no key
    try:
        same(run(client, req, policy, unknown), reference(req, policy, unknown))
    finally:
        client.close()


def test_every_decision_the_script_can_reach_is_reached(redis_url: str):
    """The generated inputs cover each decision (a policy that never reaches one would
    agree on it vacuously): one hand-made case per decision, through the script."""
    client = redis.Redis.from_url(redis_url)
    base = admission.Policy(default_deadline_ms=3000, expected_service_ms=250.0)
    cases = {
        "admit_once": (admission.Request(100, 3000), base, False),
        "reject_retry_late": (admission.Request(0, -5, retry_count=1, last_upstream_status=503), base, False),
        "reject_route_closed": (admission.Request(0, 3000), admission.Policy(mode="reject_all"), False),
        "reject_age_beats_slack": (admission.Request(2900, 3000), base, False),
        "reject_wait_beats_slack": (admission.Request(0, 3000, wait_ms=2800), base, False),
        "reject_tenant_budget": (admission.Request(0, 3000, tenant_budget_left=0), base, False),
        "reject_queue_age_unknown": (admission.Request(0, 30000), admission.Policy(engine_age_unknown="closed"), True),
    }
    try:
        for name, (req, policy, unknown) in cases.items():
            got = run(client, req, policy, unknown)
            assert got.decision == name, (name, got)
            same(got, reference(req, policy, unknown))
    finally:
        client.close()
