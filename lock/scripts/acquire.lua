-- acquire.lua: take a lease on one idempotency record, atomically.
-- KEYS[1]  the record (a hash)
-- ARGV[1]  owner token of this Acquire call
-- ARGV[2]  lease TTL, ms
-- ARGV[3]  retention, ms
-- ARGV[4]  payload fingerprint ('' = no check)
-- ARGV[5]  the caller's key, kept to detect hash collisions
-- Returns {status, fence, attempts, ms left on the lease, stored value}.
-- Status: 1 acquired, 2 completed, 3 failed, 4 in progress, 5 conflict, 6 collision.
-- Time is the server's: TIME, never the client's clock.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local keep = ttl + tonumber(ARGV[3])

local r = redis.call('HMGET', KEYS[1], 's', 'o', 'f', 'd', 'a', 'p', 'k', 'v')
local state = r[1]
if not state then
  redis.call('HSET', KEYS[1], 's', 'p', 'o', ARGV[1], 'f', 1, 'd', now + ttl, 'a', 1,
    'p', ARGV[4], 'k', ARGV[5], 't', now)
  redis.call('PEXPIRE', KEYS[1], keep)
  return {1, 1, 1, ttl, ''}
end
if r[7] ~= ARGV[5] then
  return {6, 0, 0, 0, ''}
end

local fence = tonumber(r[3])
local attempts = tonumber(r[5])
if ARGV[4] ~= '' and r[6] ~= '' and r[6] ~= ARGV[4] then
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
  if r[2] == ARGV[1] then
    -- A retry of this same Acquire (the client resent it after a network
    -- error): the lease is already ours.
    if deadline < now + ttl then
      deadline = now + ttl
      redis.call('HSET', KEYS[1], 'd', deadline)
      redis.call('PEXPIRE', KEYS[1], keep)
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
redis.call('HSET', KEYS[1], 's', 'p', 'o', ARGV[1], 'f', fence, 'd', now + ttl, 'a', attempts)
redis.call('PEXPIRE', KEYS[1], keep)
return {1, fence, attempts, ttl, ''}
