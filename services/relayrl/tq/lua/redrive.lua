-- Dead letters back into the event stream: each one is appended again as a new entry (its own
-- fields, without the dead_* bookkeeping, plus `redriven_from`), so the consumer group that gave
-- up on it reads it again, and is removed from the dead-letter stream, atomically.
-- KEYS[1] event stream, KEYS[2] dead-letter stream; ARGV[1] max entries, ARGV[2] number of
-- dead-letter ids given (0: the oldest ARGV[1] entries), then the ids.
-- Returns the ids of the new event entries; an id that is not a dead letter is an error.
local stream, dead_stream = KEYS[1], KEYS[2]
local max_entries, num_ids = tonumber(ARGV[1]), tonumber(ARGV[2])
local entries = {}
if num_ids == 0 then
  entries = redis.call('XRANGE', dead_stream, '-', '+', 'COUNT', max_entries)
else
  for i = 1, num_ids do
    local found = redis.call('XRANGE', dead_stream, ARGV[2 + i], ARGV[2 + i])
    if #found == 0 then
      return redis.error_reply('RELAYRL\tUNKNOWN_KEY\tdead letter ' .. ARGV[2 + i])
    end
    entries[#entries + 1] = found[1]
  end
end
local added = {}
for _, entry in ipairs(entries) do
  local id, fields = entry[1], entry[2]
  local kept = {}
  for i = 1, #fields, 2 do
    if string.sub(fields[i], 1, 5) ~= 'dead_' then
      kept[#kept + 1] = fields[i]
      kept[#kept + 1] = fields[i + 1]
    end
  end
  kept[#kept + 1] = 'redriven_from'
  kept[#kept + 1] = id
  added[#added + 1] = redis.call('XADD', stream, '*', unpack(kept))
  redis.call('XDEL', dead_stream, id)
end
return added
