"""Lua scripts of result intake (coordinator.intake): each batch's checks that depend on mutable state, its
dedupe (`HSETNX`) and its `XADD` to the run's stream run as one script, so a crash can never record a result
without streaming it or the reverse (Redis runs a script atomically). The staleness check is
wire.staleness's Lua twin `is_stale`, prepended to `INTAKE`.
"""

from __future__ import annotations

from wire.staleness import IS_STALE_LUA

# KEYS: 1 round hash, 2 seeds set, 3 accepted hash, 4 stream, 5 run hash, 6 worker hash, 7 attested set,
# 8 spot hash. ARGV: 1 worker id, 2 round version, then triples (seed, mode, payload); mode "a" accepts
# and streams, "0"/"1"/"2" holds a spot-check replica. Stale and duplicate results are also counted on
# run hash (n_stale, n_duplicate): the trainer reads them (IntakeCounts) with the results it collects,
# this intake being the one authority on which results count.
INTAKE = IS_STALE_LUA + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  if redis.call('EXISTS', KEYS[5]) == 0 then return {'unknown_run'} end
  return {'unknown_round'}
end
local latest = tonumber(redis.call('HGET', KEYS[5], 'latest_version'))
local age = latest - tonumber(ARGV[2])
if is_stale(tonumber(ARGV[2]), latest, tonumber(redis.call('HGET', KEYS[5], 'staleness'))) then
  redis.call('HINCRBY', KEYS[5], 'n_stale', (#ARGV - 2) / 3)
  return {'stale', age}
end
if state ~= 'open' then return {'closed_round'} end
if redis.call('HGET', KEYS[6], 'state') == 'quarantined' then return {'quarantined'} end
if redis.call('HGET', KEYS[5], 'canary') == '1' and redis.call('SISMEMBER', KEYS[7], ARGV[1]) == 0 then
  return {'unattested'}
end
local out = {'ok', age, 0, 0, 0}
local accepted = 0
for i = 3, #ARGV, 3 do
  local seed, mode, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('SISMEMBER', KEYS[2], seed) == 0 then out[#out + 1] = 'unknown_seed'
  elseif mode == 'a' then
    if redis.call('HSETNX', KEYS[3], seed, payload) == 0 then
      redis.call('HINCRBY', KEYS[5], 'n_duplicate', 1)
      out[#out + 1] = 'duplicate'
    else
      redis.call('XADD', KEYS[4], '*', 'e', payload)
      accepted = accepted + 1
      out[#out + 1] = 'accepted'
    end
  else
    local field = seed .. ':' .. mode
    local same = false
    for r = 0, 2 do
      if tostring(r) ~= mode and redis.call('HGET', KEYS[8], seed .. ':' .. r .. ':w') == ARGV[1] then same = true end
    end
    if redis.call('HEXISTS', KEYS[8], field) == 1 then
      redis.call('HINCRBY', KEYS[5], 'n_duplicate', 1)
      out[#out + 1] = 'duplicate'
    elseif same then out[#out + 1] = 'same_worker'
    else
      redis.call('HSET', KEYS[8], field, payload, field .. ':w', ARGV[1])
      out[#out + 1] = 'held'
    end
  end
end
if accepted > 0 then
  out[3] = redis.call('HINCRBY', KEYS[1], 'done', accepted)
  out[4] = tonumber(redis.call('HGET', KEYS[1], 'n_seeds'))
  out[5] = redis.call('HGET', KEYS[1], 'created_at')
  if redis.call('HEXISTS', KEYS[6], 'token_sha256') == 1 then redis.call('HINCRBY', KEYS[6], 'accepted', accepted) end
end
return out
"""

# KEYS: 1 round hash, 2 accepted hash, 3 stream. ARGV: seed, event. Returns the new `done` or -1.
PUBLISH = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return -1 end
redis.call('XADD', KEYS[3], '*', 'e', ARGV[2])
return redis.call('HINCRBY', KEYS[1], 'done', 1)
"""

# KEYS: 1 round hash, 2 accepted hash, 3 stream. ARGV: seed, expected event, retraction event.
RETRACT = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'done', -1)
redis.call('XADD', KEYS[3], '*', 'e', ARGV[3])
return 1
"""
