-- dedup: store a copy of the authority's record: an IN_PROGRESS marker or a terminal copy.
--
-- KEYS[1]   the record's hash. One hash per idempotency key; its name carries a hash tag, so
--           the script runs unchanged on Redis Cluster.
-- ARGV[1]   state: 'in_progress' | 'completed' | 'failed'
-- ARGV[2]   fencing token, decimal
-- ARGV[3]   time to live, milliseconds (> 0): the lease for a marker, the retention otherwise
-- ARGV[4]   identity: scope .. '\0' .. key bytes (read back to reject foreign or colliding data)
-- ARGV[5]   attempts, decimal
-- ARGV[6]   fingerprint: 32 raw bytes, or '' for none
-- ARGV[7]   owner (in_progress), or ''
-- ARGV[8]   lease_until, microseconds on the authority's clock (in_progress), or ''
-- ARGV[9]   result bytes (completed), or ''
-- ARGV[10]  failure reason (failed), or ''
--
-- Returns 1 when written; 0 when refused because the hash holds a newer token, or a terminal
-- copy of the same token (a zombie's late write never replaces a newer record).
-- Raises WRONGTYPE when the key holds something that is not a hash: foreign data is left alone.

-- Tokens are compared as decimal strings (shorter is smaller), so they stay exact past 2^53.
local function older(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end

local held = redis.call('HMGET', KEYS[1], 't', 's')
local held_token, held_state = held[1], held[2]
if held_token and string.match(held_token, '^%d+$') then
  if older(ARGV[2], held_token) then return 0 end
  if held_token == ARGV[2] and ARGV[1] == 'in_progress' and held_state ~= 'in_progress' then
    return 0
  end
end

-- One HSET for every field (a backfill per completed key: each call inside a script costs).
redis.call('DEL', KEYS[1])
local k = KEYS[1]
if ARGV[1] == 'in_progress' then
  redis.call('HSET', k, 's', ARGV[1], 't', ARGV[2], 'k', ARGV[4], 'a', ARGV[5], 'fp', ARGV[6],
    'o', ARGV[7], 'lu', ARGV[8])
elseif ARGV[1] == 'completed' then
  redis.call('HSET', k, 's', ARGV[1], 't', ARGV[2], 'k', ARGV[4], 'a', ARGV[5], 'fp', ARGV[6],
    'r', ARGV[9])
else
  redis.call('HSET', k, 's', ARGV[1], 't', ARGV[2], 'k', ARGV[4], 'a', ARGV[5], 'fp', ARGV[6],
    'f', ARGV[10])
end
redis.call('PEXPIRE', k, ARGV[3])
return 1
