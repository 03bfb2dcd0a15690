-- Trajectory bytes never pass through Lua (turning a 13 KB argument into a Lua string costs
-- Redis ~18 us of its single thread): the caller SETs each payload under a staging key in the
-- same MULTI, and this script RENAMEs the staged payload into place or deletes it.
-- ARGV[4] staging prefix (the payload of item i is at <staging prefix><i>), ARGV[5] count, then
-- per trajectory: uid, index, key, claim, status (finished|failed), digest, prompt_len,
-- response_len, min_version, max_version.
-- Returns per trajectory 1 (created) or 0 (already there with the same digest).
local stage, count, base, width = ARGV[4], tonumber(ARGV[5]), 6, 10

local function discard_staged(reply)
  for i = 0, count - 1 do redis.call('DEL', stage .. i) end
  return reply
end

if not partition_exists() then return discard_staged(fail('UNKNOWN_PARTITION', PARTITION)) end
local created, seen, groups = {}, {}, {}
for i = 0, count - 1 do
  local o = base + i * width
  local uid, index, key, claim, dig = ARGV[o], tonumber(ARGV[o + 1]), ARGV[o + 2], ARGV[o + 3],
    ARGV[o + 5]
  local existing = seen[key] or redis.call('HGET', P .. 't:' .. key, 'digest')
  if existing then
    if existing ~= dig then return discard_staged(fail('CONFLICT', key)) end
    created[i + 1] = 0
  else
    local f = groups[uid]
    if not f then
      f = group_fields(uid)
      groups[uid] = f
    end
    if not f[1] then return discard_staged(fail('UNKNOWN_KEY', uid)) end
    if index >= tonumber(f[4]) then
      return discard_staged(fail('BAD_INDEX', key, tostring(index), f[4]))
    end
    local err = claim_error(uid, f, claim, 'finished')
    if err then return discard_staged(err) end
    seen[key] = dig
    created[i + 1] = 1
  end
end
-- Counters are summed here and written once per hash: a batch touches few groups.
local now = now_ms()
local order, listed, group_counts, by_status = {}, {}, {}, {}
for i = 0, count - 1 do
  if created[i + 1] == 1 then
    local o = base + i * width
    local uid, key, status = ARGV[o], ARGV[o + 2], ARGV[o + 4]
    local failed = status == 'failed'
    redis.call('RENAME', stage .. i, P .. 'td:' .. key)
    redis.call('HSET', P .. 't:' .. key, 'uid', uid, 'status', status, 'digest', ARGV[o + 5],
      'prompt_len', ARGV[o + 6], 'response_len', ARGV[o + 7], 'min_v', ARGV[o + 8],
      'max_v', ARGV[o + 9], 'is_infra', failed and 1 or 0, 'created_ms', now)
    emit('trajectory', key, '', status)
    by_status[status] = (by_status[status] or 0) + 1
    bump(group_counts, uid, 'num_put', 1)
    if failed then bump(group_counts, uid, 'num_failed', 1) end
    add_once(order, listed, uid)
  else
    redis.call('DEL', stage .. i)
  end
end
for status, n in pairs(by_status) do redis.call('HINCRBY', P .. 'tcount', status, n) end
flush_counters(group_counts, function(uid) return P .. 'g:' .. uid end)
for _, uid in ipairs(order) do settle_group(uid) end
return created
