-- ARGV[4] count, then per group: uid, prompt_step, num_samples, digest, data.
-- Returns per group 1 (created) or 0 (already there with the same digest).
if not partition_exists() then return fail('UNKNOWN_PARTITION', PARTITION) end
local count = tonumber(ARGV[4])
local created = check_new_groups(5, count)
if created.err then return created end
write_new_groups(5, count, created)
return created
