-- finish.lua: end leases with an outcome, each compare-and-set on owner and fence.
-- KEYS[i]  a record (the msgpack string described in acquire.lua); one or
--          more per call
-- ARGV     five per key: owner token, fence, new state ('c' completed,
--          'f' failed, 'r' released: retry later, 'x' cancelled: released
--          and the attempt its Acquire counted taken back, never below 0),
--          stored value (result or error text; ignored for 'r' and 'x'),
--          retention ms
-- Returns one reply per key: 1 when written (or already written by this
-- same lease), 0 when the lease is no longer held, or an error for that key
-- alone.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function finish(key, owner, fence, state, value, retention)
  local raw = redis.call('GET', key)
  if not raw then
    return 0
  end
  local ver, s, o, f, deadline, attempts, fp, k, created, ended, v = cmsgpack.unpack(raw)
  if ver ~= 1 then
    return redis.error_reply('ERR lock: record format version ' .. tostring(ver) .. ' unknown')
  end
  if o ~= owner or f ~= fence then
    return 0
  end
  if s == state then
    -- A retry of this same call that already landed (for 'x': the attempt
    -- was taken back then, not again now).
    return 1
  end
  if s ~= 'p' then
    return 0
  end
  if state == 'x' then
    if attempts > 0 then
      attempts = attempts - 1
    end
  elseif state ~= 'r' then
    v = value
  end
  if retention > 0 then
    redis.call('SET', key, cmsgpack.pack(ver, state, o, f, 0, attempts, fp, k, created, now, v), 'PX', retention)
  else
    redis.call('DEL', key) -- expires at once, as PEXPIRE 0 would
  end
  return 1
end

local out = {}
for i = 1, #KEYS do
  local a = (i - 1) * 5
  local ok, res = pcall(finish, KEYS[i], ARGV[a + 1], tonumber(ARGV[a + 2]), ARGV[a + 3], ARGV[a + 4],
    tonumber(ARGV[a + 5]))
  if ok then
    out[i] = res
  elseif type(res) == 'table' and res.err then
    out[i] = res
  else
    out[i] = {err = tostring(res)}
  end
end
return out
