-- Claims the named groups that are pending, in the order given (an agent runner claims the
-- group it was handed; nothing else is claimed and released on the way).
-- ARGV[4] cap on the partition's launched counter (-1: none), ARGV[5] claimer name,
-- ARGV[6] lease in ms, ARGV[7] count, then the uids.
-- Returns {num_launched, num_claimed, <5 claim fields per claimed group>...,
--          <uid, why> per group not claimed}: why is its status, 'unknown' or 'throttled'.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local launched = tonumber(redis.call('GET', P .. 'launched') or '0')
local cap, count = tonumber(ARGV[4]), tonumber(ARGV[7])
local deadline = now_ms() + tonumber(ARGV[6])
local claimed, refused, seen = {}, {}, {}
for i = 0, count - 1 do
  local uid = ARGV[8 + i]
  local status = redis.call('HGET', P .. 'g:' .. uid, 'status')
  if seen[uid] then
    status = 'named twice'
  elseif status == 'pending' and cap >= 0 and launched >= cap then
    status = 'throttled'
  end
  seen[uid] = true
  if status == 'pending' then
    claimed[#claimed + 1] = claim_pending(uid, ARGV[5], deadline)
    launched = launched + 1
  else
    refused[#refused + 1] = uid
    refused[#refused + 1] = status or 'unknown'
  end
end
redis.call('SET', P .. 'launched', launched)
local out = {launched, #claimed}
for _, fields in ipairs(claimed) do
  for _, field in ipairs(fields) do out[#out + 1] = field end
end
for _, field in ipairs(refused) do out[#out + 1] = field end
return out
