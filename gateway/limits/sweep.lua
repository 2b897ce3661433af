-- sweep.lua: claim requests whose lease ran out without a settlement: the sidecar that
-- followed them died (or the client left between the Check and ext_proc). Each is claimed by
-- exactly one caller (ZREM) and released. Its reservation is replaced by the usage of its
-- last checkpoint (renew.lua; its weighted count when it has one), or cancelled when it has
-- none: the platform lost track of it, so the customer is charged only what was seen. The caller emits its one usage event.
-- ARGV[1] now_ms  ARGV[2] limit
-- Returns a flat list: rid, meta, charged, checkpoint, cache, admitted, then the next one's.
-- cache: the checkpoint's "cached:created" prompt tokens (`k`: a weighted model's), admitted:
-- the admission's time, epoch ms (`a`); '' when the record has none (an older sidecar
-- wrote it). Several sidecar versions share one Redis during an upgrade, each sweeping with
-- its own copy of this script: a record's fields keep their formats, and new facts go in
-- new fields, which an older sweep ignores.
-- A claimed id whose record is gone (it outlived its TTL unswept) comes back with charged
-- -1: nothing is left to bill it from, and the caller says so.
local now, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', 'gw:reqs', '-inf', now, 'LIMIT', 0, limit)) do
  if redis.call('ZREM', 'gw:reqs', rid) == 1 then
    local rk = 'gw:req:' .. rid
    local rec = redis.call('HMGET', rk, 'r', 'c', 't', 'm', 'u', 'k', 'a')
    if rec[1] then
      for zk in string.gmatch(rec[2] or '', '[^\n]+') do redis.call('ZREM', zk, rid) end
      local charged = 0
      -- "prompt:completion", and ":weighted" for a model with token weights: its limits
      -- are charged the weighted count (gateway/token_weights.py)
      local p, c, w = string.match(rec[5] or '', '^(%d+):(%d+):?(%d*)$')
      if p then
        if w ~= '' then charged = tonumber(w) else charged = tonumber(p) + tonumber(c) end
      end
      local delta = charged - tonumber(rec[1])
      for tk in string.gmatch(rec[3] or '', '[^\n]+') do
        if delta ~= 0 and redis.call('EXISTS', tk) == 1 then
          if redis.call('INCRBY', tk, delta) < 0 then redis.call('SET', tk, 0, 'KEEPTTL') end
        end
      end
      redis.call('DEL', rk)
      out[#out + 1] = rid
      out[#out + 1] = rec[4] or ''
      out[#out + 1] = charged
      out[#out + 1] = rec[5] or ''
      out[#out + 1] = rec[6] or ''
      out[#out + 1] = rec[7] or ''
    else
      out[#out + 1] = rid
      out[#out + 1] = ''
      out[#out + 1] = -1
      out[#out + 1] = ''
      out[#out + 1] = ''
      out[#out + 1] = ''
    end
  end
end
return out
