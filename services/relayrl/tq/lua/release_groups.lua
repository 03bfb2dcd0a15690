-- Gives claimed groups back (running -> pending); their written trajectories are kept.
-- ARGV[4] reason, ARGV[5] count, then per group: uid, claim.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local count, base = tonumber(ARGV[5]), 6
local steps = {}
for i = 0, count - 1 do
  local err, f = check_claim(ARGV[base + 2 * i], ARGV[base + 2 * i + 1], 'pending')
  if err then return err end
  steps[i + 1] = f[2]
end
for i = 0, count - 1 do
  local uid = ARGV[base + 2 * i]
  redis.call('ZREM', P .. 'leases', uid)
  redis.call('HDEL', P .. 'g:' .. uid, 'claim', 'claimer')
  move_group(uid, 'running', 'pending', steps[i + 1], 'reason', ARGV[4])
end
redis.call('DECRBY', P .. 'launched', count)
return count
