-- dedup: move the IN_PROGRESS marker of a lease the authority extended (the heartbeat).
--
-- KEYS[1]   the record's hash
-- ARGV[1]   fencing token, decimal
-- ARGV[2]   new lease_until, microseconds on the authority's clock
-- ARGV[3]   new time to live, milliseconds (> 0)
--
-- Returns 1 when the marker of that token was moved; 0 when the hash holds anything else.
-- Raises WRONGTYPE on foreign data.

local held = redis.call('HMGET', KEYS[1], 't', 's')
if held[1] == ARGV[1] and held[2] == 'in_progress' then
  redis.call('HSET', KEYS[1], 'lu', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
