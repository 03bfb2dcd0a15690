-- ARGV[4] count, then per group: uid, prompt_step, num_samples, digest, data.
-- Returns per group 1 (created) or 0 (already there with the same digest).
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local count, base = tonumber(ARGV[4]), 5
local created, seen = {}, {}
for i = 0, count - 1 do
  local o = base + i * 5
  local uid, dig = ARGV[o], ARGV[o + 3]
  local existing = seen[uid] or redis.call('HGET', P .. 'g:' .. uid, 'digest')
  if existing then
    if existing ~= dig then return fail('CONFLICT', uid) end
    created[i + 1] = 0
  else
    seen[uid] = dig
    created[i + 1] = 1
  end
end
local now = now_ms()
for i = 0, count - 1 do
  if created[i + 1] == 1 then
    local o = base + i * 5
    local uid, step = ARGV[o], ARGV[o + 1]
    redis.call('HSET', P .. 'g:' .. uid, 'status', 'pending', 'step', step, 'n', ARGV[o + 2],
      'digest', ARGV[o + 3], 'data', ARGV[o + 4], 'num_put', 0, 'num_failed', 0,
      'num_scored', 0, 'num_claims', 0, 'created_ms', now)
    redis.call('ZADD', P .. 'gs:pending', step, uid)
    emit('group', uid, '', 'pending', 'step', step)
  end
end
return created
