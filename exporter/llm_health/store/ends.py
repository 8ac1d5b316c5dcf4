"""Attempt ends carried in one script call: the nginx Lua door's finishes, written with no
round trip of their own.

An end is what the Python doors pipeline as two scripts (`store.batch`): RECORD_ATTEMPT_LUA
then LEAVE_QUEUE_LUA, or LEAVE_QUEUE_LUA alone for a refusal. Here each script's call is a
run of arguments: `a` (record the attempt) or `l` (leave the queue), the number of keys,
the number of arguments, the keys, the arguments, exactly as the script takes them (no
string is built or split on either side). The scripts run unchanged, as local functions of
KEYS and ARGV; an end Redis refuses (a wrong type where a record was) is skipped, never
failing the rest of the call, while an error that is Redis itself saying "not now"
(store.codes: NOREPLICAS under min-replicas-to-write, READONLY after a failover) fails the
whole call, so that the door sends its ends again rather than lose them.

- DECIDE_ENDS_LUA: the decision script (DECIDE_LUA, its keys and 23 arguments) after the
  ends queued since the door's last call, from ARGV[24] on. A door that decides sends its
  pending ends with the decision: they cost nginx no write, no reply and no timer wake of
  their own (1,948 of 2,000 ends at 500 requests/s went this way in a diagnostic run;
  bench/notes/bench_admission.md has the profile).
- ENDS_LUA: the ends alone, from ARGV[1] (what the door's 10 ms timer sends when no
  decision carried them).

The keys of an end are not declared to Redis (they travel as arguments): the Lua door
reaches one Redis server only (`gate.nginx_lua` refuses Sentinel and Cluster), where that
is allowed. Each end is idempotent as the scripts are (an attempt id, a leave that finds
the id gone), so an end sent again after a timeout is counted once.
"""

from __future__ import annotations

from .codes import RETRYABLE_CODES
from .policy import POLICY_ARGS
from .scripts import DECIDE_LUA, LEAVE_QUEUE_LUA, RECORD_ATTEMPT_LUA

DECIDE_ARGS = 15 + POLICY_ARGS + 1  # DECIDE_LUA's arguments (its own, the policy's settings, the lean flag): the ends follow them


def _function(name: str, body: str) -> str:
    """A script's body as a local function of its own KEYS and ARGV (Redis 7 makes the
    globals read-only: the parameters stand in for them)."""
    return f"local function {name}(KEYS, ARGV)\n{body}\nend\n"


_RUN_ENDS = (
    "local DOWN = {"
    + ", ".join(f"{code} = true" for code in sorted(RETRYABLE_CODES))
    + "}\n"
    + """
local function run_ends(from)
  local i, done, last = from, 0, #ARGV
  while i <= last do
    local nk, na = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local keys, args = {}, {}
    for j = 1, nk do keys[j] = ARGV[i + 2 + j] end
    for j = 1, na do args[j] = ARGV[i + 2 + nk + j] end
    local script = record_attempt
    if ARGV[i] == 'l' then script = leave_queue end
    local ok, e = pcall(script, keys, args)
    if ok then
      done = done + 1
    else
      -- a command's error reply comes as its text (or, on some versions, a table holding it)
      local text = e
      if type(e) == 'table' then text = e.err end
      if type(text) == 'string' and DOWN[string.match(text, '^(%u+) ') or ''] then
        error({err = text})  -- Redis itself said "not now" (NOREPLICAS, READONLY, ...): the call fails, the door sends it again
      end
    end
    i = i + 3 + nk + na
  end
  return done
end
"""
)

_ENDS = _function("record_attempt", RECORD_ATTEMPT_LUA) + _function("leave_queue", LEAVE_QUEUE_LUA) + _RUN_ENDS

ENDS_LUA = _ENDS + "return run_ends(1)\n"

DECIDE_ENDS_LUA = _ENDS + _function("decide", DECIDE_LUA) + f"run_ends({DECIDE_ARGS + 1})\nreturn decide(KEYS, ARGV)\n"


def packed(kind: str, keys: list[str], args: list[str]) -> list[str]:
    """One script call of an end as DECIDE_ENDS_LUA and ENDS_LUA read it (the Lua door
    writes the same; the tests use this)."""
    if kind not in ("a", "l"):
        raise ValueError(f"an end's call is 'a' (record the attempt) or 'l' (leave the queue), not {kind!r}")
    return [kind, str(len(keys)), str(len(args)), *keys, *args]
