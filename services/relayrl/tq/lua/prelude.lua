-- Prepended to every TransferQueue script (relayrl.tq.scripts).
--
-- Calling convention: KEYS[1] is the namespace's partition set; ARGV[1] the partition's key
-- prefix "{<namespace>}:p:<partition>:", ARGV[2] the partition name, ARGV[3] the event stream's
-- approximate max length. Script-specific arguments start at ARGV[4].
--
-- Redis does not roll a script back when it fails half-way, so every script validates its
-- whole batch first and only then writes: an error reply means nothing was changed.
local P = ARGV[1]
local PARTITION = ARGV[2]
local MAXLEN = ARGV[3]

-- Error replies are parsed by relayrl.tq.queue into typed exceptions.
local function fail(code, ...)
  return redis.error_reply(table.concat({'RELAYRL', code, ...}, '\t'))
end

local function partition_exists()
  return redis.call('SISMEMBER', KEYS[1], PARTITION) == 1
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Stream entry ids "<ms>-<seq>" in order.
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end

local function id_less(a, b)
  local a_ms, a_seq = id_parts(a)
  local b_ms, b_seq = id_parts(b)
  return a_ms < b_ms or (a_ms == b_ms and a_seq < b_seq)
end

-- The oldest entry of `stream` that some consumer group still needs (its first pending entry,
-- or the last one delivered to it), or nil when no group reads the stream.
local function oldest_needed(stream)
  local needed = nil
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
    local id = info['last-delivered-id']
    if tonumber(info['pending']) > 0 then
      id = redis.call('XPENDING', stream, info['name'])[2]
    end
    if needed == nil or id_less(id, needed) then needed = id end
  end
  return needed
end

-- Trims the event stream towards MAXLEN entries, never past an entry a consumer group has not
-- acknowledged (or not been delivered yet): trimming loses history, never work. At most 1000
-- entries per call, so that the work per transition stays bounded.
local function trim_events()
  local stream = P .. 'events'
  local excess = redis.call('XLEN', stream) - tonumber(MAXLEN)
  if excess <= 0 then return end
  local needed = oldest_needed(stream)
  local upto = needed and ('(' .. needed) or '+'
  local old = redis.call('XRANGE', stream, '-', upto, 'COUNT', math.min(excess, 1000))
  if #old == 0 then return end
  -- MINID keeps ids >= its argument: the id just after the last entry to go
  local ms, seq = string.match(old[#old][1], '^(%d+)-(%d+)$')
  redis.call('XTRIM', stream, 'MINID', ms .. '-' .. string.format('%d', tonumber(seq) + 1))
end

-- Appends one transition to the partition's event stream, in the same atomic step.
local function emit(kind, key, from, to, ...)
  redis.call('XADD', P .. 'events', '*', 'kind', kind, 'key', key, 'from', from, 'to', to, ...)
  trim_events()
end

-- Moves a group between status indexes (sorted sets scored by prompt step, or by consumed step
-- for 'consumed') and records the transition.
local function move_group(uid, from, to, score, ...)
  redis.call('ZREM', P .. 'gs:' .. from, uid)
  redis.call('ZADD', P .. 'gs:' .. to, score, uid)
  redis.call('HSET', P .. 'g:' .. uid, 'status', to)
  emit('group', uid, from, to, ...)
end

-- A group whose every sample is written and whose every written sample is settled (scored, or
-- failed and so never scored) moves on: running -> finished -> scored.
local function settle_group(uid)
  local g = P .. 'g:' .. uid
  local f = redis.call('HMGET', g, 'status', 'step', 'n', 'num_put', 'num_failed', 'num_scored')
  local status, step, n = f[1], f[2], tonumber(f[3])
  local num_put, num_failed, num_scored = tonumber(f[4]), tonumber(f[5]), tonumber(f[6])
  if status == 'running' and num_put == n then
    redis.call('ZREM', P .. 'leases', uid)
    redis.call('HDEL', g, 'claim', 'claimer')
    move_group(uid, 'running', 'finished', step)
    status = 'finished'
  end
  if status == 'finished' and num_failed + num_scored == n then
    move_group(uid, 'finished', 'scored', step)
  end
end

-- Appends `value` to `list` unless `seen` has it: distinct values in first-seen order.
local function add_once(list, seen, value)
  if not seen[value] then
    seen[value] = true
    list[#list + 1] = value
  end
end

local function in_set(value, csv)
  for item in string.gmatch(csv, '[^,]+') do
    if item == value then return true end
  end
  return false
end

-- Checks that a group exists and is in one of the statuses `allowed` (comma separated).
-- Returns an error reply, or nil and the group's fields {status, step, claim}.
local function check_group(uid, allowed, requested)
  local f = redis.call('HMGET', P .. 'g:' .. uid, 'status', 'step', 'claim')
  if not f[1] then return fail('UNKNOWN_KEY', uid) end
  if not in_set(f[1], allowed) then return fail('ILLEGAL_TRANSITION', uid, f[1], requested) end
  return nil, f
end

local function group_fields(uid)
  return redis.call('HMGET', P .. 'g:' .. uid, 'status', 'step', 'claim', 'n')
end

-- The caller's claim must be the group's current one: a claimer whose lease expired (or who
-- released the group) must not write to it any more, whoever owns it now. `f` is
-- group_fields(uid). Returns an error reply or nil.
local function claim_error(uid, f, claim, requested)
  if not f[1] then return fail('UNKNOWN_KEY', uid) end
  if f[1] ~= 'running' then
    return fail('STALE_CLAIM', uid, f[1], requested, 'the group is no longer running')
  end
  if f[3] ~= claim then
    return fail('STALE_CLAIM', uid, f[1], requested,
      'claim ' .. claim .. ' was superseded by ' .. tostring(f[3]))
  end
  return nil
end

-- claim_error for one group; returns an error reply, or nil and the group's fields.
local function check_claim(uid, claim, requested)
  local f = group_fields(uid)
  local err = claim_error(uid, f, claim, requested)
  if err then return err end
  return nil, f
end

-- Adds `n` to counter `name` of `counters`, a table of tables keyed by owner.
local function bump(counters, owner, name, n)
  local c = counters[owner]
  if not c then
    c = {}
    counters[owner] = c
  end
  c[name] = (c[name] or 0) + n
end

-- Writes counters gathered with bump(): one HINCRBY per owner hash and field.
local function flush_counters(counters, key_of)
  for owner, c in pairs(counters) do
    for name, n in pairs(c) do
      if n ~= 0 then redis.call('HINCRBY', key_of(owner), name, n) end
    end
  end
end

-- Claims the pending group `uid` for `claimer` until `deadline` (ms since the epoch) and
-- returns what a claim reply carries: uid, claim id, prompt step, data, and the indexes of the
-- samples already written (csv). The caller checked that the group is pending.
local function claim_pending(uid, claimer, deadline)
  local g = P .. 'g:' .. uid
  local f = redis.call('HMGET', g, 'step', 'n', 'num_put', 'data')
  local claim = 'c' .. redis.call('INCR', P .. 'claimseq')
  move_group(uid, 'pending', 'running', f[1], 'claim', claim)
  redis.call('HSET', g, 'claim', claim, 'claimer', claimer)
  redis.call('HINCRBY', g, 'num_claims', 1)
  redis.call('ZADD', P .. 'leases', deadline, uid)
  local have = {}
  if tonumber(f[3]) > 0 then
    for i = 0, tonumber(f[2]) - 1 do
      if redis.call('EXISTS', P .. 't:' .. uid .. '_' .. i) == 1 then have[#have + 1] = i end
    end
  end
  return {uid, claim, f[1], f[4], table.concat(have, ',')}
end

-- Validates `count` groups given from ARGV[base] on (uid, prompt_step, num_samples, digest,
-- data each) against what is stored: returns a CONFLICT error reply when a uid exists with
-- other content (nothing is written then), else the list of flags 1 (to create) / 0 (there).
local function check_new_groups(base, count)
  local created, seen = {}, {}
  for i = 0, count - 1 do
    local o = base + i * 5
    local uid, dig = ARGV[o], ARGV[o + 3]
    local existing = seen[uid] or redis.call('HGET', P .. 'g:' .. uid, 'digest')
    if existing then
      if existing ~= dig then return fail('CONFLICT', uid) end
      created[i + 1] = 0
    else
      seen[uid] = dig
      created[i + 1] = 1
    end
  end
  return created
end

-- Writes the groups `check_new_groups` flagged as new, pending.
local function write_new_groups(base, count, created)
  local now = now_ms()
  for i = 0, count - 1 do
    if created[i + 1] == 1 then
      local o = base + i * 5
      local uid, step = ARGV[o], ARGV[o + 1]
      redis.call('HSET', P .. 'g:' .. uid, 'status', 'pending', 'step', step, 'n', ARGV[o + 2],
        'digest', ARGV[o + 3], 'data', ARGV[o + 4], 'num_put', 0, 'num_failed', 0,
        'num_scored', 0, 'num_claims', 0, 'created_ms', now)
      redis.call('ZADD', P .. 'gs:pending', step, uid)
      emit('group', uid, '', 'pending', 'step', step)
    end
  end
end
