-- finish.lua: end leases with an outcome, each compare-and-set on owner and fence.
-- (record.lua, put in front of this file, describes a record.)
-- KEYS[i]  a record; one or more per call
-- ARGV     five per key:
--   lease: the start of the format 1 record to write, packed by Go as
--     cmsgpack packs it: version 1, new state ('c' completed, 'f' failed,
--     'r' released: retry later, 'x' cancelled: released and the attempt
--     its Acquire counted taken back, never below 0), owner token, fence;
--     for a lease whose record the native Acquire made, then the deadline
--     0, the attempts, the fingerprint, the caller's key and created, up
--     to and including created (ended and value follow);
--   stored value (result or error text; '' for 'r' and 'x');
--   retention ms;
--   for a lease whose record the native Acquire made, else two '':
--     made: the exact format 2 record that Acquire wrote,
--     its PEXPIRETIME: the first ms of the fence, less 1, plus the PX it
--       was written with (TTL + retention).
-- Returns one reply per key: 1 when written (or already written by this
-- same lease), 0 when the lease is no longer held, or an error for that key
-- alone.
--
-- A record that is, byte for byte, the one the lease's native Acquire
-- wrote (its owner token is unique to that Acquire) and whose expiry is
-- still the one it was written with is in progress under that lease with
-- its fence, untouched since: no script rewrote it, since a script writes
-- format 1. Its outcome is written from lease without decoding: the record
-- the decoding path below would write, the server's clock in ended. The
-- expiry is read first; when it is the one the lease names, one SET ...
-- GET writes the outcome and returns what it replaced, and only if that
-- was not the made record (another record that happens to expire in the
-- same ms) is it put back as it was, bytes and expiry, before it is
-- judged: all within this script, so that nobody sees the swap. Every
-- other record is decoded and judged field by field.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function finish(key, lease, value, retention, made, expireAt)
  local raw
  if made ~= '' then
    local exp = redis.call('PEXPIRETIME', key)
    if exp == tonumber(expireAt) then
      -- retention is at least 1 (Go's CheckLease), passed on as the
      -- caller's digits: a Lua number would be printed and parsed again.
      raw = redis.call('SET', key, lease .. cmsgpack.pack(now, value), 'PX', retention, 'GET')
      if raw == made then
        return 1
      end
      -- exp above 0: the key was there, raw is what it held.
      redis.call('SET', key, raw, 'PXAT', exp)
    end
  end
  if not raw then
    raw = redis.call('GET', key)
  end
  local _, state, owner, fence = cmsgpack.unpack(lease)
  retention = tonumber(retention)
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

return each(5, finish)
