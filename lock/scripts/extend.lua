-- extend.lua: renew a held lease, compare-and-set on owner and fence.
-- KEYS[1]  the record
-- ARGV[1]  owner token, ARGV[2] fence, ARGV[3] lease TTL ms, ARGV[4] retention ms
-- Returns 1 when renewed, 0 when the lease is no longer held.
local r = redis.call('HMGET', KEYS[1], 's', 'o', 'f')
if r[1] ~= 'p' or r[2] ~= ARGV[1] or r[3] ~= ARGV[2] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'd', now + ttl)
redis.call('PEXPIRE', KEYS[1], ttl + tonumber(ARGV[4]))
return 1
