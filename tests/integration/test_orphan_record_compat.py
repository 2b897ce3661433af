"""An admission's record (gw:req:<rid>) across sidecar versions: during a rolling upgrade
every sidecar runs its own copy of the Lua scripts on one Redis, so a record one version
wrote is swept by another. Only new hash fields may be added (older scripts ignore them):

* the checkpoint `u` keeps its format, "prompt:completion[:weighted]", which the sweep of a
  sidecar from before the cache counts still reads (its script is copied here); the
  prompt's cached and cache-creation tokens are `k`, "cached:created";
* the admission's time is `a` (epoch ms): an orphan's event starts then; a record without
  it (an older sidecar's) starts at the sweep's time, as it always did.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis

from gateway.clock import SystemClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import AdmitRequest, Admitted, Orphan
from gateway.metering import billing, handoff
from gateway.metering.facts import ResponseFacts
from gateway.metering.recorder import Recorder
from gateway.policy.model import LimitSpec, TierLimit
from gateway.sinks.spool import Spool
from gateway.token_weights import TokenWeights, limit_tokens
from gateway.usage_event import Usage, rfc3339

SLACK = 5.0
T0 = 1_800_000_000.0  # 2027-01-15
W = TokenWeights(input=1, cached_input=0.1, cache_creation=1.25, output=4)
META = '["ok","t","m","/v1/chat/completions",true]'
USED = Usage(100, 7, 107, 40, 0, 8)  # 52 uncached + 0.1 x 40 + 1.25 x 8 + 4 x 7 = 94
TIER = TierLimit("key", "ok", LimitSpec(concurrency=4, tokens_per_day=1000))
DAY = "gw:tpd:key:ok:20270115"

# The sweep of a sidecar from before the cache counts (gateway/limits/sweep.lua as shipped
# with token_weights, comments left out): its reader of the checkpoint is the pattern
# below, which a newer record's `u` must still match.
OLD_PATTERN = r"^(%d+):(%d+):?(%d*)$"
OLD_SWEEP = """
local now, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for _, rid in ipairs(redis.call('ZRANGEBYSCORE', 'gw:reqs', '-inf', now, 'LIMIT', 0, limit)) do
  if redis.call('ZREM', 'gw:reqs', rid) == 1 then
    local rk = 'gw:req:' .. rid
    local rec = redis.call('HMGET', rk, 'r', 'c', 't', 'm', 'u')
    if rec[1] then
      for zk in string.gmatch(rec[2] or '', '[^\\n]+') do redis.call('ZREM', zk, rid) end
      local charged = 0
      local p, c, w = string.match(rec[5] or '', '""" + OLD_PATTERN + """')
      if p then
        if w ~= '' then charged = tonumber(w) else charged = tonumber(p) + tonumber(c) end
      end
      local delta = charged - tonumber(rec[1])
      for tk in string.gmatch(rec[3] or '', '[^\\n]+') do
        if delta ~= 0 and redis.call('EXISTS', tk) == 1 then
          if redis.call('INCRBY', tk, delta) < 0 then redis.call('SET', tk, 0, 'KEEPTTL') end
        end
      end
      redis.call('DEL', rk)
      out[#out + 1] = rid
      out[#out + 1] = rec[4] or ''
      out[#out + 1] = charged
      out[#out + 1] = rec[5] or ''
    else
      out[#out + 1] = rid
      out[#out + 1] = ''
      out[#out + 1] = -1
      out[#out + 1] = ''
    end
  end
end
return out
"""


@pytest.fixture
async def lim(redis_url: str) -> AsyncIterator[RedisLimiter]:
    store = RedisLimiter(RespClient(redis_url), lease_ttl=60, deadline=SLACK)
    yield store
    await store.close()


@pytest.fixture
async def db(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    yield r
    await r.aclose()


def _weighted() -> handoff.RequestFacts:
    md = {**handoff.allowed("x", 500, 100),
          **handoff.caller("ok", "t", "m", "/v1/chat/completions", True, True, True, True,
                           False, weights=W)}
    return handoff.read(orjson.loads(orjson.dumps(md)))


def _lua_pattern(lua: str) -> re.Pattern[str]:
    """A Lua pattern of digits and literals, as Python reads it."""
    return re.compile(lua.replace("%d", r"\d"))


async def test_a_new_records_checkpoint_reads_as_before_for_an_older_sweep(
        lim: RedisLimiter, db: aioredis.Redis) -> None:
    """A weighted stream with cache counts, checkpointed by this version and swept by a
    sidecar from before them: `u` is "prompt:completion:weighted" as that sweep reads it,
    so it charges the weighted count (not 0), and the cache counts are `k`."""
    assert isinstance(await lim.admit(AdmitRequest("n1", (TIER,), 600, T0, meta=META)),
                      Admitted)
    ck = billing.checkpoint(_weighted(), ResponseFacts(status=200, usage=USED))
    assert ck == (100, 7, 94, 40, 8)
    await lim.renew(["n1"], T0 + 10, {"n1": ck})
    u = (await db.hget("gw:req:n1", "u")).decode()
    assert u == "100:7:94"
    assert _lua_pattern(OLD_PATTERN).match(u)
    assert await db.hget("gw:req:n1", "k") == b"40:8"
    # the older sidecar's sweep itself, over this record
    flat = await db.eval(OLD_SWEEP, 0, int((T0 + 91) * 1000), 100)
    assert [v.decode() if isinstance(v, bytes) else v for v in flat] == [
        "n1", META, 94, "100:7:94"]
    assert int(await db.get(DAY)) == 94


async def test_an_older_records_orphan_is_billed_by_the_new_sweep(
        lim: RedisLimiter, db: aioredis.Redis, tmp_path: Path) -> None:
    """Records as an older sidecar's admit.lua and renew.lua wrote them (no `k`, no `a`;
    a weighted checkpoint in three fields, an unweighted one in two): the new sweep charges
    and bills them as the older one did, with no cache counts, and their events start at
    the sweep's time (no admission time is known)."""
    for rid, u in (("w3", "100:7:94"), ("p2", "12:55")):
        assert isinstance(await lim.admit(AdmitRequest(rid, (TIER,), 300, T0, meta=META)),
                          Admitted)
        await db.hdel(f"gw:req:{rid}", "a", "k")  # exactly the older fields
        await db.hset(f"gw:req:{rid}", "u", u)
        assert sorted(await db.hkeys(f"gw:req:{rid}")) == [b"c", b"m", b"r", b"t", b"u"]
    orphans = {o.request_id: o for o in await lim.sweep(T0 + 91)}
    w3, p2 = orphans["w3"], orphans["p2"]
    assert (w3.charged, w3.checkpoint, w3.cache, w3.admitted_at) == (94, (100, 7), (0, 0), None)
    assert (p2.charged, p2.checkpoint, p2.cache, p2.admitted_at) == (67, (12, 55), (0, 0), None)
    assert int(await db.get(DAY)) == 94 + 67
    rec = Recorder(Spool(tmp_path, "i1"), "spoke", Ledger(lim, SystemClock(), 60, 60))
    event = rec.orphan(w3)
    assert event.started_at == event.ended_at  # the sweep's time: no start was stored


async def test_a_new_records_orphan_starts_at_its_admission_and_keeps_its_cache_counts(
        lim: RedisLimiter, db: aioredis.Redis, tmp_path: Path) -> None:
    """This version's record: the admission's time (`a`, ms) and the checkpoint's cache
    counts (`k`) come back from the sweep, into the orphan's event."""
    at = int(time.time()) - 120 + 0.25  # two minutes ago (a start is never after its end)
    assert isinstance(await lim.admit(AdmitRequest("n2", (TIER,), 600, at, meta=META)),
                      Admitted)
    assert await db.hget("gw:req:n2", "a") == str(int(at * 1000)).encode()
    ck = billing.checkpoint(_weighted(), ResponseFacts(status=200, usage=USED))
    assert ck is not None
    await lim.renew(["n2"], at + 10, {"n2": ck})
    [o] = await lim.sweep(at + 91)
    assert (o.charged, o.checkpoint, o.cache, o.admitted_at) == (94, (100, 7), (40, 8), at)
    rec = Recorder(Spool(tmp_path, "i1"), "spoke", Ledger(lim, SystemClock(), 60, 60))
    event = rec.orphan(o)
    assert event.started_at == rfc3339(at)
    assert event.ended_at > rfc3339(at + 119)  # the sweep's time, now
    assert (event.usage.cached_tokens, event.usage.cache_creation_tokens) == (40, 8)
    assert limit_tokens(event.usage, W) == o.charged


async def test_a_later_checkpoint_without_cache_counts_replaces_them(
        lim: RedisLimiter, db: aioredis.Redis) -> None:
    """`u` and `k` are one checkpoint: a weighted one without cache counts leaves none of an
    earlier one's behind."""
    assert isinstance(await lim.admit(AdmitRequest("n3", (TIER,), 600, T0, meta=META)),
                      Admitted)
    await lim.renew(["n3"], T0 + 10, {"n3": (100, 7, 94, 40, 8)})
    await lim.renew(["n3"], T0 + 20, {"n3": (100, 9, 138)})
    [o] = await lim.sweep(T0 + 91)
    assert (o.charged, o.checkpoint, o.cache) == (138, (100, 9), (0, 0))


def test_an_orphans_event_never_starts_after_it_ends(tmp_path: Path) -> None:
    """An admission time ahead of this sidecar's clock (another instance's clock ahead):
    the event starts when it ends, the sweep's time, never after."""
    rec = Recorder(Spool(tmp_path, "i1"), "spoke",
                   Ledger(MemoryLimiter(), SystemClock(), 60, 60))
    event = rec.orphan(Orphan("ahead", META, 0, admitted_at=time.time() + 3600))
    assert event.started_at == event.ended_at


async def test_cache_counts_without_a_checkpoint_leave_the_checkpoint_alone(
        lim: RedisLimiter, db: aioredis.Redis) -> None:
    """renew.lua given "rid\\31\\31cached:created" (no checkpoint; this version never sends
    it) keeps the record's checkpoint: it used to overwrite `u` with '', and the sweep
    then charged 0."""
    assert isinstance(await lim.admit(AdmitRequest("n4", (TIER,), 600, T0, meta=META)),
                      Admitted)
    await lim.renew(["n4"], T0 + 10, {"n4": (100, 7, 94, 40, 8)})
    renew = (Path(__file__).parents[2] / "gateway" / "limits" / "renew.lua").read_text()
    await db.eval(renew, 0, int((T0 + 20) * 1000), 60_000, 86_400_000, "n4\x1f\x1f1:2")
    assert (await db.hget("gw:req:n4", "u"), await db.hget("gw:req:n4", "k")) == (
        b"100:7:94", b"40:8")
