-- Puts groups and claims them in one step, all or nothing: an agent's own groups (or an ad-hoc
-- session's) are never left pending for another claimer to take, and a full throttle or a
-- uid that exists with other content writes nothing.
-- ARGV[4] cap on the partition's launched counter (-1: none), ARGV[5] claimer name,
-- ARGV[6] lease in ms, ARGV[7] count, then per group: uid, prompt_step, num_samples, digest,
-- data. A uid already there with the same content is claimed if it is pending.
-- Returns claim_named's reply.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local cap, count = tonumber(ARGV[4]), tonumber(ARGV[7])
local created = check_new_groups(8, count)
if created.err then return created end
local launched = tonumber(redis.call('GET', P .. 'launched') or '0')
local out = {launched, 0}
local claimable = {}
for i = 0, count - 1 do
  local uid = ARGV[8 + i * 5]
  local status = 'pending'
  if created[i + 1] == 0 then status = redis.call('HGET', P .. 'g:' .. uid, 'status') end
  if status == 'pending' then
    claimable[#claimable + 1] = uid
  else
    out[#out + 1] = uid
    out[#out + 1] = status
  end
end
if cap >= 0 and launched + #claimable > cap then
  -- nothing is written: every group comes back throttled
  out = {launched, 0}
  for i = 0, count - 1 do
    out[#out + 1] = ARGV[8 + i * 5]
    out[#out + 1] = 'throttled'
  end
  return out
end
write_new_groups(8, count, created)
local deadline = now_ms() + tonumber(ARGV[6])
local claimed = {}
for _, uid in ipairs(claimable) do claimed[#claimed + 1] = claim_pending(uid, ARGV[5], deadline) end
launched = launched + #claimed
redis.call('SET', P .. 'launched', launched)
local reply = {launched, #claimed}
for _, fields in ipairs(claimed) do
  for _, field in ipairs(fields) do reply[#reply + 1] = field end
end
for i = 3, #out do reply[#reply + 1] = out[i] end
return reply
