-- Versioned cache fill for applications behind a refract `redis` sink with
-- `command = "tombstone"` (see docs/sinks/redis.md, "Stale sets").
--
-- A reader that missed the cache, read a row from the primary store and then caches it can lose
-- a race: the row changes and refract deletes the key between the reader's read and its SET,
-- and the SET puts the old row back until the TTL ends. With tombstones, refract replaces the key
-- by `refract-tombstone:{version}` (the version of the row the change produced) instead of
-- deleting it, and readers fill the cache through this script, which refuses a value older than
-- the tombstone or than the value already cached. Readers treat a value starting with
-- `refract-tombstone:` as a miss.
--
--   EVALSHA <sha> 1 <key> <row version> <value> <ttl ms>
--   -> 1 when cached (stored as "<version>|<value>"), 0 when refused as stale.
--
-- The version is the column named `version_column` in the pipeline file: an integer that grows
-- with every change of the row, or a timestamp (as microseconds since the epoch).
local cur = redis.call('GET', KEYS[1])
if cur then
  local v = string.match(cur, '^refract%-tombstone:(%-?%d+)$') or string.match(cur, '^(%-?%d+)|')
  if v and tonumber(v) > tonumber(ARGV[1]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. ARGV[2], 'PX', ARGV[3])
return 1
