-- Makes sure `want` scored groups are consumed at `step` and returns them all. Idempotent: a
-- retry of the same step (a trainer that crashed before its checkpoint) gets the same groups
-- back, topped up if it asks for more. ARGV[4] step, ARGV[5] want.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local step, want = ARGV[4], tonumber(ARGV[5])
local uids = redis.call('ZRANGEBYSCORE', P .. 'gs:consumed', step, step)
local need = want - #uids
if need > 0 then
  local fresh = redis.call('ZRANGE', P .. 'gs:scored', 0, need - 1)
  for _, uid in ipairs(fresh) do
    redis.call('HSET', P .. 'g:' .. uid, 'consumed_step', step)
    move_group(uid, 'scored', 'consumed', step, 'step', step)
    uids[#uids + 1] = uid
  end
end
return uids
