-- dedup: drop the IN_PROGRESS marker of a lease that the authority released for a retry.
--
-- KEYS[1]   the record's hash
-- ARGV[1]   fencing token, decimal
--
-- Returns 1 when the marker of that token was dropped; 0 when the hash holds anything else
-- (another token, a terminal copy, nothing). Raises WRONGTYPE on foreign data.

local held = redis.call('HMGET', KEYS[1], 't', 's')
if held[1] == ARGV[1] and held[2] == 'in_progress' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
