"""The age-first policy as a table: the reference decisions and more."""

from __future__ import annotations

import pytest

from llm_health.config.errors import ConfigError
from llm_health.config.fields import Section
from llm_health.config.gate import read_policy
from llm_health.core.admission import Policy, ReopenGuard, Request, decide, retry_after_header, unknown_age

REFERENCE = Policy(reject_if_queue_age_ms_gte=3000, reject_if_retry_count_gte=1, ignore_worker_util_when_slack_ms_lte=0)


@pytest.mark.parametrize(
    "req,decision,status",
    [
        # the reference decisions
        (Request(queue_age_ms=100, deadline_slack_ms=2900), "admit_once", 200),
        (Request(queue_age_ms=4001, deadline_slack_ms=-1001, retry_count=1), "reject_retry_late", 422),
        (Request(queue_age_ms=3500, deadline_slack_ms=2000), "reject_age_beats_slack", 422),
        # the 02:14 page: queue age 47 s against a 30 s deadline, CPU at 12%
        (Request(queue_age_ms=47000, deadline_slack_ms=30000, worker_util=0.12), "reject_age_beats_slack", 422),
        # low utilisation never overrides age
        (Request(queue_age_ms=2000, deadline_slack_ms=1500, worker_util=0.01), "reject_age_beats_slack", 422),
        # 429 and 503 lift nothing
        (Request(queue_age_ms=10, deadline_slack_ms=-1, retry_count=1, last_upstream_status=503), "reject_retry_late", 422),
        (Request(queue_age_ms=10, deadline_slack_ms=-1, retry_count=1, last_upstream_status=429), "reject_retry_late", 422),
        # a retry with slack left is admitted once
        (Request(queue_age_ms=100, deadline_slack_ms=2000, retry_count=1, last_upstream_status=503), "admit_once", 200),
        # a first attempt already late is rejected by age, not admitted
        (Request(queue_age_ms=0, deadline_slack_ms=0), "reject_age_beats_slack", 422),
        (Request(queue_age_ms=0, deadline_slack_ms=90000, tenant_budget_left=0), "reject_tenant_budget", 429),
        # ... but its Retry-After (60 s) would bring a request with 5 s left back late: not retryable
        (Request(queue_age_ms=0, deadline_slack_ms=5000, tenant_budget_left=0), "reject_tenant_budget", 422),
        (Request(queue_age_ms=0, deadline_slack_ms=5000, tenant_budget_left=10), "admit_once", 200),
    ],
)
def test_decision_table(req, decision, status):
    d = decide(req, REFERENCE)
    assert (d.decision, d.status) == (decision, status)
    if d.decision != "admit_once":
        assert d.reason


def test_age_beats_slack_is_retryable_only_with_time_left():
    d = decide(Request(queue_age_ms=3200, deadline_slack_ms=20000), REFERENCE)  # over the absolute cap, slack left
    assert (d.decision, d.status, d.retryable) == ("reject_age_beats_slack", 503, True)
    assert d.retry_after_s >= 1


def test_route_closed_first():
    d = decide(Request(queue_age_ms=0, deadline_slack_ms=90000), Policy(mode="reject_all"))
    assert (d.decision, d.status, d.retryable, d.retry_after_s) == ("reject_route_closed", 503, True, 30.0)


@pytest.mark.parametrize(
    "req,policy,decision",
    [
        # the retry drill's request with 3 s left: Retry-After 30 / 60 would land 27 / 57 s late
        (Request(queue_age_ms=0, deadline_slack_ms=3000), Policy(mode="reject_all"), "reject_route_closed"),
        (Request(queue_age_ms=0, deadline_slack_ms=3000, tenant_budget_left=0), REFERENCE, "reject_tenant_budget"),
        # exactly at the deadline is too late too
        (Request(queue_age_ms=0, deadline_slack_ms=30000), Policy(mode="reject_all"), "reject_route_closed"),
        # age beats slack with 1.2 s left, 0.5 s of age: the smallest Retry-After (1 s) is still in time...
        # ... but with 0.9 s left it is not
        (Request(queue_age_ms=3500, deadline_slack_ms=900), Policy(reject_if_queue_age_ms_gte=3000), "reject_age_beats_slack"),
    ],
)
def test_a_retry_after_never_sends_the_client_past_its_deadline(req, policy, decision):
    d = decide(req, policy)
    assert (d.decision, d.status, d.retryable, d.retry_after_s) == (decision, policy.late_status, False, None)
    assert "after the deadline" in d.reason or d.decision == "reject_age_beats_slack"


def test_a_retry_after_in_time_is_kept_whole_seconds_rounded_up():
    d = decide(Request(queue_age_ms=3500, deadline_slack_ms=6001), Policy(reject_if_queue_age_ms_gte=3000))
    assert (d.status, d.retryable) == (503, True)
    assert retry_after_header(d.retry_after_s) * 1000 < 6001


def test_a_late_retry_on_a_closed_route_is_told_it_is_late():
    d = decide(Request(queue_age_ms=0, deadline_slack_ms=-27000, retry_count=1), Policy(mode="reject_all"))
    assert (d.decision, d.status, d.retryable) == ("reject_retry_late", 422, False)


def test_unknown_engine_age_fails_closed_within_the_deadline_rule():
    assert (unknown_age(60000, REFERENCE).status, unknown_age(60000, REFERENCE).retryable) == (503, True)
    late = unknown_age(3000, REFERENCE)
    assert (late.decision, late.status, late.retryable) == ("reject_queue_age_unknown", 422, False)


def parse_policy(section: dict, path: str = "admission", base: Policy | None = None) -> Policy:
    s = Section(section, "f.yml", path)
    policy = read_policy(s, base or Policy())
    s.done()
    return policy


def test_reads_the_policy_block_as_written():
    p = parse_policy({"reject_if_queue_age_ms_gte": 3000, "reject_if_retry_count_gte": 1, "ignore_worker_util_when_slack_ms_lte": 0})
    assert p == REFERENCE
    route = parse_policy({"reject_if_queue_age_ms_gte": 500, "mode": "reject_all"}, "gate.routes.chat", p)
    assert (route.reject_if_queue_age_ms_gte, route.mode, route.reject_if_retry_count_gte) == (500, "reject_all", 1)


@pytest.mark.parametrize(
    "section,key",
    [
        ({"reject_if_retry_count_gte": -1}, "admission.reject_if_retry_count_gte"),
        ({"mode": "shut"}, "admission.mode"),
        ({"reject_if_queue_age_ms_gte": "3s"}, "admission.reject_if_queue_age_ms_gte"),
    ],
)
def test_policy_errors(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_policy(section)


def test_reopen_guard_two_intervals():
    g = ReopenGuard()
    assert not g.observe(4000, 3000)
    assert not g.observe(100, 3000)
    assert not g.observe(5000, 3000)  # a bad interval resets the count
    assert not g.observe(100, 3000)
    assert g.observe(200, 3000)


def test_expected_service_is_added_to_the_age():
    """A request that would start in time but finish late is refused before the engine
    works on it: the route's expected_service_ms counts beside the queue's age."""
    policy = Policy(reject_if_queue_age_ms_gte=600_000, expected_service_ms=2000)
    late = decide(Request(queue_age_ms=4500, deadline_slack_ms=6000), policy)
    assert (late.decision, late.status, late.retryable) == ("reject_age_beats_slack", 422, False)
    assert "queue age 4500 ms + expected service 2000 ms >= deadline slack 6000 ms" in late.reason
    room = decide(Request(queue_age_ms=3900, deadline_slack_ms=6000), policy)
    assert room.decision == "admit_once" and "+ expected service 2000 ms" in room.reason
    assert decide(Request(queue_age_ms=4500, deadline_slack_ms=60_000), policy).decision == "admit_once"  # time to spare
    # A fixed age limit refuses with a Retry-After only where a retry could still be served in time.
    capped = decide(Request(queue_age_ms=4500, deadline_slack_ms=60_000), Policy(reject_if_queue_age_ms_gte=4000, expected_service_ms=2000))
    assert (capped.status, capped.retryable, capped.retry_after_s) == (503, True, (60_000 - 4500 - 2000) / 2000)
    # Without it (the default), age against slack alone, as before.
    assert decide(Request(queue_age_ms=4500, deadline_slack_ms=6000), Policy(reject_if_queue_age_ms_gte=600_000)).decision == "admit_once"
    assert read_policy(Section({"expected_service_ms": 2500}, "gate.yml"), Policy()).expected_service_ms == 2500
    with pytest.raises(ConfigError, match="expected_service_ms"):
        read_policy(Section({"expected_service_ms": -1}, "gate.yml"), Policy())


def test_a_projected_wait_is_judged_after_the_age_and_takes_the_cap():
    """With a wait projected from the requests ahead (core.queue_age.door_wait), a request
    whose wait plus service reaches its slack is refused (reject_wait_beats_slack), as is
    one whose wait reaches the cap, with a Retry-After only where a retry could still be
    served in time. The cap is then judged on the wait, not on the head's age, which stays
    over it after the queue behind has shortened; the head's age against the slack stands."""
    policy = Policy(reject_if_queue_age_ms_gte=2000, expected_service_ms=300)
    late = decide(Request(queue_age_ms=100, deadline_slack_ms=1000, wait_ms=800), policy)
    assert (late.decision, late.status, late.retryable) == ("reject_wait_beats_slack", 422, False)
    assert "projected wait 800 ms + expected service 300 ms >= deadline slack 1000 ms" in late.reason
    capped = decide(Request(queue_age_ms=100, deadline_slack_ms=12_000, wait_ms=2500), policy)
    assert (capped.decision, capped.status, capped.retry_after_s) == ("reject_wait_beats_slack", 503, (12_000 - 2500 - 300) / 2000)
    # The head waited past the cap, the queue behind it is short: admitted.
    assert decide(Request(queue_age_ms=2600, deadline_slack_ms=4000, wait_ms=300), policy).decision == "admit_once"
    # Without a projection the cap is the head's age, as before.
    assert decide(Request(queue_age_ms=2600, deadline_slack_ms=4000), policy).decision == "reject_age_beats_slack"
    # The head's age against the slack still refuses first (an engine that stopped: its head ages).
    aged = decide(Request(queue_age_ms=3800, deadline_slack_ms=4000, wait_ms=300), policy)
    assert aged.decision == "reject_age_beats_slack"
    assert decide(Request(queue_age_ms=100, deadline_slack_ms=4000, wait_ms=0), policy).decision == "admit_once"
