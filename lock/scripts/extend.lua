-- extend.lua: renew held leases, each compare-and-set on owner and fence.
-- KEYS[i]  a record (the msgpack string described in acquire.lua); one or
--          more per call
-- ARGV     four per key: owner token, fence, lease TTL ms, retention ms
-- Returns one reply per key: 1 when renewed, 0 when the lease is no longer
-- held, or an error for that key alone.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function extend(key, owner, fence, ttl, retention)
  local raw = redis.call('GET', key)
  if not raw then
    return 0
  end
  local ver, state, o, f, deadline, attempts, fp, k, created, ended, value = cmsgpack.unpack(raw)
  if ver ~= 1 then
    return redis.error_reply('ERR lock: record format version ' .. tostring(ver) .. ' unknown')
  end
  if state ~= 'p' or o ~= owner or f ~= fence then
    return 0
  end
  redis.call('SET', key, cmsgpack.pack(ver, state, o, f, now + ttl, attempts, fp, k, created, ended, value),
    'PX', ttl + retention)
  return 1
end

local out = {}
for i = 1, #KEYS do
  local a = (i - 1) * 4
  local ok, res = pcall(extend, KEYS[i], ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4]))
  if ok then
    out[i] = res
  elseif type(res) == 'table' and res.err then
    out[i] = res
  else
    out[i] = {err = tostring(res)}
  end
end
return out
