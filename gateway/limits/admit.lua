-- admit.lua: decide a batch of admissions atomically (one round trip for many requests).
-- For each request, every tier is checked first; only if all pass are they committed, so a
-- denial at one tier consumes nothing at another. Formulas mirror gateway/limits/maths.py.
--
-- ARGV[1] now_ms   ARGV[2] lease_ttl_ms (the first lease: the start TTL, renewed by ext_proc)
-- ARGV[3] record_ttl_ms
-- ARGV[4] day_id   ARGV[5] month_id       ARGV[6] ms_to_day_end   ARGV[7] ms_to_month_end
-- ARGV[8] n requests, then one ARGV per request: its fields joined by \31 (packing 30
--         arguments per request cost the client more than the script): rid, reserve, meta
--         (opaque: who/what, kept for the orphan sweep), ntiers,
--         (reserve -1: "free", a request no token window applies to, e.g. count_tokens:
--         only rps and concurrency are checked and committed; 0 is still checked)
--         then per tier: tier_key, rps, burst, concurrency, tpm, tpd, tpmo, gtpd, gtpmo
--         ('' = no limit). gtpd/gtpmo: a global quota's fallback share; the limit enforced
--         is this spoke's allowance, gw:allow:tpd|tpmo:<tier_key>:<period> (written by the
--         allowance follower), else that fallback; counted in gw:gtpd|gtpmo:<tier_key>:<period>.
-- Keys are derived from tier_key (standalone Redis; not cluster-slot safe).
-- TTLs: a minute counter is re-armed (120 s) by every admission that counts in it; a day or
-- month counter, local or global, gets its TTL (2 days, 40 days) once, from the admission
-- that finds it at 0 (new, or settled back to nothing), which outlasts its period by a day
-- or more (and spares a PEXPIRE an admission). None is ever left without a TTL: settle.lua
-- and sweep.lua only change a counter that exists (INCRBY, SET KEEPTTL), nothing else does.
-- Returns per request: {code, tier_index, retry_ms, req_limit, req_remaining, req_reset_ms,
--                       tok_limit, tok_remaining, tok_reset_ms, leased}; -1 = absent
-- (retry_ms -1: never, the reservation is larger than the whole limit). A denial's numbers
-- are the binding tier's own, and for a family it lacks the tightest other tier's, as they
-- stand (it consumed nothing): denial_numbers.
-- code: 0 allowed, 1 rps, 2 concurrency, 3 tokens_per_minute, 4 tokens_per_day,
--       5 tokens_per_month, 6 voided (its caller already gave up: see settle.lua),
--       7 global_tokens_per_day, 8 global_tokens_per_month (this spoke's allowance)
--       9 duplicate (an admission with this request id is still live: ids are not shared)
--       10 headroom: a ticket (an id that starts with \30, admitted ahead of its request:
--          gateway/limits/ahead.py) that would leave a tier less than a quarter of a limit
--          free, or under a limit too small to hide one (an rps burst or a concurrency
--          under 16, a token limit under 16 reservations); nothing is committed.

local now = tonumber(ARGV[1])
local lease_ttl = tonumber(ARGV[2])
local rec_ttl = tonumber(ARGV[3])
local day_id, month_id = ARGV[4], ARGV[5]
local to_day, to_month = tonumber(ARGV[6]), tonumber(ARGV[7])
local n = tonumber(ARGV[8])
local minute = math.floor(now / 60000)
local into = (now % 60000) / 60000
local to_minute = 60000 - (now % 60000)
local MAX_PX = 1e13  -- the longest TTL of an rps key: about 317 years
local KEEP_FREE, FLOOR = 0.25, 16  -- tickets: the share of each limit left free; no
                                   -- ticket under a limit of FLOOR (reservations)
-- The windows' key suffixes, built once per call.
local at_minute, at_prev = ':' .. minute, ':' .. (minute - 1)
local at_day, at_month = ':' .. day_id, ':' .. month_id

-- A request's fields (see ARGV[8] above): its own four, then nine a tier, each one match.
-- Written out, not built with string.rep: the script's prologue runs on every call.
local HEAD = '^([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)()'
local TIER = '^\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)'
             .. '\31([^\31]*)\31([^\31]*)\31([^\31]*)\31([^\31]*)()'

local function num(key)
  return tonumber(redis.call('GET', key) or 0)
end

-- Seconds (here ms) until `reserve` fits the sliding minute without new traffic; -1 never.
-- The previous minute slides out over this one; this minute's count only in the next.
local function slide_wait(prev, cur, reserve, limit)
  local room = limit - reserve
  if room < 0 then return -1 end
  if prev * (1 - into) + cur <= room then return 0 end
  if cur <= room then
    return math.max(0, (1 - (room - cur) / prev) * 60000 - (now % 60000))
  end
  return to_minute + (1 - room / cur) * 60000
end

local function offer(best, limit, remaining, reset)
  if remaining < 0 then remaining = 0 end
  remaining = math.floor(remaining)
  if best[1] < 0 or remaining < best[2] or (remaining == best[2] and limit < best[1]) then
    best[1], best[2], best[3] = limit, remaining, math.ceil(reset)
  end
end

-- A token window's count and the time until it counts nothing again (the header's reset).
local function window_use(key, w)
  if w[1] ~= 3 then
    return num(w[3]), w[4], 0, 0
  end
  local prev, cur = num('gw:tpm:' .. key .. at_prev), num(w[3])
  local reset = 0
  if cur > 0 then reset = to_minute + 60000 elseif prev > 0 then reset = to_minute end
  return prev * (1 - into) + cur, reset, prev, cur
end

-- A tier's rps as it stands (from x.tat, which the checks read), offered to `best`.
local function rps_stands(x, best)
  local interval = 1000 / x.rps
  local left = (now - x.tat - interval + x.burst * interval) / interval + 1e-4
  offer(best, x.burst, math.floor(left) + 1, x.tat - now)
end

-- A denial's numbers, both families, as they stand (from what the checks read: x.tat, each
-- window's w[6], w[7]). The tier that refused (at) gives its own: its rps (or its
-- concurrency, full), and the token window named (code), else its tightest. A family that
-- tier has no limit for is the tightest of every tier that has one, as an allowed answer
-- picks it; none: absent. A request that skips the token windows (free) reports no tokens.
-- Only a denial pays for this second look.
local function denial_numbers(tiers, at, code, free)
  local x = tiers[at]
  local rq, tk, refused = {-1, -1, -1}, {-1, -1, -1}, nil
  if code == 2 then
    rq = {x.conc, 0, 1000}
  elseif x.rps then
    rps_stands(x, rq)
  end
  if not free then
    for _, w in ipairs(x.windows) do
      local limit, used, reset = w[2], w[6], w[7]
      local mine = {limit, math.max(0, math.floor(limit - used)), math.ceil(reset)}
      if w[1] == code then refused = mine end
      offer(tk, mine[1], mine[2], mine[3])
    end
  end
  if refused then tk = refused end
  local more_rq, more_tk = rq[1] < 0, tk[1] < 0 and not free
  if more_rq or more_tk then  -- from the other tiers (this one has none to offer)
    for t = 1, #tiers do
      local y = tiers[t]
      if more_rq and y.rps then rps_stands(y, rq) end
      if more_tk then
        for _, w in ipairs(y.windows) do offer(tk, w[2], w[2] - w[6], w[7]) end
      end
    end
  end
  return rq, tk
end

local out = {}
for r = 1, n do
  local text = ARGV[8 + r]
  local rid, reserve, meta, nt, pos = string.match(text, HEAD)
  reserve, nt = tonumber(reserve), tonumber(nt)
  local free = reserve < 0  -- no token window applies: none checked, counted or reported
  if free then reserve = 0 end
  local tiers = {}
  for t = 1, nt do
    local key, rps, burst, conc, tpm, tpd, tpmo, gd, gm
    key, rps, burst, conc, tpm, tpd, tpmo, gd, gm, pos = string.match(text, TIER, pos)
    -- Only the windows with a limit, in this order (a denial names the first that refuses).
    local windows = {}
    tpm, tpd, tpmo = tonumber(tpm), tonumber(tpd), tonumber(tpmo)
    if tpm then
      windows[1] = {3, tpm, 'gw:tpm:' .. key .. at_minute, to_minute, 120000, 0, 0}
    end
    if tpd then
      windows[#windows + 1] = {4, tpd, 'gw:tpd:' .. key .. at_day, to_day, 172800000, 0, 0}
    end
    if tpmo then
      windows[#windows + 1] = {5, tpmo, 'gw:tpmo:' .. key .. at_month, to_month,
                               3456000000, 0, 0}
    end
    gd, gm = tonumber(gd), tonumber(gm)
    if gd then
      local allow = redis.call('GET', 'gw:allow:tpd:' .. key .. at_day)
      windows[#windows + 1] = {7, tonumber(allow) or gd, 'gw:gtpd:' .. key .. at_day, to_day,
                               172800000, 0, 0}
    end
    if gm then
      local allow = redis.call('GET', 'gw:allow:tpmo:' .. key .. at_month)
      windows[#windows + 1] = {8, tonumber(allow) or gm, 'gw:gtpmo:' .. key .. at_month,
                               to_month, 3456000000, 0, 0}
    end
    tiers[t] = {
      key = key, rps = tonumber(rps), burst = tonumber(burst), conc = tonumber(conc),
      windows = windows,
    }
  end

  -- Every tier is scanned, even past a denial (which commits nothing): the limit named is
  -- the one with the longest wait of every limit that refuses now (the first of equal
  -- waits, in the order checked), its wait the retry; a limit no wait can satisfy (a
  -- reservation larger than it) is the one named, with no retry (-1).
  local code, at, retry = 0, -1, 0
  local ticket, short = string.byte(rid, 1) == 30, nil  -- short: a tier a ticket would crowd
  local rq, tk = {-1, -1, -1}, {-1, -1, -1}
  if redis.call('EXISTS', 'gw:void:' .. rid, 'gw:req:' .. rid) > 0 then  -- seldom: which?
    if redis.call('EXISTS', 'gw:void:' .. rid) == 1 then code = 6 else code = 9 end
    nt = 0
  end
  local function refuse(c, t, wait)
    if retry >= 0 and wait < 0 then
      code, at, retry = c, t, -1  -- never: this one is the answer
    elseif retry >= 0 and (code == 0 or wait > retry) then
      code, at, retry = c, t, wait  -- the longest wait binds (a tie: the first keeps it)
    end
  end
  for t = 1, nt do
    local x = tiers[t]
    if x.rps then
      local interval = 1000 / x.rps
      local tat = num('gw:rps:' .. x.key)
      if tat < now then tat = now end
      x.tat = tat
      local new_tat = tat + interval
      local allow_at = new_tat - x.burst * interval
      if now < allow_at then
        refuse(1, t, allow_at - now)
      else
        x.new_tat = new_tat
        offer(rq, x.burst, (now - allow_at) / interval + 1e-4, new_tat - now)
        if ticket and (x.burst < FLOOR
                       or x.burst - (new_tat - now) / interval < x.burst * KEEP_FREE) then
          short = short or t
        end
      end
    end
    if x.conc then
      local zk = 'gw:conc:' .. x.key
      redis.call('ZREMRANGEBYSCORE', zk, '-inf', now)
      local live = redis.call('ZCARD', zk)
      x.live = live
      if live >= x.conc then
        refuse(2, t, 1000)
      elseif ticket and (x.conc < FLOOR or live + 1 > x.conc * (1 - KEEP_FREE)) then
        short = short or t
      end
    end
    for _, w in ipairs(x.windows) do
      local limit = w[2]
      if limit and not free then
        local used, reset, prev, cur = window_use(x.key, w)
        w[6], w[7] = used, reset
        if used + reserve > limit then
          if reserve > limit and w[1] < 7 then  -- an allowance may grow: never "never"
            refuse(w[1], t, -1)
          elseif w[1] == 3 then
            refuse(3, t, slide_wait(prev, cur, reserve, limit))
          else
            refuse(w[1], t, w[4])
          end
        elseif code == 0 then  -- after this request: its reservation counts this minute
          if w[1] == 3 and reserve > 0 then reset = to_minute + 60000 end
          offer(tk, limit, limit - used - reserve, reset)
        end
        if ticket and (limit < FLOOR * math.max(reserve, 1)
                       or used + reserve > limit * (1 - KEEP_FREE)) then
          short = short or t
        end
      end
    end
  end
  if code == 0 and short then code, at = 10, short end
  if code >= 1 and code <= 8 and code ~= 6 then  -- both families (denial_numbers)
    rq, tk = denial_numbers(tiers, at, code, free)
  end

  local leased = 0
  if code == 0 then
    local leases, toks = {}, {}
    for t = 1, nt do
      local x = tiers[t]
      if x.new_tat then
        -- At most MAX_PX: Lua writes a number in 14 digits, and a TTL past them (a rate
        -- of 1e-11/s and below) would be `1e+14`, which SET refuses as no integer.
        redis.call('SET', 'gw:rps:' .. x.key, x.new_tat, 'PX',
                   math.min(math.ceil(x.new_tat - now) + 1000, MAX_PX))
      end
      if x.conc then
        local zk = 'gw:conc:' .. x.key
        redis.call('ZADD', zk, now + lease_ttl, rid)
        -- Never shorter than it is: a renewed lease in the set outlives this first one. A
        -- set that was empty did not exist (Redis deletes an empty one): no TTL to read.
        if x.live == 0 or redis.call('PTTL', zk) < lease_ttl * 2 then
          redis.call('PEXPIRE', zk, lease_ttl * 2)
        end
        leases[#leases + 1] = zk
      end
      for _, w in ipairs(x.windows) do
        if w[2] and not free then
          local total = redis.call('INCRBY', w[3], reserve)
          if w[1] == 3 or total == reserve then  -- see "TTLs" above
            redis.call('PEXPIRE', w[3], w[5])
          end
          toks[#toks + 1] = w[3]
        end
      end
    end
    if #leases > 0 or #toks > 0 then
      local rk = 'gw:req:' .. rid
      -- a: when it was admitted (now_ms, its batch's), its orphan event's start (sweep.lua)
      redis.call('HSET', rk, 'r', reserve, 'c', table.concat(leases, '\n'),
                 't', table.concat(toks, '\n'), 'm', meta, 'a', ARGV[1])
      redis.call('PEXPIRE', rk, rec_ttl)
      redis.call('ZADD', 'gw:reqs', now + lease_ttl, rid)  -- live until settled or orphaned
      leased = 1
    end
  end
  out[r] = {code, at, math.ceil(retry), rq[1], rq[2], rq[3], tk[1], tk[2], tk[3], leased}
end
return out
