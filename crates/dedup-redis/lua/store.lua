-- dedup: store copies of the authority's records: IN_PROGRESS markers or terminal copies.
--
-- One call stores one or more copies: copy i is KEYS[i] with ARGV[10*(i-1)+1 .. 10*i]. On Redis
-- Cluster a call carries one key (each record's hash has a hash tag of its own); on one server a
-- backfill carries up to 128 copies (and about 1 MiB) per call instead of one.
--
-- KEYS[i]   the record's hash. One hash per idempotency key; its name carries a hash tag.
-- ARGV, per copy (o = 10*(i-1)):
-- o+1   state: 'in_progress' | 'completed' | 'failed'
-- o+2   fencing token, decimal
-- o+3   time to live, milliseconds (> 0): the lease for a marker, the retention otherwise
-- o+4   identity: scope .. '\0' .. key bytes (read back to reject foreign or colliding data)
-- o+5   attempts, decimal
-- o+6   fingerprint: 32 raw bytes, or '' for none
-- o+7   owner (in_progress), or ''
-- o+8   lease_until, microseconds on the authority's clock (in_progress), or ''
-- o+9   result bytes (completed), or ''
-- o+10  failure reason (failed), or ''
--
-- Returns one integer per copy, in order: 1 when written; 0 when refused because the hash holds
-- a newer token, or a terminal copy of the same token (a zombie's late write never replaces a
-- newer record).
-- Raises WRONGTYPE when a key holds something that is not a hash: foreign data is left alone
-- (the copies before it in the call are written, the ones after it are not).

-- Tokens are compared as decimal strings (shorter is smaller), so they stay exact past 2^53.
local function older(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end

-- Writes copy `i`; 1 when written, 0 when refused.
local function store(i)
  local k = KEYS[i]
  local o = 10 * (i - 1)
  local state, token = ARGV[o + 1], ARGV[o + 2]
  local held = redis.call('HMGET', k, 't', 's')
  local held_token, held_state = held[1], held[2]
  if held_token and string.match(held_token, '^%d+$') then
    if older(token, held_token) then return 0 end
    if held_token == token and state == 'in_progress' and held_state ~= 'in_progress' then
      return 0
    end
  end
  -- One HSET for every field (a backfill per completed key: each call inside a script costs).
  redis.call('DEL', k)
  if state == 'in_progress' then
    redis.call('HSET', k, 's', state, 't', token, 'k', ARGV[o + 4], 'a', ARGV[o + 5],
      'fp', ARGV[o + 6], 'o', ARGV[o + 7], 'lu', ARGV[o + 8])
  elseif state == 'completed' then
    redis.call('HSET', k, 's', state, 't', token, 'k', ARGV[o + 4], 'a', ARGV[o + 5],
      'fp', ARGV[o + 6], 'r', ARGV[o + 9])
  else
    redis.call('HSET', k, 's', state, 't', token, 'k', ARGV[o + 4], 'a', ARGV[o + 5],
      'fp', ARGV[o + 6], 'f', ARGV[o + 10])
  end
  redis.call('PEXPIRE', k, ARGV[o + 3])
  return 1
end

if #ARGV ~= 10 * #KEYS then
  return redis.error_reply('ERR dedup store: expected 10 arguments per key')
end

local out = {}
for i = 1, #KEYS do
  out[i] = store(i)
end
return out
