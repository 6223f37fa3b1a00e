-- finish.lua: end a lease with an outcome, compare-and-set on owner and fence.
-- KEYS[1]  the record
-- ARGV[1]  owner token, ARGV[2] fence
-- ARGV[3]  new state: 'c' completed, 'f' failed, 'r' released (retry later)
-- ARGV[4]  stored value (result or error text; ignored for 'r')
-- ARGV[5]  retention ms
-- Returns 1 when written (or already written by this same lease), 0 when the
-- lease is no longer held.
local r = redis.call('HMGET', KEYS[1], 's', 'o', 'f')
if r[2] ~= ARGV[1] or r[3] ~= ARGV[2] then
  return 0
end
if r[1] == ARGV[3] then
  -- A retry of this same call that already landed.
  return 1
end
if r[1] ~= 'p' then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[3] == 'r' then
  redis.call('HSET', KEYS[1], 's', 'r', 'd', 0, 'e', now)
else
  redis.call('HSET', KEYS[1], 's', ARGV[3], 'd', 0, 'e', now, 'v', ARGV[4])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
return 1
