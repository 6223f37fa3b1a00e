-- acquire.lua: take leases on idempotency records, each atomically.
-- KEYS[i]  a record (a hash); one or more per call
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

local function acquire(key, owner, ttl, retention, fingerprint, userkey)
  local keep = ttl + retention
  local r = redis.call('HMGET', key, 's', 'o', 'f', 'd', 'a', 'p', 'k', 'v')
  local state = r[1]
  if not state then
    redis.call('HSET', key, 's', 'p', 'o', owner, 'f', 1, 'd', now + ttl, 'a', 1,
      'p', fingerprint, 'k', userkey, 't', now)
    redis.call('PEXPIRE', key, keep)
    return {1, 1, 1, ttl, ''}
  end
  if r[7] ~= userkey then
    return {6, 0, 0, 0, ''}
  end

  local fence = tonumber(r[3])
  local attempts = tonumber(r[5])
  if fingerprint ~= '' and r[6] ~= '' and r[6] ~= fingerprint then
    return {5, fence, attempts, 0, ''}
  end
  if state == 'c' then
    return {2, fence, attempts, 0, r[8]}
  end
  if state == 'f' then
    return {3, fence, attempts, 0, r[8]}
  end
  if state == 'p' then
    local deadline = tonumber(r[4])
    if r[2] == owner then
      -- A retry of this same Acquire (the client resent it after a
      -- network error): the lease is already ours.
      if deadline < now + ttl then
        deadline = now + ttl
        redis.call('HSET', key, 'd', deadline)
        redis.call('PEXPIRE', key, keep)
      end
      return {1, fence, attempts, deadline - now, ''}
    end
    if deadline > now then
      return {4, fence, attempts, deadline - now, ''}
    end
  end

  -- Released by its owner, or its lease expired: a new lease, a higher fence.
  fence = fence + 1
  attempts = attempts + 1
  redis.call('HSET', key, 's', 'p', 'o', owner, 'f', fence, 'd', now + ttl, 'a', attempts)
  redis.call('PEXPIRE', key, keep)
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
