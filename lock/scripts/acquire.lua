-- acquire.lua: take leases on idempotency records, each atomically.
-- (record.lua, put in front of this file, describes a record.)
-- KEYS[i]  a record; one or more per call
-- ARGV     five per key, in order:
--   owner token of the Acquire call, lease TTL ms, retention ms,
--   payload fingerprint ('' = no check), the caller's key (kept to detect
--   hash collisions)
-- Returns one reply per key: {status, fence, attempts, ms left on the
-- lease, stored value}, or an error for that key alone.
-- Status: 1 acquired, 2 completed, 3 failed, 4 in progress, 5 conflict, 6 collision.
-- Time is the server's: TIME, never the client's clock.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Fences come from the server's clock in microseconds (about 1.8e15, exact
-- in a Lua number), so that a record lost and made again still hands out a
-- fence above the lost one's: a new lease's fence is the higher of the
-- last fence + 1 and the current microsecond.
local nowus = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function acquire(key, owner, ttl, retention, fingerprint, userkey)
  ttl, retention = tonumber(ttl), tonumber(retention)
  local keep = ttl + retention
  local state, o, fence, deadline, attempts, fp, k, created, ended, value = read(key)
  if not state or state == 'd' then
    -- No record, or a forgotten one whose fence is kept a while so that
    -- a record made again at once still gets a higher fence.
    if state then
      fence = math.max(fence + 1, nowus)
    else
      fence = nowus
    end
    put(key, keep, 'p', owner, fence, now + ttl, 1, fingerprint, userkey, now, 0, '')
    return {1, fence, 1, ttl, ''}
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
        put(key, keep, state, o, fence, deadline, attempts, fp, k, created, ended, value)
      end
      return {1, fence, attempts, deadline - now, ''}
    end
    if deadline > now then
      return {4, fence, attempts, deadline - now, ''}
    end
  end
  if o == owner then
    -- A late copy of this same Acquire: a copy sent again got the lease
    -- and its caller has released or cancelled it since, and nobody reads
    -- this reply. A new lease now would be held by nobody, block the key
    -- for a TTL and count an attempt again (one Cancel took back): answer
    -- in progress, with no time left, and change nothing.
    return {4, fence, attempts, 0, ''}
  end

  -- Released or cancelled by its owner, or its lease expired: a new lease,
  -- a higher fence.
  fence = math.max(fence + 1, nowus)
  attempts = attempts + 1
  put(key, keep, 'p', owner, fence, now + ttl, attempts, fp, k, created, ended, value)
  return {1, fence, attempts, ttl, ''}
end

return each(5, acquire)
