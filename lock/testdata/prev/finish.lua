-- finish.lua: end leases with an outcome, each compare-and-set on owner and fence.
-- (record.lua, put in front of this file, describes a record.)
-- KEYS[i]  a record; one or more per call
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
  fence, retention = tonumber(fence), tonumber(retention)
  local s, o, f, deadline, attempts, fp, k, created, ended, v = read(key)
  if not s then
    return 0
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
  put(key, retention, state, o, f, 0, attempts, fp, k, created, now, v)
  return 1
end

return each(5, finish)
