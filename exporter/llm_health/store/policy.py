"""The age-first admission policy as the doors run it: Lua, inside the decision script
every door sends (scripts.DECIDE_LUA), so the gate, `decide`, the LiteLLM hook and any door
that runs the script itself (nginx's Lua module, one EVALSHA) get the one decision, never a
copy of it.

`core.admission` is the reference: the same rules, the same reasons word for word, in
Python, for what a door decides with no Redis to ask (the route's `redis_down` policy),
for the benchmarks' simulator and for the property test (tests/unit/test_policy_lua.py)
that runs this script on a real redis-server against it on generated inputs. Both change
together or that test fails.

The policy's settings travel as the script's arguments (`policy_args`), the decision comes
back as six values (`Verdict`): a Lua number returned to Redis is truncated to an integer,
so the Retry-After wait comes back as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# policy(P, age, slack, retries, util, upstream, budget, wait): the decision of
# core.admission.decide (its `_decide` and `bounded`), as (name, reason, status,
# retry_after_s or nil, retryable). Numbers formatted as Python formats them (%.0f, %g,
# %.2f, %d: the C formats Python's follow). read_policy(args, i): the settings from the
# script's arguments at i (policy_args' order).
POLICY_LUA = """
local function read_policy(args, i)
  return {age_gte = tonumber(args[i]), retry_gte = tonumber(args[i + 1]), late_slack = tonumber(args[i + 2]),
          mode = args[i + 3], late_status = tonumber(args[i + 4]), service = tonumber(args[i + 5]),
          unknown = args[i + 6]}
end
local function fmt_g(x) return string.format('%g', x) end
local function bounded(P, name, reason, status, after, retryable, slack)
  if name == 'admit_once' or name == 'admit_unrecorded' or after == nil then return name, reason, status, after, retryable end
  local wait_s = math.max(1, math.ceil(after))
  if wait_s * 1000 < slack then return name, reason, status, after, retryable end
  return name, reason .. string.format('; a retry in %d s would come after the deadline (slack %.0f ms): not retryable', wait_s, slack),
         P.late_status, nil, false
end
local function beats(P, name, what, plus, ms, slack, tail)
  local why
  if ms + P.service >= slack then
    why = what .. plus .. string.format(' >= deadline slack %.0f ms', slack)
  else
    why = what .. ' >= ' .. fmt_g(P.age_gte) .. ' ms'
  end
  if slack > ms + P.service then return name, why .. tail, 503, math.max(1.0, (slack - ms - P.service) / 2000.0), true end
  return name, why .. tail, P.late_status, nil, false
end
local function decide_policy(P, age, slack, retries, util, upstream, budget, wait)
  local u, up = '', ''
  if util then u = string.format('; worker util %.2f ignored: age first', util) end
  if upstream and upstream ~= 0 then up = string.format('; last upstream %d', upstream) end
  if retries >= P.retry_gte and slack <= P.late_slack then
    return 'reject_retry_late', string.format('retry %d with deadline slack %.0f ms <= %s ms%s%s', retries, slack, fmt_g(P.late_slack), up, u),
           P.late_status, nil, false
  end
  if P.mode == 'reject_all' then return 'reject_route_closed', 'route set to reject_all by an operator', 503, 30.0, true end
  local plus, tail = '', up .. u
  if P.service ~= 0 then plus = ' + expected service ' .. fmt_g(P.service) .. ' ms' end
  if age + P.service >= slack or (wait == nil and age >= P.age_gte) then
    return beats(P, 'reject_age_beats_slack', string.format('queue age %.0f ms', age), plus, age, slack, tail)
  end
  if wait ~= nil and (wait + P.service >= slack or wait >= P.age_gte) then
    return beats(P, 'reject_wait_beats_slack', string.format('projected wait %.0f ms', wait), ' + expected service ' .. fmt_g(P.service) .. ' ms',
                 wait, slack, tail)
  end
  if budget ~= nil and budget <= 0 then return 'reject_tenant_budget', 'tenant token-unit budget spent for this window', 429, 60.0, true end
  return 'admit_once', string.format('queue age %.0f ms%s < deadline slack %.0f ms%s', age, plus, slack, up), 200, nil, false
end
local function policy(P, age, slack, retries, util, upstream, budget, wait)
  local name, reason, status, after, retryable = decide_policy(P, age, slack, retries, util, upstream, budget, wait)
  return bounded(P, name, reason, status, after, retryable, slack)
end
-- The route's backends' queue age unknown (every figure absent): closed refuses what the
-- policy admitted (core.admission.unknown_age), open says it decided on the route's queue.
local function unknown_age(P, name, reason, status, after, retryable, slack)
  if P.unknown == 'closed' then
    if name == 'admit_once' then
      return bounded(P, 'reject_queue_age_unknown', 'engine queue age unknown for every backend of the route; route fails closed', 503, 5.0, true, slack)
    end
    return name, reason, status, after, retryable
  end
  return name, reason .. "; engine queue age unknown, failing open on the route's own queue", status, after, retryable
end
local function verdict(name, reason, status, after, retryable)
  local a = false
  if after ~= nil then a = string.format('%.17g', after) end
  local r = 0
  if retryable then r = 1 end
  return {name, reason, status, a, r}
end
-- The lean reply (the nginx Lua door's): one string, tab-separated, the reason last (it is
-- read with one pattern, not as nested replies): the id used, the record's deadline, the
-- decision, status, Retry-After ('' none), retryable (1/0), then the figures (queue age,
-- slack, retry count, engine age and projected wait, '' where unknown), then the reason.
local function lean(id, deadline, name, reason, status, after, retryable, figures)
  local function num(x) if x == false or x == nil then return '' end return string.format('%d', x) end
  local a, r = '', '0'  -- Retry-After and retryable as `verdict` writes them
  if after ~= nil then a = string.format('%.17g', after) end
  if retryable then r = '1' end
  -- one concatenation, no table (the script runs on every request through the door)
  return id .. '\t' .. deadline .. '\t' .. name .. '\t' .. num(status) .. '\t' .. a .. '\t' .. r .. '\t' .. num(figures[1]) .. '\t'
         .. num(figures[2]) .. '\t' .. num(figures[3]) .. '\t' .. num(figures[4]) .. '\t' .. num(figures[5]) .. '\t' .. reason
end
"""

POLICY_ARGS = 7  # the settings policy_args encodes, in read_policy's order


class Settings(Protocol):
    """What the script reads of a policy (core.admission.Policy: this package imports no core)."""

    @property
    def reject_if_queue_age_ms_gte(self) -> float: ...
    @property
    def reject_if_retry_count_gte(self) -> int: ...
    @property
    def ignore_worker_util_when_slack_ms_lte(self) -> float: ...
    @property
    def mode(self) -> str: ...
    @property
    def late_status(self) -> int: ...
    @property
    def expected_service_ms(self) -> float: ...
    @property
    def unknown_age_mode(self) -> str: ...


def policy_args(p: Settings) -> list[str]:
    """The policy's settings as the script's arguments, in read_policy's order (repr: a
    float read back exactly)."""
    return [
        repr(float(p.reject_if_queue_age_ms_gte)),
        str(int(p.reject_if_retry_count_gte)),
        repr(float(p.ignore_worker_util_when_slack_ms_lte)),
        p.mode,
        str(int(p.late_status)),
        repr(float(p.expected_service_ms)),
        p.unknown_age_mode,
    ]


@dataclass(frozen=True)
class Verdict:
    """What the script decided (`verdict` in POLICY_LUA): the decision's name, its reason,
    the HTTP status, the Retry-After wait in seconds (None: none) and whether a client
    may come back."""

    decision: str
    reason: str
    status: int
    retry_after_s: float | None
    retryable: bool

    @classmethod
    def read(cls, reply: Any) -> Verdict:
        name, reason, status, after, retryable = reply
        return cls(_text(name), _text(reason), int(status), None if after is None or after is False else float(_text(after)), bool(int(retryable)))


@dataclass(frozen=True)
class Figures:
    """What the script decided on, in whole milliseconds: the queue's age (the route's own
    queue or its engines', the larger), the request's deadline slack (a resent id keeps its
    first deadline), its retry count (the larger of its headers' and its record's), the
    backends' queue age acted on (core.queue_age.acted_on) and the wait projected for it
    (core.queue_age.door_wait), None where unknown or none."""

    queue_age_ms: int
    slack_ms: int
    retry_count: int
    engine_age_ms: int | None
    wait_ms: int | None

    @classmethod
    def read(cls, reply: Any) -> Figures:
        age, slack, retries, engine, wait = reply
        return cls(int(age), int(slack), int(retries), _count(engine), _count(wait))


def _count(value: Any) -> int | None:  # Lua's false comes back as None (0 is a count, not false)
    return None if value is None or value is False else int(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
