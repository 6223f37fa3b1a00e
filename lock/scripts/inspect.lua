-- inspect.lua: read one record for an operator, atomically with the
-- server's clock and the key's expiry.
-- KEYS[1]  a record (the msgpack string described in acquire.lua)
-- ARGV[1]  the caller's key, to tell a hash collision from its record
-- Returns {} when there is no record, {0} for a collision, or
-- {1, state, owner, fence, ms left on the lease, attempts, fingerprint,
--  created ms, ended ms, value, ms until the record expires}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local raw = redis.call('GET', KEYS[1])
if not raw then
  return {}
end
local ver, state, o, fence, deadline, attempts, fp, k, created, ended, value = cmsgpack.unpack(raw)
if ver ~= 1 then
  return redis.error_reply('ERR lock: record format version ' .. tostring(ver) .. ' unknown')
end
if k ~= ARGV[1] then
  return {0}
end
local left = 0
if state == 'p' and deadline > now then
  left = deadline - now
end
return {1, state, o, fence, left, attempts, fp, created, ended, value, redis.call('PTTL', KEYS[1])}
