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
  local g = P .. 'g:' .. uid
  local f = redis.call('HMGET', g, 'step', 'n', 'num_put', 'data')
  local claim = 'c' .. redis.call('INCR', P .. 'claimseq')
  move_group(uid, 'pending', 'running', f[1], 'claim', claim)
  redis.call('HSET', g, 'claim', claim, 'claimer', ARGV[6])
  redis.call('HINCRBY', g, 'num_claims', 1)
  redis.call('ZADD', P .. 'leases', deadline, uid)
  local have = {}
  if tonumber(f[3]) > 0 then
    for i = 0, tonumber(f[2]) - 1 do
      if redis.call('EXISTS', P .. 't:' .. uid .. '_' .. i) == 1 then have[#have + 1] = i end
    end
  end
  out[#out + 1] = uid
  out[#out + 1] = claim
  out[#out + 1] = f[1]
  out[#out + 1] = f[4]
  out[#out + 1] = table.concat(have, ',')
end
redis.call('SET', P .. 'launched', launched + #uids)
return out
