-- allowances.lua: apply one generation of this spoke's allowances (gateway/limits/allowances.py).
-- An allowance is never stored below what the spoke has used (its counter, reservations of
-- requests in flight included), and a generation older than the one held is refused whole
-- (the one held, again, is applied again: a follower that restarted before it could report
-- an allowance reports it then).
-- ARGV[1] generation  ARGV[2] n, then per entry: window (tpd|tpmo), tier_key, period id,
--         tokens, ttl_ms
-- Returns {} when refused, else {1, {allowance, used}...} in the entries' order.
local gen = tonumber(ARGV[1])
local held = tonumber(redis.call('GET', 'gw:allow:gen') or 0)
if gen < held then return {} end  -- the same one again: applied again (idempotent)
redis.call('SET', 'gw:allow:gen', gen)
local out = {1}
for r = 0, tonumber(ARGV[2]) - 1 do
  local w, key, period = ARGV[3 + r * 5], ARGV[4 + r * 5], ARGV[5 + r * 5]
  local tokens, ttl = tonumber(ARGV[6 + r * 5]), tonumber(ARGV[7 + r * 5])
  local used = tonumber(redis.call('GET', 'gw:g' .. w .. ':' .. key .. ':' .. period) or 0)
  if tokens < used then tokens = used end
  redis.call('SET', 'gw:allow:' .. w .. ':' .. key .. ':' .. period, tokens, 'PX', ttl)
  out[#out + 1] = {tokens, used}
end
return out
