-- Trajectories read in one step: KEYS are each trajectory's tags hash and bytes key, in pairs.
-- Returns {tags as a flat field, value list (empty: no such trajectory), bytes or nil, ...}:
-- one command and one reply however many trajectories, where a pipeline costs two of each.
local out = {}
for i = 1, #KEYS, 2 do
  out[#out + 1] = redis.call('HGETALL', KEYS[i])
  out[#out + 1] = redis.call('GET', KEYS[i + 1])
end
return out
