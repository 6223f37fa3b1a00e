-- extend.lua: renew held leases, each compare-and-set on owner and fence.
-- (record.lua, put in front of this file, describes a record.)
-- KEYS[i]  a record; one or more per call
-- ARGV     four per key: owner token, fence, lease TTL ms, retention ms
-- Returns one reply per key: 1 when renewed, 0 when the lease is no longer
-- held, or an error for that key alone.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function extend(key, owner, fence, ttl, retention)
  fence, ttl, retention = tonumber(fence), tonumber(ttl), tonumber(retention)
  local state, o, f, deadline, attempts, fp, k, created, ended, value = read(key)
  if not state then
    return 0
  end
  if state ~= 'p' or o ~= owner or f ~= fence then
    return 0
  end
  put(key, ttl + retention, state, o, f, now + ttl, attempts, fp, k, created, ended, value)
  return 1
end

return each(4, extend)
