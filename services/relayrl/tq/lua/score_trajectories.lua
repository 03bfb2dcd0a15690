-- ARGV[4] count, then per trajectory: key, reward_status (int), is_infra (0|1), reward bytes.
-- Returns per trajectory 1 (scored now) or 0 (already scored: the first score stands).
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local count, base, width = tonumber(ARGV[4]), 5, 4
local scored, uids, seen = {}, {}, {}
for i = 0, count - 1 do
  local key = ARGV[base + i * width]
  local f = redis.call('HMGET', P .. 't:' .. key, 'status', 'uid')
  if not f[1] then return fail('UNKNOWN_KEY', key) end
  if f[1] == 'failed' then return fail('ILLEGAL_TRANSITION', key, 'failed', 'scored') end
  if f[1] == 'scored' or seen[key] then
    scored[i + 1] = 0
  else
    seen[key] = true
    scored[i + 1] = 1
    uids[i + 1] = f[2]
  end
end
local now = now_ms()
local order, listed, group_counts, num_scored = {}, {}, {}, 0
for i = 0, count - 1 do
  if scored[i + 1] == 1 then
    local o = base + i * width
    local key, uid = ARGV[o], uids[i + 1]
    redis.call('HSET', P .. 't:' .. key, 'status', 'scored', 'reward_status', ARGV[o + 1],
      'is_infra', ARGV[o + 2], 'reward', ARGV[o + 3], 'scored_ms', now)
    emit('trajectory', key, 'finished', 'scored')
    bump(group_counts, uid, 'num_scored', 1)
    num_scored = num_scored + 1
    add_once(order, listed, uid)
  end
end
if num_scored > 0 then
  redis.call('HINCRBY', P .. 'tcount', 'finished', -num_scored)
  redis.call('HINCRBY', P .. 'tcount', 'scored', num_scored)
end
flush_counters(group_counts, function(uid) return P .. 'g:' .. uid end)
for _, uid in ipairs(order) do settle_group(uid) end
return scored
