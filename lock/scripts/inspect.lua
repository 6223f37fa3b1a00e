-- inspect.lua: read one record for an operator, atomically with the
-- server's clock and the key's expiry.
-- (record.lua, put in front of this file, describes a record.)
-- KEYS[1]  a record
-- ARGV[1]  the caller's key, to tell a hash collision from its record
-- Returns {} when there is no record (a forgotten one included), {0} for a
-- collision, or {1, state, owner, fence, ms left on the lease, attempts,
-- fingerprint, created ms, ended ms, value, ms until the record expires}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function inspect(key, userkey)
  local state, o, fence, deadline, attempts, fp, k, created, ended, value = read(key)
  if not state or state == 'd' then
    return {}
  end
  if k ~= userkey then
    return {0}
  end
  local left = 0
  if state == 'p' and deadline > now then
    left = deadline - now
  end
  return {1, state, o, fence, left, attempts, fp, created, ended, value, redis.call('PTTL', key)}
end

return each(1, inspect)[1]
