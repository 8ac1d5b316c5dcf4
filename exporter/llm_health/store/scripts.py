"""The admission queue's Lua scripts, the Redis data contract of every door: enqueue,
leave, a door's decision (the policy inside it, `store.policy`), record an attempt, GC
(the leases' are in `store.lease_scripts`). Each runs atomically on one Redis.

Every script declares its keys, and on Redis Cluster all of them share one hash slot
(`keys.QueueKeys.tagged`).
"""

from __future__ import annotations

from .policy import POLICY_LUA

# --------------------------------------------------------------------------- admission queue

GC_LIMIT = 200  # ids removed per GC call: bounded work inside a hot-path script

# Shared by the scripts: drop ids whose retention window has passed from a route's sets.
# KEYS[2..6] = enqueued, deadline, retried, live, dup of one route.
_GC_FN = """
local function gc(cutoff, limit)
  local old = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', cutoff, 'LIMIT', '0', limit)
  if #old > 0 then
    for i = 2, 6 do redis.call('ZREM', KEYS[i], unpack(old)) end
  end
  return #old
end
"""

# KEYS: record, enqueued, deadline, retried, live, dup, routes
# ARGV: id, route, tenant, deadline_ms, enqueued_ms, now_ms, retention_ms, gc_limit
# enqueue(rec, id, running) -> whether it wrote a new record: the record key and id,
# KEYS[1] and ARGV[1] unless DECIDE_LUA matched a retry without an id to a first copy (its
# record key derived from the queue's prefix: the same hash slot on Cluster). `running`: the request leaves the queue as it
# joins (DECIDE_LUA: its stats were read before): the record says running, and the id is
# taken off the waiting sets rather than added and taken off again (what _LEAVE_FN's
# leave(rec, id, 'running', '', now, '0') after a plain enqueue leaves, in fewer calls).
_ENQUEUE_FN = """
local function enqueue(rec, id, running)
  local retry = 0
  local enq, dl
  local state = 'queued'
  if running then state = 'running' end
  local fresh = redis.call('EXISTS', rec) == 0
  if not fresh then
    retry = redis.call('HINCRBY', rec, 'retry_count', 1)
    local f = redis.call('HMGET', rec, 'enqueued_ms', 'deadline_ms')
    enq, dl = f[1], f[2]
    redis.call('HSET', rec, 'route', ARGV[2], 'state', state, 'updated_ms', ARGV[6])
  else
    enq, dl = ARGV[5], ARGV[4]
    redis.call('HSET', rec, 'route', ARGV[2], 'tenant', ARGV[3], 'enqueued_ms', enq,
               'deadline_ms', dl, 'retry_count', '0', 'attempts', '0', 'token_units', '0',
               'attempt_units_max', '0', 'http_status', '', 'state', state, 'updated_ms', ARGV[6])
  end
  local keep = math.max(tonumber(dl), tonumber(ARGV[6]))
  local new_id = redis.call('ZADD', KEYS[5], string.format('%d', keep), id) == 1
  if running then
    -- an id new to the live set is on no other (GC takes an id off all of them at once)
    if not (fresh and new_id) then
      redis.call('ZREM', KEYS[2], id)
      redis.call('ZREM', KEYS[3], id)
      redis.call('ZREM', KEYS[4], id)
    end
  else
    redis.call('ZADD', KEYS[2], enq, id)
    redis.call('ZADD', KEYS[3], dl, id)
    if retry >= 1 then redis.call('ZADD', KEYS[4], dl, id) end
  end
  redis.call('PEXPIREAT', rec, string.format('%d', keep + tonumber(ARGV[7])))
  redis.call('SADD', KEYS[7], ARGV[2])
  gc(string.format('(%d', tonumber(ARGV[6]) - tonumber(ARGV[7])), ARGV[8])
  return fresh  -- the record was written whole here
end
"""
ENQUEUE_LUA = _GC_FN + _ENQUEUE_FN + "enqueue(KEYS[1], ARGV[1], false)\nreturn redis.call('HGETALL', KEYS[1])\n"

# KEYS: record, enqueued, deadline, retried. Arguments: the record key, id, new state,
# http_status ('' keeps), now_ms, only_if_waiting ('1': fail unless the id was still
# waiting: pop_oldest's race).
_LEAVE_FN = """
local function leave(rec, id, state, status, now, only_if_waiting)
  if redis.call('EXISTS', rec) == 0 then return false end
  local removed = redis.call('ZREM', KEYS[2], id)
  if only_if_waiting == '1' and removed == 0 then return false end
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZREM', KEYS[4], id)
  if status ~= '' then
    redis.call('HSET', rec, 'state', state, 'updated_ms', now, 'http_status', status)
  else
    redis.call('HSET', rec, 'state', state, 'updated_ms', now)
  end
  return true
end
"""
# KEYS: record, enqueued, deadline, retried. ARGV: id, new state, http_status ('' keeps),
# now_ms, only_if_waiting; ARGV[7] '1': reply 1, not the record (a door's finish: unread);
# ARGV[8] 'written': the record's leave already written in the same script, by the attempt's
# write (RECORD_ATTEMPT_LUA's ARGV[10], store.ends' `e`), from a record that said running:
# on no waiting set then (every way to running takes the id off them), so only the in-flight
# sets below are left to do.
# KEYS[5..7], where given: the route's in-flight sets (keys.route_inflight), the id taken
# off them whatever the record says (an attempt's end, a refusal), and where it was in
# flight and ARGV[6] is '1' (an attempt the door sent on ended) or '2' (its client gave
# up), listed as ended, a give-up a minute later (queue.ENDED, GAVE_UP).
GAVE_UP_MS = 60_000
LEAVE_QUEUE_LUA = (
    _LEAVE_FN
    + f"local GAVE_UP_MS = {GAVE_UP_MS}\n"
    + """
if KEYS[7] then
  if ARGV[6] == '1' or ARGV[6] == '2' then
    if redis.call('ZREM', KEYS[5], ARGV[1]) == 1 then
      local at = tonumber(ARGV[4])
      if ARGV[6] == '2' then at = at + GAVE_UP_MS end
      redis.call('ZADD', KEYS[7], string.format('%d', at), ARGV[1])
      redis.call('PEXPIRE', KEYS[7], 2 * GAVE_UP_MS)
    end
  else
    redis.call('ZREM', KEYS[5], ARGV[1])
  end
  redis.call('ZREM', KEYS[6], ARGV[1])
end
if ARGV[8] == 'written' then return 1 end
if not leave(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]) then return false end
if ARGV[7] == '1' then return 1 end
return redis.call('HGETALL', KEYS[1])
"""
)

FP_SCAN = 32  # first copies of one fingerprint a retry looks at (the oldest first), dead ones pruned
FP_PRUNE = 4  # first copies a new first copy looks at from the oldest, to prune the dead ones
FP_MAX = 1024  # first copies kept per fingerprint: past it the oldest are dropped

# A retry sent without an id, matched to a first copy in order (gate.headers.retry_fingerprint):
# the fingerprint's sorted set holds the queue ids of its first copies scored by arrival,
# each record its `match_until` (deadline + retry_match_window_ms) and `matched_retry` (the
# highest retry count matched to it). A retry at count n goes to the OLDEST first copy
# still in its window whose matched_retry < n and whose last status is one a client
# retries ('' unknown, 408, 409, 429, 499, 5xx), preferring one whose attempt has ended
# (state not running: a caller retries once its attempt ended), never to the newest.
# First copies gone, past their window or answered for good are pruned as they are met.
# The script runs atomically: two retries at one count take two first copies.
_MATCH_FN = (
    f"local FP_SCAN, FP_PRUNE, FP_MAX = {FP_SCAN}, {FP_PRUNE}, {FP_MAX}\n"
    + """
local function retried_for(status)
  if status == nil or status == false or status == '' then return true end
  local s = tonumber(status)
  return s == nil or s >= 500 or s == 408 or s == 409 or s == 429 or s == 499
end
local function match(fp, count, now, recprefix, limit)
  local ids = redis.call('ZRANGE', fp, 0, limit - 1)
  local running = nil
  for _, id in ipairs(ids) do
    local f = redis.call('HMGET', recprefix .. id, 'match_until', 'matched_retry', 'state', 'http_status')
    if not f[1] or tonumber(f[1]) < now or not retried_for(f[4]) then
      redis.call('ZREM', fp, id)
    elseif count > 0 and tonumber(f[2] or '0') < count then
      if f[3] ~= 'running' then return id end
      if not running then running = id end
    end
  end
  return running
end
"""
)

# A door's one round trip (gate.decision): the route's queue as this request finds it (the
# reads of queue.add_route_stats_commands), the retry of a request sent without an id
# matched to its first copy (_MATCH_FN), the enqueue (or a resent id recognised), the
# tenant's spend this minute, the engine queue age of the route's backends, a first copy
# listed under its fingerprint, and the id taken off the waiting set (state running).
# With n backends, the door's own figure of their queue age (core.queue_age.door_age and
# door_covers, the same rules): their running and waiting counts summed, "W R READ_MS S" each
# (keys.engine_waiting; S, what the engine runs when full: absent from an older exporter,
# then R; 0 while not yet known), and of the route's requests in flight sent by the latest READ_MS
# (keys.route_inflight, scored by when each was sent) the oldest after the running ones (R
# each, at least S where W > 0: core.queue_age.door_running): now minus when it was sent; 0
# when no more than those were in flight, false when a count is unknown; and 1 where at
# least W + R were in flight then, those that ended since counted too, and those whose
# clients gave up (or that reached their deadline plus budget in flight) within a
# minute before (keys.route_inflight's third set: the engine holds one until it notices),
# else 0 (something bypasses the door). And the requests that must end before this one
# starts (core.queue_age.door_ahead): every request the route has in flight now (where the
# door does not cover, at least what the engines held) less the engines' sequences (the S
# summed), plus one, where every sequence is taken; unknown (false) while any S is 0. Then this request (or the first copy it was
# matched to) joins the in-flight sets, the second scored by its deadline plus its own budget
# (keys.route_inflight): its refusal or its attempt's end takes it off (LEAVE_QUEUE_LUA),
# and its deadline plus its own budget at the latest, a minute at most (core.queue_age.keep_until:
# an end the door never heard of, a lost report, does not stay).
# KEYS: record, enqueued, deadline, retried, live, dup, routes, [tenant's minute],
#       [fingerprint], n engine age keys, n engine waiting keys, [the three in-flight sets
#       when n > 0] (all under the queue's prefix: one slot on Cluster)
# ARGV: ENQUEUE_LUA's eight, then '1' with a tenant key, the request's retry count with a
#       fingerprint ('' none), its match_until (deadline + retry_match_window_ms), the
#       record keys' prefix (a matched first copy's record is this prefix and its id: on
#       Cluster the queue's hash tag is in the prefix, so the key is in the script's slot), n,
#       the retry count its headers say, the tenant's budget ('' none), the policy's seven
#       settings (store.policy.policy_args), and '1' for the lean reply below (the nginx Lua
#       door: what a door acts on, no more)
# Returns {stats (depth, oldest score, tightest score, past deadline, retried, max dup
# score; '' where none), the record as it now stands, running (its ten fields, queue.parse_decide's order),
# the tenant's spend or false, {the engine ages, false where absent}, the id used (ARGV[1],
# or the matched first copy's), the door's figure in ms or false, 1 or 0, the requests ahead
# and the sequences (false where a count is unknown), the decision (store.policy.Verdict),
# {queue_age_ms, deadline_slack_ms, retry count, the engine queue age acted on and the
# projected wait in ms, false where unknown}}. The lean reply: one string (store.policy's
# `lean`: the id used, the record's deadline, the decision, those figures).
DECIDE_LUA = (
    _GC_FN
    + _ENQUEUE_FN
    + _MATCH_FN
    + POLICY_LUA
    + f"local GAVE_UP_MS = {GAVE_UP_MS}\n"
    + """
local function score(reply) if #reply > 0 then return reply[2] end return '' end
local now = tonumber(ARGV[6])
local k = 8
local spent_key, fp = nil, nil
if ARGV[9] == '1' then spent_key = KEYS[k]; k = k + 1 end
if ARGV[10] ~= '' then fp = KEYS[k]; k = k + 1 end
local rec, id, matched = KEYS[1], ARGV[1], false
if fp and tonumber(ARGV[10]) >= 1 then
  local found = match(fp, tonumber(ARGV[10]), now, ARGV[12], FP_SCAN)
  if found then rec, id, matched = ARGV[12] .. found, found, true end
end
local stats
if ARGV[23] == '1' then
  -- the lean reply: of the route's stats the decision reads the oldest waiting only
  stats = {false, score(redis.call('ZRANGE', KEYS[2], '0', '0', 'WITHSCORES'))}
else
  stats = {
    redis.call('ZCARD', KEYS[2]),
    score(redis.call('ZRANGE', KEYS[2], '0', '0', 'WITHSCORES')),
    score(redis.call('ZRANGE', KEYS[3], '0', '0', 'WITHSCORES')),
    redis.call('ZCOUNT', KEYS[3], '-inf', ARGV[6]),
    redis.call('ZCARD', KEYS[4]),
    score(redis.call('ZRANGE', KEYS[6], '-1', '-1', 'WITHSCORES')),
  }
end
local fresh = enqueue(rec, id, true)
if matched then
  redis.call('HSET', rec, 'matched_retry', ARGV[10])
elseif fp then
  -- a first copy (or a retry whose first copy is not known): listed for its retries
  redis.call('HSET', rec, 'match_until', ARGV[11], 'matched_retry', ARGV[10])
  match(fp, 0, now, ARGV[12], FP_PRUNE)
  -- scored by arrival, strictly rising (two in one millisecond keep their order, not their ids')
  local last = redis.call('ZRANGE', fp, -1, -1, 'WITHSCORES')
  local at = now
  if #last > 0 then at = math.max(now, tonumber(last[2]) + 1) end
  redis.call('ZADD', fp, string.format('%d', at), id)
  redis.call('ZREMRANGEBYRANK', fp, 0, -(FP_MAX + 1))
  local ttl = math.max(1, tonumber(ARGV[11]) - now)
  if redis.call('PTTL', fp) < ttl then redis.call('PEXPIRE', fp, ttl) end
end
local record
if fresh then  -- what enqueue just wrote
  record = {ARGV[2], ARGV[3], ARGV[5], ARGV[4], '0', '0', '0', '0', '', 'running'}
else
  record = redis.call('HMGET', rec, 'route', 'tenant', 'enqueued_ms', 'deadline_ms', 'retry_count',
                      'attempts', 'token_units', 'attempt_units_max', 'http_status', 'state')
end
local spent = false
if spent_key then spent = redis.call('GET', spent_key) end
local n = tonumber(ARGV[13] or '0') or 0
local ages = {}
for i = k, k + n - 1 do ages[#ages + 1] = redis.call('GET', KEYS[i]) end
local door, covers, ahead, slots = false, 0, false, false
if n > 0 then
  local inflight, ends, ended = KEYS[k + 2 * n], KEYS[k + 2 * n + 1], KEYS[k + 2 * n + 2]
  local gone = redis.call('ZRANGEBYSCORE', ends, '-inf', ARGV[6], 'LIMIT', 0, 64)
  if #gone > 0 then  -- no end heard by their deadline plus budget (a lost report): the engine may hold them yet
    redis.call('ZREM', inflight, unpack(gone))
    redis.call('ZREM', ends, unpack(gone))
    for _, g in ipairs(gone) do redis.call('ZADD', ended, string.format('%d', now + GAVE_UP_MS), g) end
  end
  redis.call('ZREMRANGEBYSCORE', ended, '-inf', string.format('(%d', now - 2 * GAVE_UP_MS))
  local known, sized, held, read, running = true, true, 0, 0, 0
  slots = 0
  for i = k + n, k + 2 * n - 1 do
    local w, r, t, s = string.match(redis.call('GET', KEYS[i]) or '', '^(%d+) (%d+) (%d+) ?(%d*)$')
    if not w then known = false break end
    if s == '' then s = r elseif tonumber(s) == 0 then sized = false end
    -- core.queue_age.door_running: where requests wait, at least what it runs when full (a
    -- read between two steps shows the finished gone and the next not yet scheduled)
    if tonumber(w) > 0 then running = running + math.max(tonumber(r), tonumber(s)) else running = running + tonumber(r) end
    slots = slots + math.max(tonumber(r), tonumber(s))
    held = held + tonumber(w) + tonumber(r)
    read = math.max(read, tonumber(t))
  end
  if known then
    local before = string.format('%d', read)
    local sent = redis.call('ZCOUNT', inflight, '-inf', before)
    if sent + redis.call('ZCOUNT', ended, '(' .. before, '+inf') >= held then covers = 1 end
    if sent <= running then
      door = 0
    else
      local e = redis.call('ZRANGEBYSCORE', inflight, '-inf', before, 'WITHSCORES', 'LIMIT', running, 1)
      door = math.max(0, now - tonumber(e[2]))
    end
    -- the requests that must end before this one starts (core.queue_age.door_ahead): all the
    -- door has in flight now (those sent since the read included; where something bypasses
    -- the door, at least what the engines held), less the engines' sequences, plus one, when
    -- every sequence is taken
    if sized then
      local seqs, held_now = math.max(slots, 1), redis.call('ZCARD', inflight)
      if covers == 0 then held_now = math.max(held_now, held) end
      ahead = 0
      if held_now >= seqs then ahead = held_now - seqs + 1 end
    else
      slots = false  -- an engine not yet seen full: what it runs when full unknown
    end
  else
    slots = false
  end
  redis.call('ZADD', inflight, ARGV[6], id)
  -- kept until its end is heard, or its deadline plus its own budget, a minute at most
  -- (core.queue_age.keep_until: a retry admitted before the deadline is waited on past it)
  local dl = tonumber(record[4])
  local budget = dl - (tonumber(record[3]) or dl)
  redis.call('ZADD', ends, string.format('%d', dl + math.max(0, math.min(GAVE_UP_MS, budget))), id)
  -- Nothing outlives the traffic: the sets expire after the latest deadline in them.
  local keep = math.max(1, tonumber(record[4]) - now) + GAVE_UP_MS
  for _, key in ipairs({inflight, ends}) do
    if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
  end
  if #gone > 0 then redis.call('PEXPIRE', ended, 2 * GAVE_UP_MS) end
end
-- The decision (store.policy): the route's queue age, the backends' as the door acts on it
-- (core.queue_age.acted_on: the door's own figure where it covers, else the larger; the
-- counters' the youngest published), the wait projected (door_wait), the policy.
local P = read_policy(ARGV, 16)
local counters, engine_age, wait = nil, nil, nil
for i = 1, n do
  local v = ages[i]
  if v and string.match(v, '^%d+$') and #v <= 15 and (counters == nil or tonumber(v) < counters) then counters = tonumber(v) end
end
if n > 0 then
  local d = nil
  if door ~= false then d = door end
  if d ~= nil and (covers == 1 or counters == nil) then engine_age = d
  elseif d == nil then engine_age = counters
  else engine_age = math.max(counters, d) end
end
if P.service ~= 0 and ahead ~= false and slots ~= false then wait = math.floor(ahead * P.service / math.max(1, slots)) end
local route_age = 0
if stats[2] ~= '' then route_age = now - math.floor(tonumber(stats[2])) end
local queue_age, slack = math.max(route_age, engine_age or 0), tonumber(record[4]) - now
local retries, budget = math.max(tonumber(ARGV[14]), tonumber(record[5])), nil
if ARGV[15] ~= '' then budget = tonumber(ARGV[15]) - (tonumber(spent) or 0) end
local name, reason, status, after, retryable = policy(P, queue_age, slack, retries, nil, tonumber(record[9]), budget, wait)
if n > 0 and engine_age == nil then name, reason, status, after, retryable = unknown_age(P, name, reason, status, after, retryable, slack) end
local figures = {queue_age, slack, retries, engine_age or false, wait or false}
if ARGV[23] == '1' then return lean(id, record[4], name, reason, status, after, retryable, figures) end
return {stats, record, spent, ages, id, door, covers, ahead, slots, verdict(name, reason, status, after, retryable), figures}
"""
)

# KEYS: record, enqueued, deadline, retried, live, dup[, tenant's minute]
# ARGV: id, token_units, http_status ('' = none), now_ms, retention_ms, retry_count ('' = none),
#       attempt id ('' = none), units charged to the tenant key (0 = none), '1': reply 1,
#       not the record (a door's finish)
# With an attempt id the script is idempotent: the same attempt recorded twice (a write
# sent again after a timeout whose first copy did run) is counted once, tenant included.
# ARGV[9] '2' and ARGV[10] a state (store.ends' `e`, an attempt's end whole): the state
# written with the attempt, in the same write, and the reply the state the record said
# before (false where nothing was written: no record, the attempt already counted), so
# that LEAVE_QUEUE_LUA, told 'written', does not read and write the record again.
RECORD_ATTEMPT_LUA = """
local rec = KEYS[1]
local function reply()
  if ARGV[9] == '1' then return 1 end
  if ARGV[9] == '2' then return false end
  return redis.call('HGETALL', rec)
end
-- one read and one write of the record (the script is atomic: read, add, write back)
local f = redis.call('HMGET', rec, 'deadline_ms', 'last_attempt', 'attempts', 'token_units', 'attempt_units_max', 'retry_count', 'state')
if not f[1] and redis.call('EXISTS', rec) == 0 then return false end
local function count(v, what)
  local n = tonumber(v or '0')
  if n == nil or n ~= math.floor(n) then error('ERR ' .. what .. ' is not an integer') end
  return n
end
local units = count(ARGV[2], 'token_units')
local attempt = ARGV[7] or ''
if attempt ~= '' and f[2] == attempt then return reply() end
if KEYS[7] and tonumber(ARGV[8] or '0') > 0 then
  redis.call('INCRBY', KEYS[7], ARGV[8])
  redis.call('EXPIRE', KEYS[7], 120)
end
local total = count(f[4], 'token_units') + units
local most = count(f[5], 'attempt_units_max')
local write = {'attempts', string.format('%d', count(f[3], 'attempts') + 1), 'token_units', string.format('%d', total),
               'updated_ms', ARGV[4]}
if attempt ~= '' then write[#write + 1] = 'last_attempt'; write[#write + 1] = attempt end
if units > most then
  most = units
  write[#write + 1] = 'attempt_units_max'; write[#write + 1] = string.format('%d', units)
end
if ARGV[3] ~= '' then write[#write + 1] = 'http_status'; write[#write + 1] = ARGV[3] end
local dl = tonumber(f[1])
local raised = ARGV[6] ~= '' and tonumber(ARGV[6]) > tonumber(f[6] or '0')
if raised then write[#write + 1] = 'retry_count'; write[#write + 1] = ARGV[6] end
if ARGV[9] == '2' then write[#write + 1] = 'state'; write[#write + 1] = ARGV[10] end
redis.call('HSET', rec, unpack(write))
if raised and redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  redis.call('ZADD', KEYS[4], string.format('%d', dl), ARGV[1])
end
if most > 0 then redis.call('ZADD', KEYS[6], tostring(total / most), ARGV[1]) end
-- The record is kept to its deadline, or to now where the attempt ends after it: before the
-- deadline the decision that sent the attempt (or its enqueue) already set both to the deadline.
if tonumber(ARGV[4]) > dl then
  redis.call('ZADD', KEYS[5], ARGV[4], ARGV[1])
  redis.call('PEXPIREAT', rec, string.format('%d', tonumber(ARGV[4]) + tonumber(ARGV[5])))
end
if ARGV[9] == '2' then return f[7] or '' end
return reply()
"""

# KEYS: (unused), enqueued, deadline, retried, live, dup. ARGV: cutoff_ms, limit.
GC_LUA = (
    _GC_FN
    + """
return gc(string.format('(%d', tonumber(ARGV[1])), ARGV[2])
"""
)
