"""One suite, two stores: the Redis Lua limiter and the in-process one must agree.

Time is passed in (`now`), so lease expiry and windows are tested without sleeping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from devspoke.procs import free_port, redis_service
from gateway import metrics
from gateway.errors import RedisLost, StoreInDoubt
from gateway.limits import maths
from gateway.limits.ahead import AheadLimiter
from gateway.limits.allowances import Allowance, AllowanceStore, Applied, RedisAllowances
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import (
    GTPD,
    GTPMO,
    Abandon,
    AdmitRequest,
    Admitted,
    DuplicateId,
    Limiter,
    Refused,
    Voided,
)
from gateway.policy.model import LimitSpec, TierLimit

# The store's deadline, not under test here: room for a first connection and script load
# on a busy CI machine (the 250 ms default failed there once).
SLACK = 5.0

T0 = 1_800_000_000.0  # a fixed wall-clock instant (2027-01-15)


@pytest.fixture(params=["memory", "redis", "redis_ahead"])
async def limiter(request: pytest.FixtureRequest) -> AsyncIterator[Limiter]:
    """`redis_ahead`: the Redis store admitting ahead (tickets kept 10 s, so the test's own
    pace decides nothing): the contract must hold with it too."""
    if request.param == "memory":
        yield MemoryLimiter(lease_ttl=60)
        return
    url = request.getfixturevalue("redis_url")
    lim: Limiter = RedisLimiter(RespClient(url), lease_ttl=60, deadline=SLACK)
    if request.param == "redis_ahead":
        assert isinstance(lim, RedisLimiter)
        lim = AheadLimiter(lim, ttl=10.0)
    yield lim
    await lim.close()


@pytest.fixture(params=["memory", "redis"])
async def start_ttl_limiter(request: pytest.FixtureRequest) -> AsyncIterator[Limiter]:
    """Leases of 60 s, but an admission's first lease lasts 5 s until renewed."""
    if request.param == "memory":
        yield MemoryLimiter(lease_ttl=60, start_ttl=5)
        return
    lim = RedisLimiter(RespClient(request.getfixturevalue("redis_url")), lease_ttl=60,
                       start_ttl=5, deadline=SLACK)
    yield lim
    await lim.close()


def tier(kind: str, name: str, **limits: float) -> TierLimit:
    spec = LimitSpec(**limits)  # type: ignore[arg-type]
    if spec.rps is not None and spec.burst is None:
        spec = LimitSpec(**{**limits, "burst": max(1, int(-(-spec.rps // 1)))})  # type: ignore[arg-type]
    return TierLimit(kind, name, spec)


def req(rid: str, tiers: list[TierLimit], now: float = T0, reserve: int = 0) -> AdmitRequest:
    return AdmitRequest(rid, tuple(tiers), reserve, now)


async def test_team_denial_does_not_consume_key_rps(limiter: Limiter) -> None:
    team = tier("team", "team-a", concurrency=1)
    key = tier("key", "k1", rps=1)
    # fills the team's one slot
    assert isinstance(await limiter.admit(req("r1", [team], T0)), Admitted)
    denied = await limiter.admit(req("r2", [team, key], T0))
    assert isinstance(denied, Refused) and (denied.tier, denied.limit) == ("team", "concurrency")
    # The key's single RPS cell was not spent by the denied request:
    await limiter.settle("r1", None)
    ok = await limiter.admit(req("r3", [team, key], T0))
    assert isinstance(ok, Admitted)


async def test_rps_burst_then_retry_after(limiter: Limiter) -> None:
    key = tier("key", "k1", rps=2, burst=2)
    assert isinstance(await limiter.admit(req("a", [key])), Admitted)
    assert isinstance(await limiter.admit(req("b", [key])), Admitted)
    v = await limiter.admit(req("c", [key]))
    assert isinstance(v, Refused) and (v.tier, v.limit) == ("key", "rps")
    assert 0.4 <= v.retry_after <= 0.5
    assert isinstance(await limiter.admit(req("d", [key], T0 + 0.5)), Admitted)


async def test_a_rate_of_one_request_in_millennia_is_still_a_rate(limiter: Limiter) -> None:
    """Any `rps` above 0 is a valid policy. Redis's Lua prints a number with 14 digits, so a
    rate whose interval passed 10^14 ms (about 1e-11/s) gave its TAT key a TTL written
    `1e+14`, which SET refused: every request of that tier was a 503, the store "down"."""
    for n, rps in enumerate((1e-11, 1e-300)):
        key = tier("key", f"slow{n}", rps=rps)
        assert isinstance(await limiter.admit(req(f"a{n}", [key])), Admitted)
        v = await limiter.admit(req(f"b{n}", [key], T0 + 3600))
        assert isinstance(v, Refused) and (v.tier, v.limit) == ("key", "rps")


async def test_lease_released_on_settle_and_expires_after_crash(limiter: Limiter) -> None:
    key = tier("key", "k1", concurrency=2)
    for rid in ("a", "b"):
        assert isinstance(await limiter.admit(req(rid, [key])), Admitted)
    assert isinstance(await limiter.admit(req("c", [key])), Refused)
    await limiter.settle("a", None)
    assert isinstance(await limiter.admit(req("c", [key])), Admitted)
    # 'b' and 'c' are never settled (a crashed sidecar): slots come back after the lease TTL.
    assert isinstance(await limiter.admit(req("d", [key], T0 + 59)), Refused)
    assert isinstance(await limiter.admit(req("d", [key], T0 + 61)), Admitted)


async def test_renew_keeps_long_streams_leased(limiter: Limiter) -> None:
    key = tier("key", "k1", concurrency=1)
    assert isinstance(await limiter.admit(req("long", [key])), Admitted)
    await limiter.renew(["long"], T0 + 50)  # lease now ends at T0 + 110
    assert isinstance(await limiter.admit(req("x", [key], T0 + 100)), Refused)
    assert isinstance(await limiter.admit(req("x", [key], T0 + 111)), Admitted)


async def test_a_denial_fills_a_family_its_tier_lacks_from_the_others(limiter: Limiter) -> None:
    """The 429's x-ratelimit-* headers are the tier that said no, for each family it has;
    a family it has no limit for comes from the tier that has one, as it stands."""
    team = tier("team", "t1", tokens_per_minute=10_000, rps=100)
    key = tier("key", "k1", rps=1, burst=1)
    assert isinstance(await limiter.admit(req("a", [team, key], reserve=10)), Admitted)
    v = await limiter.admit(req("b", [team, key], reserve=10))
    assert (v.tier, v.limit) == ("key", "rps")
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (10_000, 9_990) and v.rate.req_limit == 1
    assert v.rate.tok_reset == pytest.approx(120, abs=0.002)  # this minute's 10 slide out next
    tight = tier("key", "k2", tokens_per_minute=5)
    assert isinstance(await limiter.admit(req("c0", [team, tight], reserve=3)), Admitted)
    v = await limiter.admit(req("c", [team, tight], reserve=3))
    assert (v.tier, v.limit) == ("key", "tokens_per_minute")
    assert (v.rate.req_limit, v.rate.req_remaining) == (100, 98) and v.rate.tok_limit == 5
    assert v.rate.req_reset == pytest.approx(0.02, abs=0.002)


async def test_renew_names_the_requests_that_hold_nothing_any_more(limiter: Limiter) -> None:
    """A request settled elsewhere (its end reached another instance) or never admitted:
    the renewer is told, and stops renewing it."""
    key = tier("key", "k1", concurrency=2)
    assert isinstance(await limiter.admit(req("live", [key])), Admitted)
    assert isinstance(await limiter.admit(req("done", [key])), Admitted)
    await limiter.settle("done", 0)
    gone = await limiter.renew(["live", "done", "never-seen"], T0 + 1)
    assert sorted(gone) == ["done", "never-seen"]


async def test_an_admission_nobody_follows_frees_its_slot_after_the_start_ttl(
        start_ttl_limiter: Limiter) -> None:
    """The client left between the Check and ext_proc: no stream renews the first lease."""
    lim, key = start_ttl_limiter, tier("key", "k1", concurrency=1)
    assert isinstance(await lim.admit(req("left", [key])), Admitted)
    assert isinstance(await lim.admit(req("x", [key], T0 + 4)), Refused)
    assert isinstance(await lim.admit(req("x", [key], T0 + 6)), Admitted)


async def test_a_stream_that_began_renews_past_the_start_ttl(start_ttl_limiter: Limiter) -> None:
    lim, key = start_ttl_limiter, tier("key", "k1", concurrency=1)
    assert isinstance(await lim.admit(req("began", [key])), Admitted)
    await lim.renew(["began"], T0 + 2)  # ext_proc began: the lease now ends at T0 + 62
    assert isinstance(await lim.admit(req("x", [key], T0 + 61)), Refused)
    assert isinstance(await lim.admit(req("x", [key], T0 + 63)), Admitted)


async def test_reservation_then_settlement(limiter: Limiter) -> None:
    key = tier("key", "k1", tokens_per_day=1000)
    assert isinstance(await limiter.admit(req("a", [key], reserve=600)), Admitted)
    v = await limiter.admit(req("b", [key], reserve=600))  # 600 + 600 > 1000: reserved
    assert isinstance(v, Refused) and v.limit == "tokens_per_day"
    await limiter.settle("a", 100)  # actual 100 replaces the 600 reserved
    assert isinstance(await limiter.admit(req("b", [key], reserve=600)), Admitted)
    await limiter.settle("b", 850)  # 100 + 850 = 950 used
    v = await limiter.admit(req("c", [key], reserve=100))
    assert isinstance(v, Refused)
    await limiter.settle("b", 850)  # a second settlement changes nothing
    assert isinstance(await limiter.admit(req("c", [key], reserve=50)), Admitted)


async def test_unknown_usage_keeps_the_reservation(limiter: Limiter) -> None:
    key = tier("key", "k1", tokens_per_minute=100)
    assert isinstance(await limiter.admit(req("a", [key], reserve=80)), Admitted)
    await limiter.settle("a", None)
    assert isinstance(await limiter.admit(req("b", [key], reserve=30)), Refused)


async def test_minute_window_slides(limiter: Limiter) -> None:
    key = tier("key", "k1", tokens_per_minute=100)
    start = T0 - (T0 % 60)  # the start of a minute
    assert isinstance(await limiter.admit(req("a", [key], start + 1, reserve=100)), Admitted)
    assert isinstance(await limiter.admit(req("b", [key], start + 59, reserve=10)), Refused)
    # 30 s into the next minute, half of the previous minute's 100 still counts.
    assert isinstance(await limiter.admit(req("b", [key], start + 60 + 29, reserve=60)), Refused)
    assert isinstance(await limiter.admit(req("b", [key], start + 60 + 31, reserve=45)), Admitted)


async def test_day_quota_is_insufficient_quota_until_midnight(limiter: Limiter) -> None:
    key = tier("key", "k1", tokens_per_day=10)
    assert isinstance(await limiter.admit(req("a", [key], reserve=10)), Admitted)
    v = await limiter.admit(req("b", [key], reserve=1))
    assert isinstance(v, Refused) and v.limit == "tokens_per_day"
    midnight = T0 - (T0 % 86400) + 86400
    assert abs(v.retry_after - (midnight - T0)) < 2
    assert isinstance(await limiter.admit(req("b", [key], midnight + 1, reserve=1)), Admitted)


async def test_three_tiers_report_the_tightest(limiter: Limiter) -> None:
    tiers = [tier("model", "m", rps=100), tier("team", "t", rps=10), tier("key", "k", rps=5)]
    v = await limiter.admit(req("a", tiers))
    assert isinstance(v, Admitted) and v.rate.req_limit == 5 and v.rate.req_remaining == 4
    model_only = [tier("model", "m", rps=1, burst=1), tier("key", "k2", rps=5)]
    denied = await limiter.admit(req("b", model_only, T0 + 1))
    assert isinstance(denied, Admitted)
    denied = await limiter.admit(req("c", model_only, T0 + 1))
    assert isinstance(denied, Refused) and denied.tier == "model"


async def test_orphans_are_swept_once_and_their_reservation_cancelled(limiter: Limiter) -> None:
    lim = limiter
    key = tier("key", "k1", concurrency=1, tokens_per_day=1000)
    admit = AdmitRequest("lost", (key,), 600, T0, meta='["k1","t","m","/v1/chat/completions",true]')
    assert isinstance(await lim.admit(admit), Admitted)
    await lim.admit(req("settled", [key], T0))  # denied: the slot is held by 'lost'
    assert await lim.sweep(T0 + 59) == []  # its lease is still live
    [orphan] = await lim.sweep(T0 + 61)
    assert (orphan.request_id, orphan.charged) == ("lost", 0)
    assert orphan.meta.startswith('["k1"')
    assert await lim.sweep(T0 + 62) == []  # claimed exactly once
    v = await lim.admit(req("next", [key], T0 + 62, reserve=1000))
    assert isinstance(v, Admitted)  # the slot is free and the 600 reserved were given back
    await lim.settle("lost", 500)  # a late settlement finds nothing to change
    assert isinstance(await lim.admit(req("more", [key], T0 + 64, reserve=1)), Refused)


async def test_an_orphan_is_charged_its_last_checkpoint(limiter: Limiter) -> None:
    """Renewals carry the stream's usage so far; a sidecar that dies leaves the sweep that
    much to bill (the event's usage_source `checkpoint`), and the counters agree."""
    lim = limiter
    key = tier("key", "ck", concurrency=2, tokens_per_day=1000)
    meta = '["ck","t","m","/v1/chat/completions",true]'
    streaming = AdmitRequest("streaming", (key,), 600, T0, meta=meta)
    assert isinstance(await lim.admit(streaming), Admitted)
    await lim.renew(["streaming"], T0 + 10, {"streaming": (12, 30)})
    await lim.renew(["streaming"], T0 + 20, {"streaming": (12, 55)})  # the latest wins
    await lim.renew(["streaming"], T0 + 30)  # a renewal without one keeps it
    [orphan] = await lim.sweep(T0 + 91)
    assert (orphan.request_id, orphan.checkpoint, orphan.charged) == ("streaming", (12, 55), 67)
    # 1000 - 67 left for the day: 933 fit, 934 do not
    assert isinstance(await lim.admit(req("big", [key], T0 + 92, reserve=934)), Refused)
    assert isinstance(await lim.admit(req("fits", [key], T0 + 92, reserve=933)), Admitted)


async def test_an_orphan_comes_back_with_its_admission_time(limiter: Limiter) -> None:
    """The sweep returns when the orphan was admitted (its event's `started_at`), also
    for an admission swept by another request's id than it was first written under (a
    ticket bound to its request: the request's own time)."""
    ts = (tier("key", "at", concurrency=100, tokens_per_day=100_000),)
    meta = '["at","t","m","/v1/chat/completions",true]'
    taken = metrics.child(metrics.TICKETS, "taken")
    before = taken._value.get()
    for rid, at in (("first", T0 + 0.125), ("second", T0 + 2.5)):
        assert isinstance(await limiter.admit(AdmitRequest(rid, ts, 100, at, meta=meta)),
                          Admitted)
        for _ in range(1000):  # admitting ahead: the next ticket is written (after a bind)
            if not isinstance(limiter, AheadLimiter) or limiter._shelf:
                break
            await asyncio.sleep(0.01)
    if isinstance(limiter, AheadLimiter):
        assert taken._value.get() == before + 1  # "second" took the ticket "first" asked
    orphans = {o.request_id: o for o in await limiter.sweep(T0 + 91)}
    assert orphans["first"].admitted_at == T0 + 0.125
    assert orphans["second"].admitted_at == T0 + 2.5


async def test_a_live_request_id_is_never_admitted_twice(limiter: Limiter) -> None:
    """An Envoy that keeps client ids must not let one repeated id share an admission (and
    bypass the concurrency limit): refused while live, admitted again once it ended."""
    key = tier("key", "dup", concurrency=2)
    assert isinstance(await limiter.admit(req("same", [key])), Admitted)
    v = await limiter.admit(req("same", [key]))
    assert isinstance(v, DuplicateId)
    # the limit itself still holds
    assert isinstance(await limiter.admit(req("other", [key])), Admitted)
    assert isinstance(await limiter.admit(req("third", [key])), Refused)
    await limiter.settle("same", None)
    assert isinstance(await limiter.admit(req("same", [key], T0 + 1)), Admitted)


async def test_an_abandoned_admission_is_swept_at_once(limiter: Limiter) -> None:
    """A request whose record was unreadable: the next sweep frees it and bills its last
    checkpoint, without waiting for its lease (or the sweep's grace) to run out."""
    key = tier("key", "ab", concurrency=1, tokens_per_day=1000)
    meta = '["ab","t","m","/v1/chat/completions",true]'
    garbled = AdmitRequest("garbled", (key,), 600, T0, meta=meta)
    assert isinstance(await limiter.admit(garbled), Admitted)
    await limiter.renew(["garbled"], T0 + 1, {"garbled": (10, 20)})
    assert await limiter.sweep(T0 + 2) == []
    await limiter.end_many([Abandon("garbled")])
    [orphan] = await limiter.sweep(T0 + 2)
    assert (orphan.request_id, orphan.charged, orphan.checkpoint) == ("garbled", 30, (10, 20))
    assert isinstance(await limiter.admit(req("next", [key], T0 + 3, reserve=970)), Admitted)


async def test_void_undoes_a_late_admission_in_either_order(redis_url: str) -> None:
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=60, deadline=SLACK)
    key = tier("key", "k1", concurrency=1, tokens_per_day=100)
    # the admission ran, then its caller gave up: the void releases it
    assert isinstance(await lim.admit(req("late", [key], reserve=100)), Admitted)
    await lim.void("late")
    assert (await lim.sweep(T0 + 120)) == []  # nothing left to orphan
    # the void arrived first: the admission, when it finally runs, is refused
    await lim.void("later")
    v = await lim.admit(req("later", [key], reserve=100))
    assert isinstance(v, Voided)
    # all 100 still there
    assert isinstance(await lim.admit(req("next", [key], reserve=100)), Admitted)
    await lim.close()


async def test_an_orphan_outlives_a_stretch_with_no_sweep(redis_url: str) -> None:
    """The only sidecar was killed mid-stream and took a while to come back (a crash loop, a
    loaded machine): the first sweep after it still claims the orphan and bills its last
    checkpoint. Its record once expired three leases after its last renewal, and the sweep
    then took its id out of gw:reqs and returned nothing: no event, the reservation kept."""
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=0.2, deadline=SLACK)
    key = tier("key", "k1", concurrency=1, tokens_per_day=1000)
    meta = '["k1","t","m","/v1/chat/completions",true]'
    try:
        now = time.time()
        assert isinstance(await lim.admit(AdmitRequest("cut", (key,), 600, now, meta=meta)),
                          Admitted)
        await lim.renew(["cut"], time.time(), {"cut": (5, 10)})
        await asyncio.sleep(1.0)  # five leases: nobody sweeps meanwhile
        [orphan] = await lim.sweep(time.time())
        assert (orphan.request_id, orphan.checkpoint, orphan.charged) == ("cut", (5, 10), 15)
        # 1000 - 15 left for the day: the 600 reserved were given back
        assert isinstance(await lim.admit(req("next", [key], time.time(), reserve=985)),
                          Admitted)
    finally:
        await lim.close()


async def test_an_orphan_whose_record_is_gone_is_reported_lost(redis_url: str) -> None:
    """Past even its record's TTL (or a record deleted by hand) the sweep still claims the
    id, and says it is lost instead of dropping it without a trace: the ledger logs it and
    counts it (gateway_orphan_records_lost_total), and bills nothing from it."""
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=0.2, deadline=SLACK)
    key = tier("key", "k2", concurrency=1, tokens_per_day=1000)
    try:
        assert isinstance(await lim.admit(AdmitRequest("gone", (key,), 600, time.time(),
                                                       meta="[]")), Admitted)
        await lim.redis.call("DEL", "gw:req:gone")
        await asyncio.sleep(0.3)
        [orphan] = await lim.sweep(time.time())
        assert (orphan.request_id, orphan.lost, orphan.charged) == ("gone", True, 0)
        assert await lim.sweep(time.time()) == []  # claimed once
    finally:
        await lim.close()


@pytest.mark.serial  # 0.5 s against a 0.1 s deadline: no room for another worker's load
async def test_a_stalled_redis_fails_admissions_at_the_deadline(tmp_path: Path) -> None:
    """Past its deadline an admission fails closed with StoreInDoubt (the caller then voids
    it), well before the connection's own stall timeout, and the limiter recovers."""
    redis = redis_service(free_port(), tmp_path).start()
    lim = RedisLimiter(RespClient(f"redis://{redis.address}/0", timeout=2.0), lease_ttl=60,
                       deadline=0.1)
    key = [tier("key", "k1", rps=1000)]
    try:
        assert isinstance(await lim.admit(req("warm", key)), Admitted)
        redis.pause()
        t0 = time.monotonic()
        results = await asyncio.gather(*(lim.admit(req(f"r{i}", key)) for i in range(20)),
                                       return_exceptions=True)
        took = time.monotonic() - t0
        assert all(isinstance(r, StoreInDoubt) for r in results), results
        assert 0.09 < took < 0.5, took  # the 0.1 s deadline, not the 2 s stall timeout
        redis.resume()
        assert isinstance(await lim.admit(req("after", key, T0 + 1)), Admitted)
    finally:
        redis.resume()
        await lim.close()
        redis.stop()


async def test_an_admission_whose_connection_died_after_sending_is_in_doubt(
        tmp_path: Path) -> None:
    """A reply overdue on the shared connection closes it and fails every command written on
    it, an admission sent a moment ago included: Redis may have run that one, so it fails
    as in doubt (the caller voids it), never as a plain outage that leaks an admission."""
    redis = redis_service(free_port(), tmp_path).start()
    lim = RedisLimiter(RespClient(f"redis://{redis.address}/0", timeout=0.3), lease_ttl=60,
                       deadline=5.0)
    key = [tier("key", "k1", concurrency=1)]
    try:
        assert (await lim.ping())
        redis.pause()
        ping = asyncio.ensure_future(lim.redis.call("PING"))  # overdue first: closes it
        await asyncio.sleep(0.1)
        result = await asyncio.gather(lim.admit(req("sent", key)), return_exceptions=True)
        assert isinstance(result[0], StoreInDoubt), result
        with pytest.raises(RedisLost):
            await ping
        redis.resume()
        await lim.void("sent")  # what the caller does with an admission in doubt
        assert isinstance(await lim.admit(req("next", key, T0 + 1)), Admitted)  # its slot is free
    finally:
        redis.resume()
        await lim.close()
        redis.stop()


# One quota across spokes (DESIGN §10): the spoke enforces its allowance of a global quota
# beside its other limits, in the same atomic decision.

def allowances_of(limiter: Limiter) -> AllowanceStore:
    """Where this store's allowances are written: the same Redis, or the same process."""
    if isinstance(limiter, AheadLimiter):
        limiter = limiter.inner
    if isinstance(limiter, RedisLimiter):
        return RedisAllowances(limiter.redis)
    assert isinstance(limiter, MemoryLimiter)
    return limiter


DAY_ID = maths.day_id(T0)


async def test_a_spoke_without_an_allowance_enforces_the_fallback_share(limiter: Limiter) -> None:
    team = tier("team", "g", global_tokens_per_day=1000)
    fallback = maths.fallback_allowance(1000)
    assert fallback == 100  # 10 %: stated in the README and docs/contracts.md
    for i in range(10):
        assert isinstance(await limiter.admit(req(f"r{i}", [team], reserve=10)), Admitted)
    v = await limiter.admit(req("over", [team], reserve=10))
    assert isinstance(v, Refused) and (v.tier, v.limit, v.limit_value) == ("team", GTPD, 100)
    assert v.rate.tok_limit == 100 and v.rate.tok_remaining == 0


async def test_the_allowance_is_the_spokes_total_and_denies_atomically(limiter: Limiter) -> None:
    team = tier("team", "g", global_tokens_per_day=1000)
    key = tier("key", "k1", rps=1, burst=1)
    store = allowances_of(limiter)
    applied = await store.apply_allowances(1, [Allowance("team:g", "day", DAY_ID, 300)])
    assert applied == [Applied("team:g", "day", DAY_ID, 300, 0)]
    assert isinstance(await limiter.admit(req("a", [team], reserve=250)), Admitted)
    v = await limiter.admit(req("b", [team, key], reserve=100))  # 350 > 300: denied
    assert isinstance(v, Refused) and (v.tier, v.limit, v.limit_value) == ("team", GTPD, 300)
    # The denial at the team's quota spent nothing of the key's one RPS cell:
    assert isinstance(await limiter.admit(req("c", [team, key], reserve=50)), Admitted)
    if isinstance(limiter, RedisLimiter):  # the spoke's own counter expires after its day
        ttl = await limiter.redis.call("PTTL", f"gw:gtpd:team:g:{DAY_ID}")
        assert 86_400_000 < int(ttl) <= 172_800_000
    # A larger total from the allocator (not an increment: the counter stays the truth).
    applied = await store.apply_allowances(2, [Allowance("team:g", "day", DAY_ID, 400)])
    assert applied == [Applied("team:g", "day", DAY_ID, 400, 300)]
    assert isinstance(await limiter.admit(req("d", [team], reserve=100)), Admitted)
    assert isinstance(await limiter.admit(req("e", [team], reserve=1)), Refused)


async def test_settlement_gives_back_the_allowance_it_did_not_use(limiter: Limiter) -> None:
    team = tier("team", "g", global_tokens_per_month=10_000)
    store = allowances_of(limiter)
    month = maths.month_id(T0)
    await store.apply_allowances(1, [Allowance("team:g", "month", month, 500)])
    assert isinstance(await limiter.admit(req("a", [team], reserve=400)), Admitted)
    v = await limiter.admit(req("b", [team], reserve=200))
    assert isinstance(v, Refused) and v.limit == GTPMO
    await limiter.settle("a", 100)  # actual 100 replaces the 400 reserved
    assert isinstance(await limiter.admit(req("b", [team], reserve=400)), Admitted)


async def test_an_allowance_is_never_stored_below_use_nor_an_older_one_applied(
        limiter: Limiter) -> None:
    key = tier("key", "k1", global_tokens_per_day=10_000)
    store = allowances_of(limiter)
    await store.apply_allowances(5, [Allowance("key:k1", "day", DAY_ID, 1000)])
    assert isinstance(await limiter.admit(req("a", [key], reserve=600)), Admitted)
    applied = await store.apply_allowances(6, [Allowance("key:k1", "day", DAY_ID, 200)])
    assert applied == [Applied("key:k1", "day", DAY_ID, 600, 600)]  # lowered only to its use
    assert isinstance(await limiter.admit(req("b", [key], reserve=1)), Refused)
    # A replayed or older generation changes nothing (the allocator may have moved on).
    assert await store.apply_allowances(5, [Allowance("key:k1", "day", DAY_ID, 5000)]) is None
    assert await store.allowance_generation() == 6
    again = await store.apply_allowances(6, [Allowance("key:k1", "day", DAY_ID, 200)])
    assert again == applied  # the same generation again: the same answer
    assert isinstance(await limiter.admit(req("b", [key], reserve=1)), Refused)


async def test_the_next_day_starts_on_its_fallback_share(limiter: Limiter) -> None:
    team = tier("team", "g", global_tokens_per_day=1000)
    await allowances_of(limiter).apply_allowances(
        1, [Allowance("team:g", "day", DAY_ID, 1000)])
    assert isinstance(await limiter.admit(req("a", [team], reserve=900)), Admitted)
    midnight = T0 - (T0 % 86400) + 86400
    assert isinstance(await limiter.admit(req("b", [team], midnight + 1, reserve=100)), Admitted)
    assert isinstance(await limiter.admit(req("c", [team], midnight + 1, reserve=1)), Refused)


async def test_each_day_keeps_its_own_allowance_and_count_across_midnight(
        limiter: Limiter) -> None:
    """An allowance for yesterday that arrives after midnight changes nothing today, and a
    request admitted just before midnight and settled after it counts in the day it was
    admitted (the allocator counts its event by `started_at` alike)."""
    team = tier("team", "g", global_tokens_per_day=1000)
    midnight = T0 - (T0 % 86400) + 86400
    yesterday = maths.day_id(midnight - 1)
    store = allowances_of(limiter)
    await store.apply_allowances(1, [Allowance("team:g", "day", yesterday, 300)])
    assert isinstance(await limiter.admit(req("late", [team], midnight - 0.1, reserve=250)),
                      Admitted)
    await store.apply_allowances(2, [Allowance("team:g", "day", yesterday, 900)])  # late
    v = await limiter.admit(req("big", [team], midnight + 0.1, reserve=101))
    assert isinstance(v, Refused) and (v.limit, v.limit_value) == (GTPD, 100)  # the fallback
    await limiter.settle("late", 50)  # after midnight: 50 of the 250 it reserved
    assert isinstance(await limiter.admit(req("t", [team], midnight + 1, reserve=100)), Admitted)
    assert isinstance(await limiter.admit(req("y", [team], midnight - 0.05, reserve=850)),
                      Admitted)  # yesterday: 50 + 850 of its 900
    assert isinstance(await limiter.admit(req("y2", [team], midnight - 0.04, reserve=1)),
                      Refused)


async def test_an_allowance_raises_the_spokes_count_to_the_use_the_allocator_knows(
        limiter: Limiter) -> None:
    """A global limit added mid-day: the spoke's counter starts at 0, while the allocator
    counts the day's whole use, and hands out allowances never below it. The spoke raised
    its counter to nothing: a team that had used the whole new quota before it could use
    it again every allocation round. The allocator's `used` (its events) raises the
    counter where below, never lowers it."""
    team = tier("team", "g", global_tokens_per_day=1000)
    store = allowances_of(limiter)
    applied = await store.apply_allowances(
        1, [Allowance("team:g", "day", DAY_ID, 1000, known=1000)])
    assert applied == [Applied("team:g", "day", DAY_ID, 1000, 1000)]
    v = await limiter.admit(req("a", [team], reserve=1))
    assert isinstance(v, Refused) and (v.limit, v.limit_value) == (GTPD, 1000)
    if isinstance(allowances_of(limiter), RedisAllowances):  # the counter made has a TTL
        redis = store.redis  # type: ignore[attr-defined]
        ttl = await redis.call("PTTL", f"gw:gtpd:team:g:{DAY_ID}")
        assert 86_400_000 < int(ttl) <= 172_800_000
    applied = await store.apply_allowances(
        2, [Allowance("team:g", "day", DAY_ID, 1500, known=200)])  # below: unchanged
    assert applied == [Applied("team:g", "day", DAY_ID, 1500, 1000)]
    assert isinstance(await limiter.admit(req("b", [team], reserve=500)), Admitted)
    assert isinstance(await limiter.admit(req("c", [team], reserve=1)), Refused)


async def test_a_raised_count_keeps_the_reservations_in_flight(limiter: Limiter) -> None:
    """The allocator's `used` counts settled use only (its events); the spoke's counter also
    holds the reservations of requests in flight. Raised to `used` alone, the counter lost
    them: a 1,000 quota added after 600 used, one request (100) in flight on the fallback
    share, then 400 more admitted: 1,100 served, the counter at 1,000."""
    from gateway.limits.types import Settle
    team = tier("team", "g", global_tokens_per_day=1000)
    store = allowances_of(limiter)
    await store.apply_allowances(1, [Allowance("team:g", "day", DAY_ID, 1000)])
    assert isinstance(await limiter.admit(req("a", [team], reserve=100)), Admitted)
    applied = await store.apply_allowances(
        2, [Allowance("team:g", "day", DAY_ID, 1000, known=600)])
    assert applied == [Applied("team:g", "day", DAY_ID, 1000, 700)]  # 600 + a's 100
    assert isinstance(await limiter.admit(req("b", [team], reserve=300)), Admitted)
    assert isinstance(await limiter.admit(req("c", [team], reserve=1)), Refused)
    await limiter.end_many([Settle("a", 100), Settle("b", 300)])
    applied = await store.apply_allowances(  # the events of a and b now in `used`: even
        3, [Allowance("team:g", "day", DAY_ID, 1000, known=1000)])
    assert applied == [Applied("team:g", "day", DAY_ID, 1000, 1000)]


async def test_an_allowance_admits_no_request_larger_than_what_is_left(limiter: Limiter) -> None:
    """A local limit lets one oversize request through an empty window (else it could never
    run); an allowance is only a share of the quota: the request waits for more share."""
    team = tier("team", "g", global_tokens_per_day=10_000)
    await allowances_of(limiter).apply_allowances(1, [Allowance("team:g", "day", DAY_ID, 8)])
    v = await limiter.admit(req("big", [team], reserve=22))
    assert isinstance(v, Refused) and (v.limit, v.limit_value) == (GTPD, 8)
    assert isinstance(await limiter.admit(req("small", [team], reserve=8)), Admitted)


async def test_counters_say_where_a_tier_stands_after_admissions_and_a_settlement(
        limiter: Limiter) -> None:
    """`keys show` reads these: both stores report the same use after the same history."""
    from gateway.limits.standing import standing
    from gateway.limits.types import Settle

    t = tier("key", "show", rps=5, concurrency=4, tokens_per_minute=1000, tokens_per_day=5000)
    for rid in ("s1", "s2", "s3"):
        assert isinstance(await limiter.admit(req(rid, [t], reserve=100)), Admitted)
    await limiter.end_many([Settle("s1", 40)])  # ended: its lease freed, 40 tokens, not 100
    counters = await limiter.counters("key:show", T0)
    got = {w.limit: (w.used, w.left) for w in standing(t, counters, T0).windows}
    assert got == {"rps": (3, 2), "concurrency": (2, 2), "tokens_per_minute": (240, 760),
                   "tokens_per_day": (240, 4760)}


async def test_counters_hold_a_global_quotas_use_and_this_spokes_allowance(
        limiter: Limiter) -> None:
    """`keys show` reads these for a global quota: the spoke's use, and the allowance held
    (none: None, admission enforces the fallback share)."""
    t = tier("key", "glob", global_tokens_per_day=10_000, global_tokens_per_month=90_000)
    await allowances_of(limiter).apply_allowances(1, [Allowance("key:glob", "day", DAY_ID, 800)])
    assert isinstance(await limiter.admit(req("g1", [t], reserve=100)), Admitted)
    c = await limiter.counters("key:glob", T0)
    assert (c.global_day, c.global_month, c.allowance_day, c.allowance_month) == (
        100, 100, 800, None)


# --- the answers a 429 gives (issue 21) -------------------------------------------------------

MINUTE_START = T0 - (T0 % 60)


@pytest.mark.parametrize(("first_at", "probe_at", "wait"), [
    (10, 20, 40 + 60 / 9),  # this minute's 900 only slides out in the next minute
    (10, 63, 60 / 9 - 3),  # the previous minute's 900 slides out as this one goes on
])
async def test_a_tokens_per_minute_retry_after_is_exactly_when_it_fits(
        limiter: Limiter, first_at: float, probe_at: float, wait: float) -> None:
    """Waiting the retry-after admits the request; a second less does not."""
    key = tier("key", "slide", tokens_per_minute=1000)
    first = await limiter.admit(req("first", [key], MINUTE_START + first_at, 900))
    assert isinstance(first, Admitted)
    now = MINUTE_START + probe_at
    v = await limiter.admit(req("probe", [key], now, 200))
    assert isinstance(v, Refused) and v.limit == "tokens_per_minute" and not v.impossible
    assert v.retry_after == pytest.approx(wait, abs=0.002)
    soon = await limiter.admit(req("soon", [key], now + v.retry_after - 1, 200))
    assert isinstance(soon, Refused)
    soon = await limiter.admit(req("soon", [key], now + v.retry_after - 0.01, 200))
    assert isinstance(soon, Refused)
    assert isinstance(await limiter.admit(req("then", [key], now + v.retry_after, 200)), Admitted)


async def test_the_retry_after_is_the_longest_wait_of_every_limit_that_refuses(
        limiter: Limiter) -> None:
    """The limit with the longest wait is named, and its wait is the retry: it binds."""
    for name, tiers, named in (
            ("tok-first", [tier("team", "t-a", tokens_per_minute=1000),
                           tier("key", "k-a", rps=1, burst=1)], "team"),
            ("rps-first", [tier("team", "t-b", rps=1, burst=1),
                           tier("key", "k-b", tokens_per_minute=1000)], "key")):
        first = await limiter.admit(req(f"{name}-1", tiers, MINUTE_START + 10, 900))
        assert isinstance(first, Admitted)
        v = await limiter.admit(req(f"{name}-2", tiers, MINUTE_START + 10.5, 200))
        assert isinstance(v, Refused) and (v.tier, v.limit) == (named, "tokens_per_minute"), name
        assert v.retry_after == pytest.approx(49.5 + 60 / 9, abs=0.002), name
        assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 100), name


async def test_the_limit_named_is_the_one_that_binds_the_wait(limiter: Limiter) -> None:
    """In a tier and across tiers, whatever the order they are checked in: the day quota
    spent (waiting for midnight) is named over the rps, the minute and the concurrency
    refusing with it, with its own numbers; equal waits keep the order checked."""
    now = MINUTE_START + 30
    to_midnight = maths.seconds_to_day_end(now)
    key = tier("key", "k-day", rps=1, burst=1, concurrency=1, tokens_per_minute=1000,
               tokens_per_day=1000)
    assert isinstance(await limiter.admit(req("d-1", [key], now, 400)), Admitted)
    v = await limiter.admit(req("d-2", [key], now, 700))  # every limit of the key refuses
    assert isinstance(v, Refused) and not v.impossible
    assert (v.tier, v.limit, v.limit_value) == ("key", "tokens_per_day", 1000)
    assert v.retry_after == pytest.approx(to_midnight, abs=0.002)
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 600)
    assert v.rate.tok_reset == pytest.approx(to_midnight, abs=0.002)
    assert (v.rate.req_limit, v.rate.req_remaining) == (1, 0)
    # across tiers: the model's rps (checked first) and the key's month
    tiers = [tier("model", "m-mo", rps=1, burst=1), tier("key", "k-mo", tokens_per_month=1000)]
    assert isinstance(await limiter.admit(req("m-1", tiers, now, 900)), Admitted)
    v = await limiter.admit(req("m-2", tiers, now, 200))
    assert isinstance(v, Refused) and (v.tier, v.limit) == ("key", "tokens_per_month")
    assert v.retry_after == pytest.approx(maths.seconds_to_month_end(now), abs=0.002)
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 100)
    # equal waits (two day quotas): the first checked
    both = [tier("team", "t-eq", tokens_per_day=1000), tier("key", "k-eq", tokens_per_day=1000)]
    assert isinstance(await limiter.admit(req("e-1", both, now, 900)), Admitted)
    v = await limiter.admit(req("e-2", both, now, 200))
    assert isinstance(v, Refused) and (v.tier, v.limit) == ("team", "tokens_per_day")


def free(rid: str, tiers: list[TierLimit], now: float = T0) -> AdmitRequest:
    """A request no token window applies to (count_tokens): it reserves none."""
    return AdmitRequest(rid, tuple(tiers), 0, now, tokens=False)


async def test_a_request_free_of_token_windows_passes_a_spent_one(limiter: Limiter) -> None:
    """Checked for rps and concurrency only, it counts in no token window and holds nothing
    when it takes no slot; a request that merely reserves 0 is still refused."""
    key = tier("key", "k-free", tokens_per_minute=1000, tokens_per_day=1000,
               tokens_per_month=1000)
    spent = await limiter.admit(req("spend", [key], T0, 1000))
    assert isinstance(spent, Admitted)
    await limiter.settle("spend", 1200)  # it used more than it reserved: every window over
    zero = await limiter.admit(req("zero", [key], T0, 0))
    assert isinstance(zero, Refused) and zero.limit == "tokens_per_month"  # the longest
    for i in range(3):
        v = await limiter.admit(free(f"free-{i}", [key]))
        assert isinstance(v, Admitted), v
        assert not v.owes_settlement and v.rate.tok_limit is None
    c = await limiter.counters("key:k-free", T0)
    assert (c.minute_cur, c.day, c.month) == (1200, 1200, 1200)


async def test_a_request_free_of_token_windows_is_held_to_rps_and_concurrency(
        limiter: Limiter) -> None:
    key = tier("key", "k-free-rc", rps=1, burst=1, concurrency=2, tokens_per_day=10)
    first = await limiter.admit(free("f-1", [key]))
    assert isinstance(first, Admitted) and first.owes_settlement  # a concurrency slot
    assert first.rate.tok_limit is None
    v = await limiter.admit(free("f-2", [key]))
    assert isinstance(v, Refused) and (v.tier, v.limit) == ("key", "rps")
    assert v.rate.tok_limit is None and v.retry_after == pytest.approx(1.0, abs=0.002)
    assert isinstance(await limiter.admit(free("f-3", [key], T0 + 1)), Admitted)
    v = await limiter.admit(free("f-4", [key], T0 + 2))
    assert isinstance(v, Refused) and v.limit == "concurrency"
    await limiter.release("f-1")
    assert isinstance(await limiter.admit(free("f-5", [key], T0 + 3)), Admitted)
    assert (await limiter.counters("key:k-free-rc", T0 + 3)).day == 0


async def test_a_denial_carries_its_tiers_requests_and_tokens(limiter: Limiter) -> None:
    """An rps 429 from a tier with a token limit carries that tier's tokens as they stand,
    a token 429 its requests; a concurrency 429 says 0 requests remaining."""
    key = tier("key", "both", rps=2, burst=2, tokens_per_minute=1000, concurrency=5)
    now = MINUTE_START + 30
    assert isinstance(await limiter.admit(req("a", [key], now, 300)), Admitted)
    assert isinstance(await limiter.admit(req("b", [key], now, 300)), Admitted)
    v = await limiter.admit(req("c", [key], now, 300))
    assert v.limit == "rps"
    assert (v.rate.req_limit, v.rate.req_remaining) == (2, 0)
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 400)
    assert v.rate.tok_reset == pytest.approx(90, abs=0.002)  # this minute's 600 slide out next
    v = await limiter.admit(req("d", [key], now + 1, 500))
    assert v.limit == "tokens_per_minute"
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 400)
    assert (v.rate.req_limit, v.rate.req_remaining) == (2, 2)
    busy = tier("key", "busy", concurrency=1, tokens_per_day=10_000)
    assert isinstance(await limiter.admit(req("e", [busy], now, 10)), Admitted)
    v = await limiter.admit(req("f", [busy], now, 10))
    assert v.limit == "concurrency"
    assert (v.rate.req_limit, v.rate.req_remaining) == (1, 0)
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (10_000, 9_990)


async def test_a_reservation_larger_than_a_whole_window_is_impossible(limiter: Limiter) -> None:
    """At any tier, the model tier included, even when another tier refuses first: no wait
    helps, so that is the answer (with no retry), and nothing is consumed."""
    tiers = [tier("model", "m-big", tokens_per_minute=1000),
             tier("key", "k-big", rps=1, burst=1)]
    # spends the key's rps
    assert isinstance(await limiter.admit(req("small", tiers, T0, 10)), Admitted)
    v = await limiter.admit(req("huge", tiers, T0, 1001))
    assert isinstance(v, Refused) and v.impossible
    assert (v.tier, v.limit, v.limit_value) == ("model", "tokens_per_minute", 1000)
    assert v.rate.tok_limit == 1000 and v.rate.tok_remaining == 990
    assert isinstance(await limiter.admit(req("whole", tiers, T0 + 1, 990)), Admitted)


async def test_a_429_has_both_families_when_any_tier_limits_them(limiter: Limiter) -> None:
    """DESIGN §4: a family the refusing tier has no limit for is the tightest of every tier
    that has one, as an allowed answer picks it, as it stands (the denial consumed
    nothing); the refusing tier's own numbers are unchanged; no tier with it: absent."""
    now = MINUTE_START + 30
    # a key whose only limit is tokens_per_day, in a team with an rps
    tiers = [tier("team", "fam-t-rps", rps=2, burst=2),
             tier("key", "fam-k-tpd", tokens_per_day=1000)]
    assert isinstance(await limiter.admit(req("q-1", tiers, now, 900)), Admitted)
    v = await limiter.admit(req("q-2", tiers, now, 200))
    assert isinstance(v, Refused) and (v.tier, v.limit) == ("key", "tokens_per_day")
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 100)
    assert v.rate.tok_reset == pytest.approx(maths.seconds_to_day_end(now), abs=0.002)
    assert (v.rate.req_limit, v.rate.req_remaining) == (2, 1)  # the team's, as q-1 left it
    assert v.rate.req_reset == pytest.approx(0.5, abs=0.002)
    # a key's rps refuses; the model's minute is the tightest of two token tiers
    tiers = [tier("model", "fam-m-tpm", tokens_per_minute=1000),
             tier("team", "fam-t-tpd", tokens_per_day=10_000),
             tier("key", "fam-k-rps", rps=1, burst=1)]
    assert isinstance(await limiter.admit(req("r-1", tiers, now, 300)), Admitted)
    v = await limiter.admit(req("r-2", tiers, now, 300))
    assert isinstance(v, Refused) and (v.tier, v.limit) == ("key", "rps")
    assert (v.rate.req_limit, v.rate.req_remaining) == (1, 0)
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 700)
    assert v.rate.tok_reset == pytest.approx(90, abs=0.002)  # this minute's 300 slide out next
    # a key's concurrency refuses: its requests family stays its own (not the team's rps)
    tiers = [tier("team", "fam-t-tpm", rps=100, tokens_per_minute=5000),
             tier("key", "fam-k-conc", concurrency=1)]
    assert isinstance(await limiter.admit(req("c-1", tiers, now, 100)), Admitted)
    v = await limiter.admit(req("c-2", tiers, now, 100))
    assert isinstance(v, Refused) and (v.tier, v.limit) == ("key", "concurrency")
    assert (v.rate.req_limit, v.rate.req_remaining) == (1, 0)
    assert v.rate.req_reset == pytest.approx(1.0, abs=0.002)
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (5000, 4900)
    # no tier with an rps: no requests family
    tiers = [tier("team", "fam-t-none", concurrency=10),
             tier("key", "fam-k-tpm", tokens_per_minute=500)]
    assert isinstance(await limiter.admit(req("n-1", tiers, now, 400)), Admitted)
    v = await limiter.admit(req("n-2", tiers, now, 200))
    assert isinstance(v, Refused) and (v.tier, v.limit) == ("key", "tokens_per_minute")
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (500, 100)
    assert v.rate.req_limit is None and v.rate.req_remaining is None
    assert v.rate.req_reset is None
