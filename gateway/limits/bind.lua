-- bind.lua: a ticket (an admission made ahead under its own id: gateway/limits/ahead.py)
-- becomes its request's. Its slots, lease and record are renamed to the request id, and its
-- reservation replaced by the request's (no larger), so Redis then holds exactly what
-- admit.lua would have written for the request itself: settle, renew and sweep know it by
-- its request id like any other admission.
-- ARGV[1] ticket id  ARGV[2] request id  ARGV[3] the request's reservation  ARGV[4] its meta
-- ARGV[5] the request's admission time (epoch ms: the record's `a`, as admit.lua writes it)
-- Returns 1 bound; 0 the ticket is gone (released or swept: nothing to bind); -1 the request
-- id is already live (the ticket is left for its release).
local ticket, rid, reserve, meta = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local tk, rk = 'gw:req:' .. ticket, 'gw:req:' .. rid
local rec = redis.call('HMGET', tk, 'r', 'c', 't')
if not rec[1] then return 0 end
if redis.call('EXISTS', rk) == 1 then return -1 end
for zk in string.gmatch(rec[2] or '', '[^\n]+') do
  local lease = redis.call('ZSCORE', zk, ticket)
  if lease then
    redis.call('ZREM', zk, ticket)
    redis.call('ZADD', zk, lease, rid)
  end
end
local delta = reserve - tonumber(rec[1])
if delta ~= 0 then
  for key in string.gmatch(rec[3] or '', '[^\n]+') do
    if redis.call('EXISTS', key) == 1 then
      if redis.call('INCRBY', key, delta) < 0 then redis.call('SET', key, 0, 'KEEPTTL') end
    end
  end
end
local live = redis.call('ZSCORE', 'gw:reqs', ticket)
redis.call('ZREM', 'gw:reqs', ticket)
if live then redis.call('ZADD', 'gw:reqs', live, rid) end
redis.call('RENAME', tk, rk)  -- keeps the record's TTL
redis.call('HSET', rk, 'r', reserve, 'm', meta, 'a', ARGV[5])
return 1
