-- allowances.lua: apply one generation of this spoke's allowances (gateway/limits/allowances.py).
-- An allowance is never stored below what the spoke has used (its counter, reservations of
-- requests in flight included), and a generation older than the one held is refused whole
-- (the one held, again, is applied again: a follower that restarted before it could report
-- an allowance reports it then). The spoke's counter is raised to `known`, the use the
-- allocator counted for this spoke in the period from its usage events, plus the
-- reservations of the requests in flight it holds (which no event counts yet), where it is
-- below: a quota added mid-period counts the period's earlier use, as the allocator does
-- (else every allowance, never below that use, would leave the spoke that much more to
-- serve). The requests in flight are read only when a counter is below `known`, which it
-- is only when it missed use (a quota added mid-period, a Redis wiped): once a period.
-- ARGV[1] generation  ARGV[2] n, then per entry: window (tpd|tpmo), tier_key, period id,
--         tokens, ttl_ms, known
-- Returns {} when refused, else {1, {allowance, used}...} in the entries' order.
local gen = tonumber(ARGV[1])
local held = tonumber(redis.call('GET', 'gw:allow:gen') or 0)
if gen < held then return {} end  -- the same one again: applied again (idempotent)
redis.call('SET', 'gw:allow:gen', gen)
local out = {1}
local reserved = nil  -- token counter -> the reservations in flight in it (read once)
local function in_flight(counter)
  if reserved == nil then
    reserved = {}
    for _, id in ipairs(redis.call('ZRANGE', 'gw:reqs', 0, -1)) do
      local rec = redis.call('HMGET', 'gw:req:' .. id, 'r', 't')
      local r = tonumber(rec[1]) or 0
      if rec[2] and r > 0 then
        for k in string.gmatch(rec[2], '[^\n]+') do reserved[k] = (reserved[k] or 0) + r end
      end
    end
  end
  return reserved[counter] or 0
end
for r = 0, tonumber(ARGV[2]) - 1 do
  local w, key, period = ARGV[3 + r * 6], ARGV[4 + r * 6], ARGV[5 + r * 6]
  local tokens, ttl = tonumber(ARGV[6 + r * 6]), tonumber(ARGV[7 + r * 6])
  local known = tonumber(ARGV[8 + r * 6])
  local counter = 'gw:g' .. w .. ':' .. key .. ':' .. period
  local used = tonumber(redis.call('GET', counter) or 0)
  if used < known then  -- raised, keeping its reservations in flight (no event's yet)
    used = known + in_flight(counter)
    if redis.call('EXISTS', counter) == 1 then  -- an existing counter keeps its TTL
      redis.call('SET', counter, used, 'KEEPTTL')
    else  -- a new one gets admission's
      redis.call('SET', counter, used, 'PX', ttl)
    end
  end
  if tokens < used then tokens = used end
  redis.call('SET', 'gw:allow:' .. w .. ':' .. key .. ':' .. period, tokens, 'PX', ttl)
  out[#out + 1] = {tokens, used}
end
return out
