-- ARGV[4] count, then per trajectory: uid, index, key, claim, status (finished|failed), digest,
-- data, prompt_len, response_len, min_version, max_version.
-- Returns per trajectory 1 (created) or 0 (already there with the same digest).
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local count, base, width = tonumber(ARGV[4]), 5, 11
local created, seen = {}, {}
for i = 0, count - 1 do
  local o = base + i * width
  local uid, index, key, claim, dig = ARGV[o], tonumber(ARGV[o + 1]), ARGV[o + 2], ARGV[o + 3],
    ARGV[o + 5]
  local existing = seen[key] or redis.call('HGET', P .. 't:' .. key, 'digest')
  if existing then
    if existing ~= dig then return fail('CONFLICT', key) end
    created[i + 1] = 0
  else
    local f = redis.call('HMGET', P .. 'g:' .. uid, 'status', 'n')
    if not f[1] then return fail('UNKNOWN_KEY', uid) end
    if index >= tonumber(f[2]) then
      return fail('BAD_INDEX', key, tostring(index), f[2])
    end
    local err = check_claim(uid, claim, 'finished')
    if err then return err end
    seen[key] = dig
    created[i + 1] = 1
  end
end
local now = now_ms()
local groups, order = {}, {}
for i = 0, count - 1 do
  if created[i + 1] == 1 then
    local o = base + i * width
    local uid, key, status = ARGV[o], ARGV[o + 2], ARGV[o + 4]
    local failed = status == 'failed'
    redis.call('HSET', P .. 't:' .. key, 'uid', uid, 'status', status, 'digest', ARGV[o + 5],
      'data', ARGV[o + 6], 'prompt_len', ARGV[o + 7], 'response_len', ARGV[o + 8],
      'min_v', ARGV[o + 9], 'max_v', ARGV[o + 10], 'is_infra', failed and 1 or 0,
      'created_ms', now)
    redis.call('HINCRBY', P .. 'tcount', status, 1)
    local g = P .. 'g:' .. uid
    redis.call('HINCRBY', g, 'num_put', 1)
    if failed then redis.call('HINCRBY', g, 'num_failed', 1) end
    emit('trajectory', key, '', status)
    add_once(order, groups, uid)
  end
end
for _, uid in ipairs(order) do settle_group(uid) end
return created
