-- record.lua: how the scripts read and write a record. RedisStore puts
-- this file in front of every script that touches records.
--
-- A record is one string value: cmsgpack.pack of, in this order,
--   version, state ('p' in progress, 'c' completed, 'f' failed,
--   'r' released, 'x' cancelled: released with its attempt taken back,
--   'd' forgotten: a tombstone, see forget.lua), owner, fence (server µs),
--   lease deadline (ms, 0 when none), attempts, fingerprint, the caller's
--   key, created (ms), ended (ms, 0 until an outcome), value.
-- Format 1 holds every field as named; the scripts write format 1 only.
-- Format 2 is written by RedisStore's native Acquire of an absent key
-- (MULTI, SET ... NX PX ... GET, PEXPIRETIME, EXEC: no script), which
-- cannot put the server's time in the value. It is always state 'p',
-- attempt 1, with fence 0, the lease TTL (ms) in the deadline field and
-- TTL + retention, the PX it was written with, in the created field. The
-- rest follows from the key's expiry, the server's clock:
--   created = PEXPIRETIME - (TTL + retention)
--   deadline = created + TTL
--   fence = (created + 1) * 1000, the first µs after the creating ms
-- Go computes the same (redis.go: native). A script that rewrites a
-- format 2 record writes it as format 1 with those values.
-- A record is written with SET ... PX, so value and expiry change together,
-- or, by amend.lua, with SET ... KEEPTTL, which keeps the expiry it had.

-- fail ends the script's work on one key with an error for that key.
local function fail(msg)
  error(redis.error_reply('ERR lock: ' .. msg))
end

-- read returns the ten fields of the record at key after its version
-- (state first), in format 1 terms, or nothing when there is none.
local function read(key)
  local raw = redis.call('GET', key)
  if not raw then
    return nil
  end
  local ver, state, o, fence, deadline, attempts, fp, k, created, ended, value = cmsgpack.unpack(raw)
  if ver == 2 then
    local exp = redis.call('PEXPIRETIME', key)
    if exp < 0 then
      fail('record format version 2 without an expiry')
    end
    -- created held TTL + retention, deadline the TTL.
    created = exp - created
    fence, deadline = (created + 1) * 1000, created + deadline
  elseif ver ~= 1 then
    fail('record format version ' .. tostring(ver) .. ' unknown')
  end
  return state, o, fence, deadline, attempts, fp, k, created, ended, value
end

-- put writes a format 1 record of the given fields to expire in ms, or
-- deletes it when ms is not above 0 (as PEXPIRE 0 would).
local function put(key, ms, ...)
  if ms > 0 then
    redis.call('SET', key, cmsgpack.pack(1, ...), 'PX', ms)
  else
    redis.call('DEL', key)
  end
end

-- rewrite writes a format 1 record of the given fields in place of the one
-- at key, keeping the key's expiry as it is (KEEPTTL, Redis 6.0 or later).
local function rewrite(key, ...)
  redis.call('SET', key, cmsgpack.pack(1, ...), 'KEEPTTL')
end

-- each runs fn for every key with its n arguments from ARGV, each key
-- apart: one key's error is that key's reply alone.
local function each(n, fn)
  local out = {}
  for i = 1, #KEYS do
    local ok, res = pcall(fn, KEYS[i], unpack(ARGV, (i - 1) * n + 1, i * n))
    if ok then
      out[i] = res
    elseif type(res) == 'table' and res.err then
      out[i] = res
    else
      out[i] = {err = tostring(res)}
    end
  end
  return out
end
