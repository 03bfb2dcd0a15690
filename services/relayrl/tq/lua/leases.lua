-- The running groups' leases, read in one step: KEYS[1] the partition's lease index, ARGV[1] its
-- key prefix. Returns {uid, deadline (ms), claim id, claimer, uid, ...}, earliest deadline first.
local out = {}
local leases = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #leases, 2 do
  local uid = leases[i]
  local f = redis.call('HMGET', ARGV[1] .. 'g:' .. uid, 'claim', 'claimer')
  out[#out + 1] = uid
  out[#out + 1] = leases[i + 1]
  out[#out + 1] = f[1] or ''
  out[#out + 1] = f[2] or ''
end
return out
