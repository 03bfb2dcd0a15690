-- A claimer ends its claims: gives the groups back (running -> pending; their written
-- trajectories are kept) or gives up on them (running -> failed).
-- ARGV[4] target status (pending|failed), ARGV[5] reason, ARGV[6] count, then per group:
-- uid, claim.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local target, reason = ARGV[4], ARGV[5]
local count, base = tonumber(ARGV[6]), 7
local steps = {}
for i = 0, count - 1 do
  local err, f = check_claim(ARGV[base + 2 * i], ARGV[base + 2 * i + 1], target)
  if err then return err end
  steps[i + 1] = f[2]
end
for i = 0, count - 1 do
  local uid = ARGV[base + 2 * i]
  local g = P .. 'g:' .. uid
  redis.call('ZREM', P .. 'leases', uid)
  redis.call('HDEL', g, 'claim', 'claimer')
  redis.call('HSET', g, 'reason', reason)
  move_group(uid, 'running', target, steps[i + 1], 'reason', reason)
end
-- A failed group stays launched until it is reissued; a released one is back in the pool.
if target == 'pending' then redis.call('DECRBY', P .. 'launched', count) end
return count
