"""Limiter behaviour, run against both stores (limits/memory.py and the Redis Lua): all or
nothing over three tiers, leases, token reservations and their settlement, the windows.

Time is the harness's FakeClock, passed in as `now`: Redis is given the same instants, so
nothing sleeps. The probes (`in_flight`, `windows`, ...) read each store's own state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from gateway.clock import FakeClock
from gateway.limits.memory import MemoryLimiter
from gateway.limits.redis_store import MAX_BATCH, RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import (
    AdmitRequest,
    Admitted,
    Limiter,
    Refused,
    Release,
    Settle,
    Verdict,
    Void,
)
from gateway.policy.model import LimitSpec, TierLimit

# The store's deadline, not under test here: room for a first connection and script load
# on a busy CI machine (the 250 ms default failed there once).
SLACK = 5.0

T0 = 1_800_000_000.0


def spec(**kw: Any) -> LimitSpec:
    if "rps" in kw and "burst" not in kw:
        kw["burst"] = 1
    return LimitSpec(**kw)


def team(**kw: Any) -> TierLimit:
    return TierLimit("team", "team-a", spec(**kw))


def key(name: str = "k1", **kw: Any) -> TierLimit:
    return TierLimit("key", name, spec(**kw))


def model(**kw: Any) -> TierLimit:
    return TierLimit("model", "qwen3-coder", spec(**kw))


class Harness:
    def __init__(self, lim: Limiter, start: float, db: redis.Redis | None = None) -> None:
        self.lim = lim
        self.db = db  # the Redis behind `lim`, or None for the memory store
        self.clock = FakeClock(start)
        self.n = 0

    async def admit(self, *tiers: TierLimit, reserve: int = 0, rid: str | None = None) -> Verdict:
        self.n += 1
        req = AdmitRequest(rid or f"r{self.n}", tuple(tiers), reserve, self.clock.now())
        return await self.lim.admit(req)

    async def settle(self, rid: str, actual: int | None) -> None:
        await self.lim.settle(rid, actual)

    async def used(self, tier: TierLimit) -> int:
        """Tokens counted in the tier's (single) token window, observed with a 0-token probe."""
        v = await self.admit(tier, reserve=0)
        assert isinstance(v, Admitted)
        assert v.rate.tok_limit is not None and v.rate.tok_remaining is not None
        return v.rate.tok_limit - v.rate.tok_remaining

    def in_flight(self, tier: str, name: str) -> int:
        now = self.clock.now()
        if isinstance(self.lim, MemoryLimiter):
            return self.lim.in_flight(tier, name, now)
        assert self.db is not None
        return int(self.db.zcount(f"gw:conc:{tier}:{name}", f"({int(now * 1000)}", "+inf"))

    def holds_nothing(self) -> bool:
        if isinstance(self.lim, MemoryLimiter):
            return self.lim.held == {}
        assert self.db is not None
        return not self.db.keys("gw:req:*") and not self.db.zcard("gw:reqs")

    def windows(self) -> dict[str, int]:
        """Tokens counted per window, by window kind and tier (the period dropped)."""
        if isinstance(self.lim, MemoryLimiter):
            return {w.rsplit(":", 1)[0]: int(v) for w, v in self.lim.tokens.items()}
        assert self.db is not None
        return {k.decode()[3:].rsplit(":", 1)[0]: int(self.db.get(k) or 0)
                for k in self.db.keys("gw:tp*")}

    def forget_tokens(self) -> None:
        """Lose every token window (a day rolled over between admission and settlement)."""
        if isinstance(self.lim, MemoryLimiter):
            self.lim.tokens.clear()
        elif keys := self.db.keys("gw:tp*") if self.db is not None else []:
            assert self.db is not None
            self.db.delete(*keys)


Make = Callable[..., Harness]


@pytest.fixture(params=["memory", "redis"])
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Make]:
    """A harness factory over one store; the Redis one on the session's server, flushed."""
    made: list[RedisLimiter] = []
    url = request.getfixturevalue("redis_url") if request.param == "redis" else ""

    def build(lease_ttl: float = 60.0, start: float = T0) -> Harness:
        if not url:
            return Harness(MemoryLimiter(lease_ttl=lease_ttl), start)
        lim = RedisLimiter(RespClient(url), lease_ttl=lease_ttl, deadline=SLACK)
        made.append(lim)
        return Harness(lim, start, redis.Redis.from_url(url))

    yield build
    for lim in made:
        await lim.close()


@pytest.fixture
def h(make: Make) -> Harness:
    return make()


# --- atomicity across tiers ----------------------------------------------------------------


async def test_denial_at_team_tier_consumes_nothing_at_key_tier(h: Harness) -> None:
    t, k1 = team(rps=1), key("k1", rps=1)
    # k2 takes the team's one request
    assert isinstance(await h.admit(t, key("k2", rps=1)), Admitted)

    denied = await h.admit(t, k1)
    assert isinstance(denied, Refused) and (denied.tier, denied.limit) == ("team", "rps")

    # k1's own bucket was not touched by the denied request: its one request is still there
    assert isinstance(await h.admit(k1), Admitted)
    assert isinstance(await h.admit(k1), Refused)


async def test_denial_at_key_tier_consumes_nothing_at_earlier_tiers(h: Harness) -> None:
    m, t = model(rps=1, concurrency=1), team(rps=1, tokens_per_day=1000)
    k1 = key("k1", rps=1)
    assert isinstance(await h.admit(k1), Admitted)  # k1's only request, spent outside the team

    denied = await h.admit(m, t, k1, reserve=100)
    assert isinstance(denied, Refused) and (denied.tier, denied.limit) == ("key", "rps")

    # model and team checked first and passed, but committed nothing: no rps spent,
    # no lease held, no tokens reserved
    assert h.in_flight("model", "qwen3-coder") == 0
    assert await h.used(TierLimit("team", "team-a", spec(tokens_per_day=1000))) == 0
    assert isinstance(await h.admit(m, t, key("k2"), reserve=100), Admitted)


async def test_token_denial_takes_no_lease_and_no_rps(h: Harness) -> None:
    t = team(rps=1, concurrency=1)
    k1 = key("k1", tokens_per_day=100)
    assert isinstance(await h.admit(k1, reserve=100), Admitted)  # k1's day budget now used
    denied = await h.admit(t, k1, reserve=10)
    assert (denied.tier, denied.limit) == ("key", "tokens_per_day")
    assert h.in_flight("team", "team-a") == 0
    # the team's one rps cell and its slot are still free
    assert isinstance(await h.admit(t), Admitted)


async def test_concurrency_denial_spends_no_rps(h: Harness) -> None:
    """A request refused for concurrency is not counted as a request (LiteLLM #39309: there
    a parallel-request rejection still consumes the key's RPM)."""
    k = key("k1", rps=1, burst=2, concurrency=1)
    assert isinstance(await h.admit(k, rid="a"), Admitted)  # one of the 2 burst cells
    for rid in ("b", "c", "d"):
        denied = await h.admit(k, rid=rid)
        assert isinstance(denied, Refused) and denied.limit == "concurrency"
    await h.settle("a", None)
    # the clock has not moved: the second burst cell is still there, untouched by the denials
    assert isinstance(await h.admit(k, rid="e"), Admitted)
    await h.settle("e", None)
    denied = await h.admit(k, rid="f")
    assert isinstance(denied, Refused) and denied.limit == "rps"


async def test_no_tiers_allows_and_owes_nothing(h: Harness) -> None:
    v = await h.admit()
    assert isinstance(v, Admitted) and not v.owes_settlement
    assert h.holds_nothing()


# --- denials carry tier, limit and retry_after -----------------------------------------------


async def test_rps_denial_verdict(h: Harness) -> None:
    k = key(rps=2.0, burst=1)
    assert isinstance(await h.admit(k), Admitted)
    v = await h.admit(k)
    assert isinstance(v, Refused)
    assert (v.tier, v.limit, v.limit_value) == ("key", "rps", 2.0)
    assert v.retry_after == pytest.approx(0.5)
    assert (v.rate.req_limit, v.rate.req_remaining) == (1, 0)
    h.clock.advance(0.5)
    assert isinstance(await h.admit(k), Admitted)


async def test_first_failing_tier_is_reported(h: Harness) -> None:
    m, t, k = model(concurrency=0), team(concurrency=0), key(concurrency=0)
    assert (await h.admit(m, t, k)).tier == "model"
    assert (await h.admit(t, k)).tier == "team"
    assert (await h.admit(k)).tier == "key"


async def test_tokens_per_minute_slides(h: Harness) -> None:
    start = (h.clock.now() // 60) * 60
    h.clock.t = start
    tpm = team(tokens_per_minute=1000)
    assert isinstance(await h.admit(tpm, reserve=600), Admitted)
    v = await h.admit(tpm, reserve=401)
    assert isinstance(v, Refused) and (v.limit, v.tier) == ("tokens_per_minute", "team")
    # this minute's 600 weighs fully until the minute ends, then slides out: 401 fits once
    # 600 * (1 - f) <= 599, a tenth of a second into the next minute
    assert v.retry_after == pytest.approx(60.1)
    h.clock.t = start + 90  # half-way through the next minute: 600 * 0.5 still counts
    assert isinstance(await h.admit(tpm, reserve=701), Refused)
    assert isinstance(await h.admit(tpm, reserve=700), Admitted)


async def test_tokens_per_day_resets_at_utc_midnight(make: Make) -> None:
    h = make(start=datetime(2027, 1, 15, 23, 59, tzinfo=UTC).timestamp())
    k = key(tokens_per_day=1000)
    assert isinstance(await h.admit(k, reserve=1000), Admitted)
    v = await h.admit(k, reserve=1)
    assert isinstance(v, Refused) and (v.limit, v.limit_value) == ("tokens_per_day", 1000)
    assert v.retry_after == pytest.approx(60.0)
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 0)
    h.clock.advance(59.5)
    assert isinstance(await h.admit(k, reserve=1), Refused)
    h.clock.advance(0.5)  # 00:00:00 UTC
    assert isinstance(await h.admit(k, reserve=1000), Admitted)


async def test_tokens_per_month_resets_at_month_start(make: Make) -> None:
    h = make(start=datetime(2028, 2, 29, 12, tzinfo=UTC).timestamp())
    k = key(tokens_per_month=500)
    assert isinstance(await h.admit(k, reserve=500), Admitted)
    v = await h.admit(k, reserve=1)
    assert (v.limit, v.retry_after) == ("tokens_per_month", pytest.approx(12 * 3600))
    h.clock.advance(12 * 3600)
    assert isinstance(await h.admit(k, reserve=500), Admitted)


async def test_request_larger_than_window_is_impossible(h: Harness) -> None:
    k = key(tokens_per_day=100)
    v = await h.admit(k, reserve=5000)
    assert isinstance(v, Refused) and v.impossible and v.limit == "tokens_per_day"
    assert isinstance(await h.admit(k, reserve=100), Admitted)  # it consumed nothing



async def test_zero_token_limit_admits_nothing(h: Harness) -> None:
    v = await h.admit(team(tokens_per_day=0), reserve=10)
    assert isinstance(v, Refused)
    assert (v.tier, v.limit) == ("team", "tokens_per_day")


# --- concurrency leases ----------------------------------------------------------------------


async def test_concurrency_limit_and_release_on_settle(h: Harness) -> None:
    t = team(concurrency=2)
    a, b = await h.admit(t, rid="a"), await h.admit(t, rid="b")
    assert isinstance(a, Admitted) and isinstance(b, Admitted)
    assert a.owes_settlement and b.owes_settlement
    c = await h.admit(t, rid="c")
    assert isinstance(c, Refused)
    assert (c.tier, c.limit, c.limit_value) == ("team", "concurrency", 2)
    assert c.retry_after > 0

    await h.settle("a", None)
    assert h.in_flight("team", "team-a") == 1
    assert isinstance(await h.admit(t, rid="d"), Admitted)
    assert isinstance(await h.admit(t, rid="e"), Refused)


async def test_lease_expires_without_settle(make: Make) -> None:
    h = make(lease_ttl=10.0)
    t = team(concurrency=2)
    assert isinstance(await h.admit(t), Admitted) and isinstance(await h.admit(t), Admitted)
    h.clock.advance(9.9)
    assert isinstance(await h.admit(t), Refused)
    h.clock.advance(0.1)  # both leases are now lease_ttl old: the slots come back
    assert h.in_flight("team", "team-a") == 0
    assert isinstance(await h.admit(t), Admitted) and isinstance(await h.admit(t), Admitted)


async def test_renew_extends_a_lease(make: Make) -> None:
    h = make(lease_ttl=10.0)
    t = team(concurrency=2)
    assert isinstance(await h.admit(t, rid="long"), Admitted)
    assert isinstance(await h.admit(t, rid="short"), Admitted)
    h.clock.advance(5)
    await h.lim.renew(["long"], h.clock.now())  # still streaming: good until t+15
    h.clock.advance(5)
    assert h.in_flight("team", "team-a") == 1  # "short" expired
    assert isinstance(await h.admit(t), Admitted)
    assert isinstance(await h.admit(t), Refused)
    h.clock.advance(5)
    assert h.in_flight("team", "team-a") == 1  # "long" ran out too


async def test_renew_of_settled_or_unknown_request_does_nothing(h: Harness) -> None:
    t = team(concurrency=1)
    assert isinstance(await h.admit(t, rid="a"), Admitted)
    await h.settle("a", None)
    await h.lim.renew(["a", "never-seen"], h.clock.now())
    assert h.in_flight("team", "team-a") == 0
    assert isinstance(await h.admit(t, rid="b"), Admitted)


async def test_many_live_leases_are_renewed_and_settled_a_bounded_batch_at_a_time(
        redis_url: str) -> None:
    """Thousands of live streams renewed (or settled) in one script held Redis, and every
    admission waiting on it, past the deadline: the store sends at most MAX_BATCH ids a call."""
    lim = RedisLimiter(RespClient(redis_url), lease_ttl=10.0, deadline=SLACK)
    h = Harness(lim, T0, redis.Redis.from_url(redis_url))
    n = 2 * MAX_BATCH + 88
    t = team(concurrency=n)
    for i in range(n):
        assert isinstance(await h.admit(t, rid=f"s{i}"), Admitted)

    def script_calls() -> int:
        assert h.db is not None
        return int(h.db.info("commandstats")["cmdstat_evalsha"]["calls"])

    h.clock.advance(5)
    before = script_calls()
    gone = await h.lim.renew([f"s{i}" for i in range(n)] + ["never-seen"], h.clock.now())
    assert script_calls() - before == 3  # 601 ids: 256 + 256 + 89
    assert gone == ["never-seen"]
    h.clock.advance(6)  # past the first lease: only a renewal keeps them
    assert h.in_flight("team", "team-a") == n

    before = script_calls()
    await h.lim.end_many([Settle(f"s{i}", 1) for i in range(n)])
    assert script_calls() - before == 3
    assert h.in_flight("team", "team-a") == 0 and h.holds_nothing()
    await lim.close()


async def test_lease_held_at_every_tier_with_concurrency(h: Harness) -> None:
    tiers = (model(concurrency=5), team(concurrency=5), key(concurrency=1))
    assert isinstance(await h.admit(*tiers, rid="a"), Admitted)
    assert [h.in_flight(*tn) for tn in
            (("model", "qwen3-coder"), ("team", "team-a"), ("key", "k1"))] == [1, 1, 1]
    await h.settle("a", 10)
    assert [h.in_flight(*tn) for tn in
            (("model", "qwen3-coder"), ("team", "team-a"), ("key", "k1"))] == [0, 0, 0]


# --- token reservations ------------------------------------------------------------------------


async def test_reservation_is_counted_at_admission(h: Harness) -> None:
    k = key(tokens_per_day=1000)
    v = await h.admit(k, reserve=400, rid="a")
    assert isinstance(v, Admitted) and v.owes_settlement
    assert v.rate.tok_remaining == 600
    assert await h.used(k) == 400
    assert isinstance(await h.admit(k, reserve=600), Admitted)
    assert isinstance(await h.admit(k, reserve=1), Refused)


@pytest.mark.parametrize(("actual", "used"), [(700, 700), (100, 100), (0, 0), (None, 400)])
async def test_settle_replaces_reservation_with_actual(
    h: Harness, actual: int | None, used: int
) -> None:
    k = key(tokens_per_day=1000)
    assert isinstance(await h.admit(k, reserve=400, rid="a"), Admitted)
    await h.settle("a", actual)
    assert await h.used(k) == used


async def test_settle_applies_to_every_token_window_and_tier(h: Harness) -> None:
    t = team(tokens_per_minute=10_000, tokens_per_day=10_000)
    k = key(tokens_per_month=10_000)
    assert isinstance(await h.admit(t, k, reserve=400, rid="a"), Admitted)
    await h.settle("a", 1500)
    assert h.windows() == {"tpm:team:team-a": 1500, "tpd:team:team-a": 1500, "tpmo:key:k1": 1500}


async def test_settle_twice_is_idempotent(h: Harness) -> None:
    k = key(tokens_per_day=1000, concurrency=1)
    assert isinstance(await h.admit(k, reserve=400, rid="a"), Admitted)
    await h.settle("a", 100)
    await h.settle("a", 900)  # a second settlement (retry, duplicate end) changes nothing
    await h.settle("a", None)
    assert await h.used(key(tokens_per_day=1000)) == 100
    assert isinstance(await h.admit(key(concurrency=1), rid="b"), Admitted)


async def test_settle_after_lease_expiry_still_settles_tokens(make: Make) -> None:
    h = make(lease_ttl=5.0)
    k = key(tokens_per_day=1000, concurrency=1)
    assert isinstance(await h.admit(k, reserve=400, rid="a"), Admitted)
    h.clock.advance(30)
    await h.settle("a", 50)
    assert await h.used(key(tokens_per_day=1000)) == 50


async def test_end_many_applies_each_in_order(h: Harness) -> None:
    k = key(tokens_per_day=1000, concurrency=3)
    for rid in "abc":
        assert isinstance(await h.admit(k, reserve=100, rid=rid), Admitted)
    await h.lim.end_many([Settle("a", 10), Settle("b", None), Settle("a", 999)])
    assert h.in_flight("key", "k1") == 1  # only c still holds a slot
    assert await h.used(key(tokens_per_day=1000)) == 10 + 100 + 100


async def test_actual_below_zero_never_drives_counter_negative(h: Harness) -> None:
    k = key(tokens_per_day=1000)
    assert isinstance(await h.admit(k, reserve=400, rid="a"), Admitted)
    h.forget_tokens()  # e.g. the day window rolled over between admission and settlement
    await h.settle("a", 0)
    assert all(v >= 0 for v in h.windows().values())


async def test_release_frees_the_slots_and_keeps_the_reservation(h: Harness) -> None:
    k = key(tokens_per_day=1000, concurrency=1)
    assert isinstance(await h.admit(k, reserve=400, rid="a"), Admitted)
    await h.lim.release("a")  # the response ended; its event is not yet durable
    assert h.in_flight("key", "k1") == 0
    assert await h.used(key(tokens_per_day=1000)) == 400
    await h.settle("a", 30)  # ... now it is
    assert await h.used(key(tokens_per_day=1000)) == 30


async def test_void_charges_nothing_and_frees_everything(h: Harness) -> None:
    k = key(tokens_per_day=1000, concurrency=1)
    assert isinstance(await h.admit(k, reserve=400, rid="a"), Admitted)
    await h.lim.void("a")
    assert h.in_flight("key", "k1") == 0 and h.holds_nothing()
    assert await h.used(key(tokens_per_day=1000)) == 0
    await h.settle("a", 900)  # a settlement after the void finds nothing
    assert await h.used(key(tokens_per_day=1000)) == 0


async def test_endings_of_one_batch_apply_in_order(h: Harness) -> None:
    k = key(tokens_per_day=1000, concurrency=2)
    assert isinstance(await h.admit(k, reserve=100, rid="a"), Admitted)
    assert isinstance(await h.admit(k, reserve=100, rid="b"), Admitted)
    await h.lim.end_many([Release("a"), Settle("a", 5), Void("b"), Settle("b", 70)])
    assert h.in_flight("key", "k1") == 0 and h.holds_nothing()
    assert await h.used(key(tokens_per_day=1000)) == 5


# --- x-ratelimit numbers: the tightest tier --------------------------------------------------


async def test_rate_info_picks_the_tightest_tier(h: Harness) -> None:
    t = team(rps=10, burst=10, tokens_per_day=1000)
    k = key(rps=2, burst=2, tokens_per_day=10_000)
    v = await h.admit(t, k, reserve=400)
    assert isinstance(v, Admitted)
    # requests: team 9/10 left, key 1/2 left -> key; tokens: team 600/1000, key 9600/10000 -> team
    assert (v.rate.req_limit, v.rate.req_remaining) == (2, 1)
    assert v.rate.req_reset == pytest.approx(0.5)
    assert (v.rate.tok_limit, v.rate.tok_remaining) == (1000, 600)
    assert v.rate.tok_reset is not None and 0 < v.rate.tok_reset <= 86400


async def test_remaining_requests_never_overstate_what_is_admitted(h: Harness) -> None:
    t, k = team(rps=1, burst=4), key(rps=1, burst=100)
    for _ in range(80):  # the key alone spends 80 of its 100 cells (e.g. via another team)
        assert isinstance(await h.admit(k), Admitted)
    v = await h.admit(t, k)
    assert isinstance(v, Admitted) and v.rate.req_remaining is not None
    admitted = 0
    while isinstance(await h.admit(t, k), Admitted):
        admitted += 1
    assert admitted == 3  # the team's cells bind
    assert v.rate.req_remaining == admitted


async def test_remaining_tokens_never_overstate_what_is_admitted(h: Harness) -> None:
    t, k = team(tokens_per_day=1000), key(tokens_per_day=10_000)
    assert isinstance(await h.admit(k, reserve=5000), Admitted)  # the key spent 5000 elsewhere
    v = await h.admit(t, k, reserve=400)
    assert isinstance(v, Admitted)
    assert isinstance(await h.admit(t, k, reserve=600), Admitted)
    assert isinstance(await h.admit(t, k, reserve=1), Refused)  # 600 was all that was left
    assert v.rate.tok_remaining == 600


async def test_rate_info_without_limits_is_empty(h: Harness) -> None:
    v = await h.admit(team(concurrency=3))
    assert isinstance(v, Admitted)
    assert v.rate.req_limit is None and v.rate.tok_limit is None
