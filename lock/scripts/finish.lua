-- finish.lua: end leases with an outcome, each compare-and-set on owner and fence.
-- KEYS[i]  a record; one or more per call
-- ARGV     five per key: owner token, fence, new state ('c' completed,
--          'f' failed, 'r' released: retry later), stored value (result or
--          error text; ignored for 'r'), retention ms
-- Returns one reply per key: 1 when written (or already written by this
-- same lease), 0 when the lease is no longer held, or an error for that key
-- alone.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function finish(key, owner, fence, state, value, retention)
  local r = redis.call('HMGET', key, 's', 'o', 'f')
  if r[2] ~= owner or r[3] ~= fence then
    return 0
  end
  if r[1] == state then
    -- A retry of this same call that already landed.
    return 1
  end
  if r[1] ~= 'p' then
    return 0
  end
  if state == 'r' then
    redis.call('HSET', key, 's', 'r', 'd', 0, 'e', now)
  else
    redis.call('HSET', key, 's', state, 'd', 0, 'e', now, 'v', value)
  end
  redis.call('PEXPIRE', key, retention)
  return 1
end

local out = {}
for i = 1, #KEYS do
  local a = (i - 1) * 5
  local ok, res = pcall(finish, KEYS[i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], tonumber(ARGV[a + 5]))
  if ok then
    out[i] = res
  elseif type(res) == 'table' and res.err then
    out[i] = res
  else
    out[i] = {err = tostring(res)}
  end
end
return out
