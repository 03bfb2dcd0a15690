-- A trainer restored the checkpoint of step ARGV[4]: groups it consumed after that step go back
-- to scored, so they are trained exactly once. Returns the uids.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local uids = redis.call('ZRANGEBYSCORE', P .. 'gs:consumed', '(' .. ARGV[4], '+inf')
for _, uid in ipairs(uids) do
  local g = P .. 'g:' .. uid
  local f = redis.call('HMGET', g, 'step', 'consumed_step')
  redis.call('HDEL', g, 'consumed_step')
  move_group(uid, 'consumed', 'scored', f[1], 'reason', 'reset_after_' .. ARGV[4])
end
return uids
