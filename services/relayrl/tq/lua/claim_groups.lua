-- ARGV[4] max groups for this call, ARGV[5] cap on the partition's launched counter (-1: none),
-- ARGV[6] claimer name, ARGV[7] lease in ms.
-- Returns {num_launched, uid, claim, step, data, have-csv, uid, ...}; oldest prompt step first.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local launched = tonumber(redis.call('GET', P .. 'launched') or '0')
local want, cap = tonumber(ARGV[4]), tonumber(ARGV[5])
if cap >= 0 then want = math.min(want, cap - launched) end
if want <= 0 then return {launched} end
local uids = redis.call('ZRANGE', P .. 'gs:pending', 0, want - 1)
local deadline = now_ms() + tonumber(ARGV[7])
local out = {launched + #uids}
for _, uid in ipairs(uids) do
  for _, field in ipairs(claim_pending(uid, ARGV[6], deadline)) do out[#out + 1] = field end
end
redis.call('SET', P .. 'launched', launched + #uids)
return out
