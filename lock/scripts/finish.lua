-- finish.lua: end leases with an outcome, each compare-and-set on owner and fence.
-- (record.lua, put in front of this file, describes a record.)
-- KEYS[i]  a record; one or more per call
-- ARGV     eight per key: owner token, fence, new state ('c' completed,
--          'f' failed, 'r' released: retry later, 'x' cancelled: released
--          and the attempt its Acquire counted taken back, never below 0),
--          stored value (result or error text; ignored for 'r' and 'x'),
--          retention ms; then, for a lease whose record the native
--          Acquire made, else three '':
--            made: the exact format 2 record that Acquire wrote,
--            its PEXPIRETIME: the first ms of the fence, less 1, plus
--              the PX it was written with (TTL + retention),
--            head: the format 1 record to write, packed up to and
--              including its created field (ended and value follow).
-- Returns one reply per key: 1 when written (or already written by this
-- same lease), 0 when the lease is no longer held, or an error for that key
-- alone.
--
-- A record that is, byte for byte, the one the lease's native Acquire
-- wrote (its owner token is unique to that Acquire) and whose expiry is
-- still the one it was written with is in progress under that lease with
-- its fence, untouched since: no script rewrote it, since a script writes
-- format 1. It is written from head without being decoded: the record is
-- the one the decoding path below would write, the server's clock in
-- ended. Every other record is decoded and judged field by field.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function finish(key, owner, fence, state, value, retention, made, expireAt, head)
  local raw = redis.call('GET', key)
  if made ~= '' and raw == made and redis.call('PEXPIRETIME', key) == tonumber(expireAt) then
    local v = ''
    if state == 'c' or state == 'f' then
      v = value
    end
    -- retention is at least 1 (Go's CheckLease), passed on as the caller's
    -- digits: a Lua number would be printed and parsed again.
    redis.call('SET', key, head .. cmsgpack.pack(now, v), 'PX', retention)
    return 1
  end
  fence, retention = tonumber(fence), tonumber(retention)
  local s, o, f, deadline, attempts, fp, k, created, ended, v = decode(key, raw)
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

return each(8, finish)
