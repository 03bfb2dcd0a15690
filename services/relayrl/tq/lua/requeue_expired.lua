-- Returns running groups whose lease has expired to pending (their claimer is presumed dead).
-- ARGV[4] max groups. Returns the requeued uids.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local uids = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', now_ms(), 'LIMIT', 0,
  tonumber(ARGV[4]))
local requeued = {}
for _, uid in ipairs(uids) do
  redis.call('ZREM', P .. 'leases', uid)
  local g = P .. 'g:' .. uid
  local f = redis.call('HMGET', g, 'status', 'step')
  -- Only running groups hold a lease; a lease left behind by anything else is just removed.
  if f[1] == 'running' then
    redis.call('HDEL', g, 'claim', 'claimer')
    move_group(uid, 'running', 'pending', f[2], 'reason', 'lease_expired')
    redis.call('DECR', P .. 'launched')
    requeued[#requeued + 1] = uid
  end
end
return requeued
