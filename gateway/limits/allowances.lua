-- allowances.lua: apply one generation of this spoke's allowances (gateway/limits/allowances.py).
-- An allowance is never stored below what the spoke has used (its counter, reservations of
-- requests in flight included), and a generation older than the one held is refused whole
-- (the one held, again, is applied again: a follower that restarted before it could report
-- an allowance reports it then). The spoke's counter is raised to `known`, the use the
-- allocator counted for this spoke in the period from its usage events, where it is below:
-- a quota added mid-period counts the period's earlier use, as the allocator does (else
-- every allowance, never below that use, would leave the spoke that much more to serve).
-- ARGV[1] generation  ARGV[2] n, then per entry: window (tpd|tpmo), tier_key, period id,
--         tokens, ttl_ms, known
-- Returns {} when refused, else {1, {allowance, used}...} in the entries' order.
local gen = tonumber(ARGV[1])
local held = tonumber(redis.call('GET', 'gw:allow:gen') or 0)
if gen < held then return {} end  -- the same one again: applied again (idempotent)
redis.call('SET', 'gw:allow:gen', gen)
local out = {1}
for r = 0, tonumber(ARGV[2]) - 1 do
  local w, key, period = ARGV[3 + r * 6], ARGV[4 + r * 6], ARGV[5 + r * 6]
  local tokens, ttl = tonumber(ARGV[6 + r * 6]), tonumber(ARGV[7 + r * 6])
  local known = tonumber(ARGV[8 + r * 6])
  local counter = 'gw:g' .. w .. ':' .. key .. ':' .. period
  local used = tonumber(redis.call('GET', counter) or 0)
  if used < known then  -- a new counter gets admission's TTL; an existing one keeps its own
    if redis.call('EXISTS', counter) == 1 then
      redis.call('SET', counter, known, 'KEEPTTL')
    else
      redis.call('SET', counter, known, 'PX', ttl)
    end
    used = known
  end
  if tokens < used then tokens = used end
  redis.call('SET', 'gw:allow:' .. w .. ':' .. key .. ':' .. period, tokens, 'PX', ttl)
  out[#out + 1] = {tokens, used}
end
return out
