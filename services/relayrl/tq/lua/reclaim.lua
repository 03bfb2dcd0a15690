-- Consumer-group housekeeping for one reader, atomically: entries idle longer than ARGV[3] ms
-- (their reader presumably died) are claimed for reader ARGV[2], except those already delivered
-- ARGV[5] times or more, which go to the dead-letter stream KEYS[2] and are acknowledged.
-- KEYS[1] stream, ARGV[1] group, ARGV[4] max entries. The dead-letter stream is never trimmed:
-- each entry waits for an operator (`relayrl tq redrive`).
-- Returns {num_dead, id, deliveries, {field, value, ...}, id, ...}.
local stream, dead_stream, group, reader = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local min_idle, max_deliveries = ARGV[3], tonumber(ARGV[5])
local pending = redis.call('XPENDING', stream, group, 'IDLE', min_idle, '-', '+', ARGV[4])
local to_claim, deliveries, num_dead = {}, {}, 0
for _, p in ipairs(pending) do
  local id, count = p[1], tonumber(p[4])
  if count >= max_deliveries then
    local entry = redis.call('XRANGE', stream, id, id)
    local fields = entry[1] and entry[1][2] or {}
    for _, extra in ipairs({'dead_id', id, 'dead_group', group, 'dead_reader', p[2],
                            'dead_deliveries', tostring(count)}) do
      fields[#fields + 1] = extra
    end
    redis.call('XADD', dead_stream, '*', unpack(fields))
    redis.call('XACK', stream, group, id)
    num_dead = num_dead + 1
  else
    to_claim[#to_claim + 1] = id
    deliveries[id] = count + 1
  end
end
local out = {num_dead}
if #to_claim > 0 then
  for _, entry in ipairs(redis.call('XCLAIM', stream, group, reader, min_idle,
                                    unpack(to_claim))) do
    out[#out + 1] = entry[1]
    out[#out + 1] = deliveries[entry[1]]
    out[#out + 1] = entry[2]
  end
end
return out
