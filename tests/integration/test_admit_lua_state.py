"""What admit.lua leaves in Redis: every key an admission writes, its value and its TTL.

The behaviour suites read the counters but not their TTLs; these pin them, so a cheaper
script cannot leave a counter without a TTL (nor re-arm one it need not). TTLs are Redis's
own clock: a margin of a second absorbs the test's own time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis

from gateway.limits import maths
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import AdmitRequest, Admitted, Refused
from gateway.policy.model import LimitSpec, TierLimit

# The store's deadline, not under test here: room for a first connection and script load
# on a busy CI machine (the 250 ms default failed there once).
SLACK = 5.0

T0 = 1_800_000_000.0
MINUTE_MS, DAY_MS, MONTH_MS = 120_000, 172_800_000, 3_456_000_000
ALL = LimitSpec(rps=100, burst=10, concurrency=5, tokens_per_minute=10_000,
                tokens_per_day=100_000, tokens_per_month=1_000_000,
                global_tokens_per_day=1_000_000, global_tokens_per_month=10_000_000)
TIERS = (TierLimit("model", "m", ALL), TierLimit("team", "t", ALL), TierLimit("key", "k", ALL))


@pytest.fixture
async def lim(redis_url: str) -> AsyncIterator[RedisLimiter]:
    limiter = RedisLimiter(RespClient(redis_url), lease_ttl=60, start_ttl=5, deadline=SLACK)
    yield limiter
    await limiter.close()


@pytest.fixture
def db(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def near(ttl: int, full: int) -> bool:
    return full - 1000 < ttl <= full


def windows(tier: str, now: float) -> dict[str, int]:
    """Each token window counter of a tier, with the TTL it is given."""
    day, month = maths.day_id(now), maths.month_id(now)
    return {f"gw:tpm:{tier}:{int(now * 1000) // 60000}": MINUTE_MS,
            f"gw:tpd:{tier}:{day}": DAY_MS, f"gw:tpmo:{tier}:{month}": MONTH_MS,
            f"gw:gtpd:{tier}:{day}": DAY_MS, f"gw:gtpmo:{tier}:{month}": MONTH_MS}


async def test_an_admission_writes_these_keys_with_these_ttls(
        lim: RedisLimiter, db: redis.Redis) -> None:
    assert isinstance(await lim.admit(AdmitRequest("a", TIERS, 100, T0)), Admitted)
    now_ms = int(T0 * 1000)
    expected = {"gw:req:a", "gw:reqs"}
    for t in ("model:m", "team:t", "key:k"):
        assert float(db.get(f"gw:rps:{t}") or 0) == now_ms + 10  # the new TAT: 1/rps later
        assert near(db.pttl(f"gw:rps:{t}"), 10 + 1000)
        assert db.zrange(f"gw:conc:{t}", 0, -1, withscores=True) == [("a", now_ms + 5000)]
        assert near(db.pttl(f"gw:conc:{t}"), 2 * 5000)
        for k, ttl in windows(t, T0).items():
            assert db.get(k) == "100", k
            assert near(db.pttl(k), ttl), k
        expected |= {f"gw:rps:{t}", f"gw:conc:{t}", *windows(t, T0)}
    assert set(db.keys("*")) == expected
    rec = db.hgetall("gw:req:a")
    assert rec["r"] == "100"
    assert rec["a"] == str(now_ms)  # the admission's time: its orphan event's start
    assert rec["c"] == "\n".join(f"gw:conc:{t}" for t in ("model:m", "team:t", "key:k"))
    assert rec["t"] == "\n".join(k for t in ("model:m", "team:t", "key:k") for k in windows(t, T0))
    assert near(db.pttl("gw:req:a"), lim.record_ttl_ms)
    assert db.zrange("gw:reqs", 0, -1, withscores=True) == [("a", now_ms + 5000)]


async def test_a_minute_counter_is_rearmed_by_every_admission_a_day_or_month_one_at_birth(
        lim: RedisLimiter, db: redis.Redis) -> None:
    """A day or month counter's TTL outlasts its period by a day or more from its birth."""
    assert isinstance(await lim.admit(AdmitRequest("a", TIERS, 100, T0)), Admitted)
    await asyncio.sleep(1.2)  # Redis's clock moves on; the requests' `now` is the same minute
    assert isinstance(await lim.admit(AdmitRequest("b", TIERS, 50, T0 + 1)), Admitted)
    for t in ("model:m", "team:t", "key:k"):
        for k, ttl in windows(t, T0).items():
            assert db.get(k) == "150", k
            if not k.startswith("gw:tpm:"):  # its TTL from its first admission
                assert ttl - 3000 < db.pttl(k) <= ttl - 1200, k
            else:
                assert near(db.pttl(k), ttl), k


async def test_a_global_counter_settled_to_nothing_is_rearmed_by_the_next_admission(
        lim: RedisLimiter, db: redis.Redis) -> None:
    """A counter at 0 counts as new (its TTL set again); one above 0 keeps its TTL."""
    assert isinstance(await lim.admit(AdmitRequest("a", TIERS, 100, T0)), Admitted)
    await lim.settle("a", 0)
    await asyncio.sleep(1.2)
    assert isinstance(await lim.admit(AdmitRequest("b", TIERS, 0, T0 + 1)), Admitted)
    assert isinstance(await lim.admit(AdmitRequest("c", TIERS, 7, T0 + 1)), Admitted)
    for t in ("model:m", "team:t", "key:k"):
        for k, ttl in windows(t, T0).items():
            assert db.get(k) == "7", k
            assert near(db.pttl(k), ttl), k


async def test_a_denial_writes_nothing(lim: RedisLimiter, db: redis.Redis) -> None:
    assert isinstance(await lim.admit(AdmitRequest("a", TIERS, 100, T0)), Admitted)
    before = {k: (db.type(k), db.dump(k)) for k in db.keys("*")}
    ttls = {k: db.pttl(k) for k in before}
    tight = (*TIERS[:2], TierLimit("key", "k", LimitSpec(tokens_per_minute=150)))
    assert isinstance(await lim.admit(AdmitRequest("b", tight, 100, T0)), Refused)
    assert {k: (db.type(k), db.dump(k)) for k in db.keys("*")} == before
    assert all(db.pttl(k) <= ttl for k, ttl in ttls.items())  # none re-armed


async def test_an_admission_never_shortens_the_life_of_a_renewed_lease(redis_url: str) -> None:
    """A renewed stream's lease lasts the lease TTL; a later admission, whose own first
    lease is the shorter start TTL, must not cut the concurrency set's TTL to its own: the
    set (every lease in it) would vanish before the stream's next renewal, and the slot the
    stream still holds would be given to another request."""
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=60, start_ttl=0.2, deadline=SLACK)
    try:
        one = (TierLimit("key", "k", LimitSpec(concurrency=2)),)
        assert isinstance(await lim.admit(AdmitRequest("long", one, 0, T0)), Admitted)
        assert await lim.renew(["long"], T0) == []  # leased until T0 + 60 s
        assert isinstance(await lim.admit(AdmitRequest("short", one, 0, T0)), Admitted)
        await lim.settle("short", 0)
        await asyncio.sleep(0.6)  # past the short one's set TTL (2 x 0.2 s), by Redis's clock
        assert isinstance(await lim.admit(AdmitRequest("x", one, 0, T0 + 1)), Admitted)
        v = await lim.admit(AdmitRequest("y", one, 0, T0 + 1))
        assert isinstance(v, Refused) and v.limit == "concurrency"  # "long" and "x" hold both
    finally:
        await lim.close()
