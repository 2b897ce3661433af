-- settle.lua: end of a batch of requests. Release their concurrency leases and replace their
-- token reservation with the actual count (-1 = unknown: keep the reservation).
-- Idempotent: the request record is deleted, so a second settlement finds nothing.
-- actual_tokens = -3 only releases the concurrency leases (the response ended; its usage
-- event is not yet durable, and the rest of the settlement waits for that).
-- actual_tokens = -2 voids an admission whose caller gave up waiting (deadline): a tombstone
-- makes a late-running admit.lua refuse it, and anything it already committed is undone.
-- actual_tokens = -4 abandons it: nobody will report its end, so the next sweep claims it
-- (its lease's expiry is moved to the past) and bills its last checkpoint.
-- ARGV[1] n, then per request: rid, actual_tokens
local function split(s)
  local out = {}
  for part in string.gmatch(s or '', '[^\n]+') do out[#out + 1] = part end
  return out
end

local n = tonumber(ARGV[1])
local settled = 0
for r = 0, n - 1 do
  local rid, actual = ARGV[2 + r * 2], tonumber(ARGV[3 + r * 2])
  local rk = 'gw:req:' .. rid
  if actual == -2 then
    redis.call('SET', 'gw:void:' .. rid, 1, 'PX', 600000)
    actual = 0
  end
  local rec = redis.call('HMGET', rk, 'r', 'c', 't')
  if actual == -4 then
    redis.call('ZADD', 'gw:reqs', 'XX', 0, rid)
  elseif rec[1] and actual == -3 then
    for _, zk in ipairs(split(rec[2])) do redis.call('ZREM', zk, rid) end
    redis.call('HSET', rk, 'c', '')
  elseif rec[1] then
    for _, zk in ipairs(split(rec[2])) do redis.call('ZREM', zk, rid) end
    if actual >= 0 then
      local delta = actual - tonumber(rec[1])
      for _, tk in ipairs(split(rec[3])) do
        if delta ~= 0 and redis.call('EXISTS', tk) == 1 then
          if redis.call('INCRBY', tk, delta) < 0 then redis.call('SET', tk, 0, 'KEEPTTL') end
        end
      end
    end
    redis.call('DEL', rk)
    redis.call('ZREM', 'gw:reqs', rid)
    settled = settled + 1
  end
end
return settled
