"""Lua scripts of the worker registry: each state transition of a worker record is one script, so a
heartbeat, drain, resume, quarantine, loss or deletion racing another never leaves a half-written or
resurrected record (Redis runs a script atomically).

Worker hash fields: name, device, host, state, token_sha256, enrolled_by, registered_at, last_heartbeat,
lease_expires_at, busy, version, accepted, rejected, and `drained_by` (admin | worker) while draining.
A record without `token_sha256` is incomplete (never written by these scripts) and read as absent.
"""

from __future__ import annotations

# KEYS: 1 worker hash, 2 workers set, 3 leases zset, 4 enrolled-by-token set, 5 rate counter.
# ARGV: 1 wid, 2 lease expiry, 3 cap per token, 4 registrations per window, 5 window seconds, then
# field/value pairs. Returns {'ok'} | {'rate', ttl} | {'cap', n}.
REGISTER = """
local n = redis.call('INCR', KEYS[5])
if n == 1 then redis.call('EXPIRE', KEYS[5], ARGV[5]) end
if n > tonumber(ARGV[4]) then return {'rate', redis.call('TTL', KEYS[5])} end
local have = redis.call('SCARD', KEYS[4])
if have >= tonumber(ARGV[3]) then return {'cap', have} end
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
return {'ok'}
"""

# KEYS: 1 worker hash, 2 leases, 3 expiry zset. ARGV: 1 wid, 2 now, 3 lease expiry, 4 busy, 5 version.
# Returns the state after the heartbeat, or false for an unknown worker (nothing is written then). A lost
# worker comes back active, or draining if it was drained before it was lost.
HEARTBEAT = """
if redis.call('HEXISTS', KEYS[1], 'token_sha256') == 0 then return false end
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'lost' then
  if redis.call('HEXISTS', KEYS[1], 'drained_by') == 1 then state = 'draining' else state = 'active' end
end
redis.call('HSET', KEYS[1], 'state', state, 'last_heartbeat', ARGV[2], 'lease_expires_at', ARGV[3],
  'busy', ARGV[4], 'version', ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
return state
"""

# KEYS: 1 worker hash. ARGV: 1 new state, 2 actor (admin | worker | coordinator), 3 allowed current
# states (comma-separated). Returns {'ok', state} | {'missing'} | {'conflict', current} |
# {'admin_drain', current}. Stickiness: a worker cannot resume a drain an admin asked for; a worker's own
# drain does not replace an admin's; quarantine is left only by deletion (it is in no allowed list).
TRANSITION = """
if redis.call('HEXISTS', KEYS[1], 'token_sha256') == 0 then return {'missing'} end
local cur = redis.call('HGET', KEYS[1], 'state')
local allowed = false
for s in string.gmatch(ARGV[3], '[^,]+') do if s == cur then allowed = true end end
if not allowed then return {'conflict', cur} end
local by = redis.call('HGET', KEYS[1], 'drained_by')
if ARGV[1] == 'active' then
  if ARGV[2] == 'worker' and by == 'admin' then return {'admin_drain', cur} end
  redis.call('HDEL', KEYS[1], 'drained_by')
elseif ARGV[1] == 'draining' then
  if ARGV[2] ~= 'worker' or by ~= 'admin' then redis.call('HSET', KEYS[1], 'drained_by', ARGV[2]) end
end
redis.call('HSET', KEYS[1], 'state', ARGV[1])
return {'ok', ARGV[1]}
"""

# KEYS: 1 worker hash, 2 leases, 3 expiry zset. ARGV: 1 wid, 2 now, 3 when a lost worker expires.
# Marks a worker lost if its lease (still) ended before `now`; 1 if this call marked it.
MARK_LOST = """
local lease = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not lease or tonumber(lease) > tonumber(ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'active' and state ~= 'draining' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'lost')
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
return 1
"""

# KEYS: 1 worker hash, 2 workers set, 3 leases, 4 expiry zset. ARGV: 1 wid, 2 required state ('' for
# any), 3 prefix of the enrolled-by-token sets. Returns {'ok', enrolled_by} or false (unknown, or not in
# the required state: an expired worker that came back is not deleted).
DELETE = """
local state = redis.call('HGET', KEYS[1], 'state')
if ARGV[2] ~= '' and state ~= ARGV[2] then return false end
local enrolled = redis.call('HGET', KEYS[1], 'enrolled_by') or ''
local existed = redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
if enrolled ~= '' then redis.call('SREM', ARGV[3] .. enrolled, ARGV[1]) end
if existed == 0 then return false end
return {'ok', enrolled}
"""

# KEYS: 1 worker hash. ARGV: 1 field, 2 increment. Counts on an existing record only (a result arriving
# after its worker was deleted must not recreate a partial record).
INCR_IF_EXISTS = """
if redis.call('HEXISTS', KEYS[1], 'token_sha256') == 0 then return false end
return redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
"""
