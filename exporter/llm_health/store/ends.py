"""Attempt ends carried in one script call: the nginx Lua door's finishes, written with no
round trip of their own.

An end is what the Python doors pipeline as two scripts (`store.batch`): RECORD_ATTEMPT_LUA
then LEAVE_QUEUE_LUA, or LEAVE_QUEUE_LUA alone for a refusal. Here each script's call is a
run of arguments: `a` (record the attempt) or `l` (leave the queue), the number of keys,
the number of arguments, the keys, the arguments, exactly as the script takes them (no
string is built or split on either side); or `e`, an attempt's end whole: both calls from
one run of what they do not share (`attempt_end`: 21 arguments where `a` and `l` take 35),
whose attempt's write also sets the record's state, so that where the record said running
the leave touches only the in-flight sets (7 calls on Redis where the two scripts make 12).
The scripts run unchanged, as local functions of KEYS and ARGV; an end Redis refuses (a
wrong type where a record was) is skipped, never failing the rest of the call, while an error that is Redis itself saying "not now"
(store.codes: NOREPLICAS under min-replicas-to-write, READONLY after a failover) fails the
whole call, so that the door sends its ends again rather than lose them.

- DECIDE_ENDS_LUA: the decision script (DECIDE_LUA, its keys and 23 arguments) after the
  ends queued since the door's last call, from ARGV[24] on. A door that decides sends its
  pending ends with the decision: they cost nginx no write, no reply and no timer wake of
  their own (1,948 of 2,000 ends at 500 requests/s went this way in a diagnostic run;
  bench/notes/bench_admission.md has the profile).
- ENDS_LUA: the ends alone, from ARGV[1] (what the door's ends timer sends when no
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
    """
-- One script's call: 1 where it ran (and its reply), 0 where Redis refused it (skipped).
local function run_one(script, keys, args)
  local ok, e = pcall(script, keys, args)
  if ok then return 1, e end
  -- a command's error reply comes as its text (or, on some versions, a table holding it)
  local text = e
  if type(e) == 'table' then text = e.err end
  local DOWN = {"""
    + ", ".join(f"{code} = true" for code in sorted(RETRYABLE_CODES))
    + """}  -- built here, on an error only: not on every call
  if type(text) == 'string' and DOWN[string.match(text, '^(%u+) ') or ''] then
    error({err = text})  -- Redis itself said "not now" (NOREPLICAS, READONLY, ...): the call fails, the door sends it again
  end
  return 0
end
local function run_ends(from)
  local i, done, last = from, 0, #ARGV
  while i <= last do
    local kind, nk, na = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    if kind == 'e' then
      -- keys: record, enqueued, deadline, retried, live, dup, in flight, its ends, ended[, the
      -- tenant's minute]; args: id, token units, http status, now, retention, retry count,
      -- attempt id, units charged, ended ('1' or '2'); read where they lie in ARGV (k + j is
      -- key j, a + j argument j: no copy of the run; an `e` of other counts is skipped)
      -- the attempt's write sets the state too ('2', 'done'); where the record said running,
      -- the leave has nothing left to do on it ('written': RECORD_ATTEMPT_LUA, LEAVE_QUEUE_LUA)
      local k, a = i + 2, i + 2 + nk
      if (nk == 9 or nk == 10) and na == 9 then
        local tenant = nil
        if nk == 10 then tenant = ARGV[k + 10] end
        local ran, before = run_one(record_attempt, {ARGV[k + 1], ARGV[k + 2], ARGV[k + 3], ARGV[k + 4], ARGV[k + 5], ARGV[k + 6], tenant},
                                    {ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 7], ARGV[a + 8], '2', 'done'})
        local written = ''
        if before == 'running' then written = 'written' end
        done = done + ran + run_one(leave_queue, {ARGV[k + 1], ARGV[k + 2], ARGV[k + 3], ARGV[k + 4], ARGV[k + 7], ARGV[k + 8], ARGV[k + 9]},
                                    {ARGV[a + 1], 'done', ARGV[a + 3], ARGV[a + 4], '0', ARGV[a + 9], '1', written})
      end
    else
      local keys, args = {}, {}
      for j = 1, nk do keys[j] = ARGV[i + 2 + j] end
      for j = 1, na do args[j] = ARGV[i + 2 + nk + j] end
      if kind == 'l' then
        done = done + run_one(leave_queue, keys, args)
      else
        done = done + run_one(record_attempt, keys, args)
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
    if kind not in ("a", "l", "e"):
        raise ValueError(f"an end's call is 'a' (record the attempt), 'l' (leave the queue) or 'e' (both), not {kind!r}")
    return [kind, str(len(keys)), str(len(args)), *keys, *args]


def attempt_end(attempt: tuple[list[str], list[str]], leave: tuple[list[str], list[str]]) -> list[str]:
    """An attempt's end as one `e` run: the attempt's call (AdmissionQueue.attempt_call) and
    its leave (leave_call, with the route's in-flight sets and done), of one record, as
    RECORD_ATTEMPT_LUA then LEAVE_QUEUE_LUA take them, less what they share (the Lua door
    writes the same)."""
    (akeys, a), (lkeys, b) = attempt, leave
    aargs, largs = [str(v) for v in a], [str(v) for v in b]
    shared = [largs[0], largs[2], largs[3]] == [aargs[0], aargs[2], aargs[3]] and largs[1] == "done" and largs[4] == "0"
    if lkeys[:4] != akeys[:4] or len(lkeys) != 7 or len(akeys) not in (6, 7) or not shared:
        raise ValueError("attempt_end: the attempt's call and its leave (done, with the route's in-flight sets) must be of one record at one time")
    return packed("e", [*akeys[:6], *lkeys[4:], *akeys[6:]], [*aargs[:8], largs[5]])
