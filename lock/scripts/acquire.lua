-- acquire.lua: take leases on idempotency records, each atomically.
-- KEYS[i]  a record; one or more per call
-- ARGV     five per key, in order:
--   owner token of the Acquire call, lease TTL ms, retention ms,
--   payload fingerprint ('' = no check), the caller's key (kept to detect
--   hash collisions)
-- Returns one reply per key: {status, fence, attempts, ms left on the
-- lease, stored value}, or an error for that key alone.
-- Status: 1 acquired, 2 completed, 3 failed, 4 in progress, 5 conflict, 6 collision.
-- Time is the server's: TIME, never the client's clock.
--
-- A record is one string value: cmsgpack.pack of, in this order,
--   version (1), state ('p' in progress, 'c' completed, 'f' failed,
--   'r' released, 'x' cancelled: released with its attempt taken back),
--   owner, fence (server µs, see above), lease deadline (ms, 0 when none), attempts, fingerprint,
--   caller's key, created (ms), ended (ms, 0 until an outcome), value.
-- It is written with SET ... PX, so value and expiry change together. The
-- same layout is read and written by extend.lua and finish.lua; keep the
-- three in step. A record of another version, or of another type, is an
-- error for its key.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Fences come from the server's clock in microseconds (about 1.8e15, exact
-- in a Lua number), so that a record lost and made again still hands out a
-- fence above the lost one's: a new lease's fence is the higher of the
-- last fence + 1 and the current microsecond.
local nowus = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function put(key, ms, ...)
  if ms > 0 then
    redis.call('SET', key, cmsgpack.pack(...), 'PX', ms)
  else
    redis.call('DEL', key) -- expires at once, as PEXPIRE 0 would
  end
end

local function acquire(key, owner, ttl, retention, fingerprint, userkey)
  local keep = ttl + retention
  local raw = redis.call('GET', key)
  if not raw then
    put(key, keep, 1, 'p', owner, nowus, now + ttl, 1, fingerprint, userkey, now, 0, '')
    return {1, nowus, 1, ttl, ''}
  end
  local ver, state, o, fence, deadline, attempts, fp, k, created, ended, value = cmsgpack.unpack(raw)
  if ver ~= 1 then
    return redis.error_reply('ERR lock: record format version ' .. tostring(ver) .. ' unknown')
  end
  if k ~= userkey then
    return {6, 0, 0, 0, ''}
  end

  if fingerprint ~= '' and fp ~= '' and fp ~= fingerprint then
    return {5, fence, attempts, 0, ''}
  end
  if state == 'c' then
    return {2, fence, attempts, 0, value}
  end
  if state == 'f' then
    return {3, fence, attempts, 0, value}
  end
  if state == 'p' then
    if o == owner then
      -- A retry of this same Acquire (the client resent it after a
      -- network error): the lease is already ours.
      if deadline < now + ttl then
        deadline = now + ttl
        put(key, keep, ver, state, o, fence, deadline, attempts, fp, k, created, ended, value)
      end
      return {1, fence, attempts, deadline - now, ''}
    end
    if deadline > now then
      return {4, fence, attempts, deadline - now, ''}
    end
  end

  -- Released or cancelled by its owner, or its lease expired: a new lease,
  -- a higher fence.
  fence = math.max(fence + 1, nowus)
  attempts = attempts + 1
  put(key, keep, ver, 'p', owner, fence, now + ttl, attempts, fp, k, created, ended, value)
  return {1, fence, attempts, ttl, ''}
end

local out = {}
for i = 1, #KEYS do
  local a = (i - 1) * 5
  local ok, res = pcall(acquire, KEYS[i], ARGV[a + 1], tonumber(ARGV[a + 2]),
    tonumber(ARGV[a + 3]), ARGV[a + 4], ARGV[a + 5])
  if ok then
    out[i] = res
  elseif type(res) == 'table' and res.err then
    out[i] = res
  else
    out[i] = {err = tostring(res)}
  end
end
return out
