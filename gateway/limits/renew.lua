-- renew.lua: extend the concurrency leases of requests still streaming.
-- A lease that already expired (the stream outlived it unrenewed) is not brought back.
-- Returns the ids that hold nothing any more (settled, possibly by another instance that
-- received their end): the caller stops renewing them.
-- A request id may carry its usage so far, "rid\31prompt:completion", or, for a model with
-- token weights, "rid\31prompt:completion:weighted\31cached:created": the checkpoint an
-- orphan sweep bills if the sidecar following the stream dies (sweep.lua). It is stored as
-- `u` ("prompt:completion[:weighted]", the format every sidecar's sweep reads: never
-- extend it) and, weighted, `k` (the prompt's cached and cache-creation tokens, for the
-- orphan's event): a new field, which an older sidecar's sweep ignores.
-- ARGV[1] now_ms  ARGV[2] lease_ttl_ms  ARGV[3] record_ttl_ms  ARGV[4..] request ids
local now, ttl, rec_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local gone = {}
for i = 4, #ARGV do
  local rid, ck, kc = string.match(ARGV[i], '^([^\31]*)\31?([^\31]*)\31?(.*)$')
  local rk = 'gw:req:' .. rid
  local leases = redis.call('HGET', rk, 'c')
  if leases then
    if kc ~= '' and ck ~= '' then  -- cache counts only beside a checkpoint
      redis.call('HSET', rk, 'u', ck, 'k', kc)
    elseif ck ~= '' then
      redis.call('HSET', rk, 'u', ck)
    end
    for zk in string.gmatch(leases, '[^\n]+') do
      redis.call('ZADD', zk, 'XX', 'CH', now + ttl, rid)
      redis.call('PEXPIRE', zk, ttl * 2)
    end
    redis.call('PEXPIRE', rk, rec_ttl)
    redis.call('ZADD', 'gw:reqs', 'XX', now + ttl, rid)
  else
    gone[#gone + 1] = rid
  end
end
return gone
