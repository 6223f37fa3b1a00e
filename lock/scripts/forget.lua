-- forget.lua: delete one record if it is still the one an operator saw.
-- KEYS[1]  a record (the msgpack string described in acquire.lua)
-- ARGV     the caller's key, the state letter seen, the fence seen
-- Returns 1 when deleted, 0 when there is no record, -1 when the record
-- is in another state or has another fence (nothing deleted), -2 when the
-- record is another key's (a hash collision).
local raw = redis.call('GET', KEYS[1])
if not raw then
  return 0
end
local ver, state, o, fence, deadline, attempts, fp, k = cmsgpack.unpack(raw)
if ver ~= 1 then
  return redis.error_reply('ERR lock: record format version ' .. tostring(ver) .. ' unknown')
end
if k ~= ARGV[1] then
  return -2
end
if state ~= ARGV[2] or fence ~= tonumber(ARGV[3]) then
  return -1
end
redis.call('DEL', KEYS[1])
return 1
