-- A claimer that starts gives back what an earlier process of the same name left running: every
-- running group whose claimer is ARGV[4] goes back to pending (written trajectories kept), its
-- lease removed, without waiting for the lease to expire. ARGV[5] reason. Returns the uids.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local claimer, reason = ARGV[4], ARGV[5]
local released = {}
for _, uid in ipairs(redis.call('ZRANGE', P .. 'leases', 0, -1)) do
  local g = P .. 'g:' .. uid
  local f = redis.call('HMGET', g, 'status', 'step', 'claimer')
  if f[1] == 'running' and f[3] == claimer then
    redis.call('ZREM', P .. 'leases', uid)
    redis.call('HDEL', g, 'claim', 'claimer')
    redis.call('HSET', g, 'reason', reason)
    move_group(uid, 'running', 'pending', f[2], 'reason', reason)
    redis.call('DECR', P .. 'launched')
    released[#released + 1] = uid
  end
end
return released
