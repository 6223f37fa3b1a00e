-- forget.lua: forget one record if it is still the one an operator saw.
-- (record.lua, put in front of this file, describes a record.)
-- KEYS[1]  a record
-- ARGV     the caller's key, the state letter seen, the fence seen
-- Returns 1 when forgotten, 0 when there is no record, -1 when the record
-- is in another state or has another fence (nothing changed), -2 when the
-- record is another key's (a hash collision).
--
-- A forgotten record is not deleted at once: it becomes a tombstone,
-- state 'd', that keeps only the key and the fence for tombstoneMs. To
-- every caller it is no record at all, but a record made again while it
-- lasts gets a fence above the forgotten one's, even within the same
-- millisecond (a format 2 record's fence is rounded up to the next ms).
local tombstoneMs = 1000

local function forget(key, userkey, letter, seen)
  local state, o, fence, deadline, attempts, fp, k = read(key)
  if not state or state == 'd' then
    return 0
  end
  if k ~= userkey then
    return -2
  end
  if state ~= letter or fence ~= tonumber(seen) then
    return -1
  end
  put(key, tombstoneMs, 'd', '', fence, 0, 0, '', k, 0, 0, '')
  return 1
end

return each(3, forget)[1]
