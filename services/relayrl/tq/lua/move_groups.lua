-- Plain group transitions without a claim: reissue (failed -> pending), drop
-- (finished | scored -> dropped). ARGV[4] target status, ARGV[5] allowed source statuses
-- (comma separated), ARGV[6] reason, ARGV[7] new prompt step (-1: keep), ARGV[8] count, then uids.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local target, allowed, reason, new_step = ARGV[4], ARGV[5], ARGV[6], tonumber(ARGV[7])
local count, base = tonumber(ARGV[8]), 9
local fields, seen = {}, {}
for i = 0, count - 1 do
  local uid = ARGV[base + i]
  if seen[uid] then return fail('DUPLICATE_KEY', uid) end
  seen[uid] = true
  local err, f = check_group(uid, allowed, target)
  if err then return err end
  fields[i + 1] = f
end
for i = 0, count - 1 do
  local uid, f = ARGV[base + i], fields[i + 1]
  local step = f[2]
  if new_step >= 0 then
    step = new_step
    redis.call('HSET', P .. 'g:' .. uid, 'step', step)
  end
  redis.call('HSET', P .. 'g:' .. uid, 'reason', reason)
  move_group(uid, f[1], target, step, 'reason', reason)
end
if target == 'pending' then redis.call('DECRBY', P .. 'launched', count) end
return count
