-- ARGV[4] lease in ms, ARGV[5] count, then per group: uid, claim.
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local count, base = tonumber(ARGV[5]), 6
for i = 0, count - 1 do
  local err = check_claim(ARGV[base + 2 * i], ARGV[base + 2 * i + 1], 'running')
  if err then return err end
end
local deadline = now_ms() + tonumber(ARGV[4])
for i = 0, count - 1 do
  redis.call('ZADD', P .. 'leases', deadline, ARGV[base + 2 * i])
end
return count
