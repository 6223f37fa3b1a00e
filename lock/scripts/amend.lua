-- amend.lua: change the stored value of completed records, each
-- compare-and-set on fence and value. Nothing else in the record changes,
-- its expiry included (rewrite: SET ... KEEPTTL).
-- (record.lua, put in front of this file, describes a record.)
-- KEYS[i]  a record; one or more per call
-- ARGV     four per key: the caller's key (to detect hash collisions),
--          fence, the value the caller saw, the new value
-- Returns one reply per key: 1 when the record holds the new value (written
-- now, or already: a retry of this same call, or another writer's same
-- bytes), 0 when it is not the completed record with that fence and the
-- value seen (nothing changed), -1 when it is another key's record (a hash
-- collision), or an error for that key alone.

local function amend(key, userkey, fence, old, value)
  fence = tonumber(fence)
  local s, o, f, deadline, attempts, fp, k, created, ended, v = read(key)
  if not s or s == 'd' then
    return 0
  end
  if k ~= userkey then
    return -1
  end
  if s ~= 'c' or f ~= fence then
    return 0
  end
  if v == value then
    return 1
  end
  if v ~= old then
    return 0
  end
  rewrite(key, s, o, f, deadline, attempts, fp, k, created, ended, value)
  return 1
end

return each(4, amend)
