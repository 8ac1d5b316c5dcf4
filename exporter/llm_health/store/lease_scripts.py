"""The lease scripts of the Redis data contract: claim, renew, release, fence check,
waiters, reconcile's delete and the bulk read (the admission queue's are in
`store.scripts`). Each runs atomically on one Redis.

Every script declares its keys, and on Redis Cluster all of them share one hash slot
(`keys.LeaseKeys.tagged`), except READ_LEASES_LUA, which is for one server or a Sentinel
primary only (on Cluster the view reads leases with plain pipelined commands).
"""

from __future__ import annotations

# --------------------------------------------------------------------------- leases

# KEYS: n lease keys, then n info keys, then n fence keys, then optionally a pool's
# waiters key (one server, Sentinel: same slot). ARGV: holder, ttl_ms, job_id, first
# index to try (0-based), and with the waiters key the waiter to take off it once this
# claim holds a GPU (a won wait leaves the list in the claim's round trip).
# A holder that already holds one of the GPUs gets that lease back, TTL renewed, same
# token: a claim sent again after its reply was lost (a broken connection, a client
# retry) never takes a second GPU nor loses the token it was given. Otherwise it
# claims the first free GPU, trying from ARGV[4] round the list. The side hash is written
# in the same script, so no reader ever sees a lease of ours without its token. Time comes
# from the Redis clock, the same for every claimer.
#
# The fencing token is max(last token + 1, the Redis clock in microseconds): it grows with
# every claim, and it never goes backwards when the fence key is lost (a Redis restarted
# without persistence, a failover to a replica that had not received it), because the
# clock has moved on since the last token was issued. It relies on the Redis server's
# clock not stepping back by more than the time the data was lost for (docs/redis-schema.md).
CLAIM_LUA = """
local n = math.floor(#KEYS / 3)
local function won(reply)
  if #KEYS > 3 * n then redis.call('ZREM', KEYS[3 * n + 1], ARGV[5]) end
  return reply
end
local start = tonumber(ARGV[4]) or 0
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
for j = 1, n do
  if redis.call('GET', KEYS[j]) == ARGV[1] and redis.call('HGET', KEYS[n + j], 'holder') == ARGV[1] then
    redis.call('PEXPIRE', KEYS[j], ARGV[2])
    redis.call('HSET', KEYS[n + j], 'ttl_ms', ARGV[2])
    redis.call('PEXPIRE', KEYS[n + j], ARGV[2])
    return won({j - 1, redis.call('HGET', KEYS[n + j], 'token'), redis.call('HGET', KEYS[n + j], 'claimed_ms')})
  end
end
for i = 0, n - 1 do
  local j = ((i + start) % n) + 1
  if redis.call('SET', KEYS[j], ARGV[1], 'NX', 'PX', ARGV[2]) then
    local last = tonumber(redis.call('GET', KEYS[2 * n + j]) or '0') or 0
    local token = string.format('%d', math.max(last + 1, now_us))
    redis.call('SET', KEYS[2 * n + j], token)
    redis.call('HSET', KEYS[n + j], 'holder', ARGV[1], 'token', token, 'job_id', ARGV[3],
               'claimed_ms', now, 'ttl_ms', ARGV[2])
    redis.call('PEXPIRE', KEYS[n + j], ARGV[2])
    return won({j - 1, token, now})
  end
end
return false
"""

# KEYS: lease, info. ARGV: holder, token, ttl_ms. Extends both only for the holder of
# this very claim (same id AND same fencing token: a holder id reused by a later claim
# of the same worker does not count).
RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[2] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], 'ttl_ms', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""

# KEYS: lease, info. ARGV: holder, token.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""

# KEYS: lease, info. ARGV: token. 1 if the token is the one of the lease held now.
CHECK_FENCE_LUA = """
local holder = redis.call('GET', KEYS[1])
if not holder then return 0 end
if redis.call('HGET', KEYS[2], 'holder') ~= holder then return 0 end
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 0 end
return 1
"""

# KEYS: waiters zset. ARGV: waiter id, its deadline (Unix ms), now (Unix ms), TTL wanted.
# Drops the waiters whose deadline has passed (they died without their cleanup), lists
# this one, and only ever extends the key's TTL (a short waiter must not expire a long
# one's entry): nothing stays behind once every deadline has passed.
ADD_WAITER_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return 1
"""

# KEYS: lease, info. ARGV: holder expected. Deletes the lease only if it still holds
# that holder (reconcile must not delete a lease claimed since it looked).
DELETE_IF_HOLDER_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""

# ARGV: lease prefix, info prefix, then the GPU ids of one chunk joined by newlines.
# Returns, for each HELD lease only, six fields: index (1-based), holder, PTTL, info
# holder, token, claimed_ms ('' if absent). It reads only the keys it is given (never
# SCAN). The ids travel as one string because encoding 20,000 separate arguments per
# refresh was most of the exporter's cost; the keys are therefore not declared, which is
# fine on one Redis (in Cluster, give the pool's keys one hash tag). One script per
# chunk of READ_CHUNK GPUs keeps each one short (Redis runs scripts one at a time),
# and a pipeline of chunks costs one round trip however large the pool.
READ_LEASES_LUA = """
local out = {}
local i = 0
for gpu in string.gmatch(ARGV[3], '[^\\n]+') do
  i = i + 1
  local key = ARGV[1] .. gpu
  local v = redis.call('GET', key)
  if v then
    local info = redis.call('HMGET', ARGV[2] .. gpu, 'holder', 'token', 'claimed_ms')
    out[#out + 1] = i
    out[#out + 1] = v
    out[#out + 1] = redis.call('PTTL', key)
    out[#out + 1] = info[1] or ''
    out[#out + 1] = info[2] or ''
    out[#out + 1] = info[3] or ''
  end
end
return out
"""
