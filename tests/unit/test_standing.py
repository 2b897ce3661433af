"""`keys show`'s numbers: where a tier stands, from its counters, by admission's formulas."""

from __future__ import annotations

import pytest

from gateway import keys_show
from gateway.limits import maths
from gateway.limits.memory import MemoryLimiter
from gateway.limits.standing import Counters, redis_keys, standing
from gateway.limits.types import AdmitRequest, Admitted
from gateway.policy.loader import load
from gateway.policy.model import LimitSpec, TierLimit

T0 = 1_800_000_015.0  # 15 s into a minute (2027-01-15T08:00:15Z)


def windows(spec: LimitSpec, c: Counters, now: float = T0) -> dict[str, tuple[float, ...]]:
    s = standing(TierLimit("key", "k", spec), c, now)
    return {w.limit: (w.allowed, w.used, w.left) for w in s.windows}


def test_an_untouched_tier_has_everything_left() -> None:
    spec = LimitSpec(rps=2, burst=4, concurrency=3, tokens_per_minute=100, tokens_per_day=1000,
                     tokens_per_month=5000)
    assert windows(spec, Counters()) == {
        "rps": (4, 0, 4), "concurrency": (3, 0, 3), "tokens_per_minute": (100, 0, 100),
        "tokens_per_day": (1000, 0, 1000), "tokens_per_month": (5000, 0, 5000)}


def test_the_minute_slides_as_admission_counts_it() -> None:
    # 15 s into the minute, 3/4 of the previous minute still counts
    got = windows(LimitSpec(tokens_per_minute=1000), Counters(minute_prev=400, minute_cur=100))
    assert got["tokens_per_minute"] == (1000, 400, 600)


def test_used_beyond_the_limit_leaves_zero() -> None:
    got = windows(LimitSpec(tokens_per_day=1000, concurrency=1),
                  Counters(day=1500, in_flight=2))
    assert got["tokens_per_day"] == (1000, 1500, 0) and got["concurrency"] == (1, 2, 0)


def test_rps_left_is_what_the_bucket_would_admit_now() -> None:
    spec = LimitSpec(rps=2, burst=4)
    # two requests just admitted: the arrival time is 2 intervals (1 s) ahead
    assert windows(spec, Counters(tat=T0 + 1.0))["rps"] == (4, 2, 2)
    # a second later they have drained
    assert windows(spec, Counters(tat=T0 + 1.0), T0 + 1.0)["rps"] == (4, 0, 4)


async def test_the_memory_limiters_counters_after_admissions() -> None:
    lim = MemoryLimiter(lease_ttl=60)
    tier = TierLimit("key", "k", LimitSpec(rps=5, burst=5, concurrency=4,
                                           tokens_per_minute=1000, tokens_per_day=5000))
    for rid in ("a", "b"):
        assert isinstance(await lim.admit(AdmitRequest(rid, (tier,), 100, T0)), Admitted)
    got = standing(tier, await lim.counters("key:k", T0), T0)
    assert {w.limit: (w.used, w.left) for w in got.windows} == {
        "rps": (2, 3), "concurrency": (2, 2), "tokens_per_minute": (200, 800),
        "tokens_per_day": (200, 4800)}


def test_redis_keys_are_admit_luas() -> None:
    minute = maths.minute_index(T0)
    assert redis_keys("team:t", T0) == (
        "gw:rps:team:t", "gw:conc:team:t", f"gw:tpm:team:t:{minute - 1}",
        f"gw:tpm:team:t:{minute}", "gw:tpd:team:t:20270115", "gw:tpmo:team:t:202701")


POLICY = load("""
models:
  a: {limits: {concurrency: 8}}
  b: {}
  c: {limits: {rps: 1}}
teams:
  t: {models: ["a", "b"], limits: {tokens_per_day: 900}}
keys:
  k: {team: t, sha256: "DIGEST1", limits: {tokens_per_minute: 50}, disabled: true}
  open: {team: t, sha256: "DIGEST2"}
""".replace("DIGEST1", "1" * 64).replace("DIGEST2", "2" * 64), revision=7)


def test_a_keys_tiers_are_its_own_its_teams_and_its_models_with_limits() -> None:
    assert [(t.tier, t.name) for t in keys_show.key_tiers(POLICY, "k")] == [
        ("key", "k"), ("team", "t"), ("model", "a")]  # b has no limits; c is not the team's
    assert [(t.tier, t.name) for t in keys_show.key_tiers(POLICY, "open")] == [
        ("team", "t"), ("model", "a")]


@pytest.mark.parametrize("counters", [True, False])
async def test_the_table_and_json_say_what_is_known(counters: bool) -> None:
    tiers = keys_show.key_tiers(POLICY, "k")

    async def read(tier_key: str, now: float) -> Counters:
        return Counters(minute_cur=20) if tier_key == "key:k" else Counters(in_flight=3)
    rows = await keys_show.standings(tiers, read if counters else None, T0)
    data = keys_show.as_data(POLICY, "k", rows, T0, counters)
    assert (data["state"], data["revision"], data["models"]) == ("disabled", 7, ["a", "b"])
    minute = data["tiers"][0]["windows"][0]
    assert (minute["limit"], minute["allowed"]) == ("tokens_per_minute", 50)
    assert (minute["used"], minute["left"]) == ((20, 30) if counters else (None, None))
    text = keys_show.table(data)
    assert ("embedded mode" in text) is not counters
    assert "model  a" in text and "concurrency" in text


def test_a_global_quota_stands_at_this_spokes_allowance_else_the_fallback_share() -> None:
    spec = LimitSpec(global_tokens_per_day=10_000, global_tokens_per_month=50_000)
    got = standing(TierLimit("key", "k", spec),
                   Counters(global_day=300, global_month=700, allowance_day=2000), T0)
    assert {w.limit: (w.allowed, w.used, w.left, w.quota) for w in got.windows} == {
        "global_tokens_per_day": (2000, 300, 1700, 10_000),
        "global_tokens_per_month": (5000, 700, 4300, 50_000)}  # none held: 10% of it


GLOBAL = load("""
models:
  a: {}
teams:
  g: {models: ["a"], global_limits: {tokens_per_month: 90000}}
keys:
  only: {team: g, sha256: "DIGEST1", global_limits: {tokens_per_day: 1000}}
""".replace("DIGEST1", "1" * 64), revision=3)


@pytest.mark.parametrize("counters", [True, False])
async def test_the_global_limits_of_a_key_and_its_team_are_shown(counters: bool) -> None:
    async def read(tier_key: str, now: float) -> Counters:
        return Counters(global_day=40, allowance_day=600)
    rows = await keys_show.standings(keys_show.key_tiers(GLOBAL, "only"),
                                     read if counters else None, T0)
    data = keys_show.as_data(GLOBAL, "only", rows, T0, counters)
    assert [(t["tier"], [(w["limit"], w["quota"], w["allowed"], w["used"], w["left"])
                         for w in t["windows"]]) for t in data["tiers"]] == [
        ("key", [("global_tokens_per_day", 1000, *((600, 40, 560) if counters
                                                   else (None, None, None)))]),
        ("team", [("global_tokens_per_month", 90000, *((9000, 0, 9000) if counters
                                                       else (None, None, None)))])]
    text = keys_show.table(data)
    assert "unlimited" not in text
    assert "global_tokens_per_day 1000, this spoke's" in text
    assert "global_tokens_per_month 90000, this spoke's" in text
    assert "allowance" in text


async def test_the_memory_limiters_global_counters_and_allowance() -> None:
    lim = MemoryLimiter(lease_ttl=60)
    tier = TierLimit("key", "k", LimitSpec(global_tokens_per_day=10_000))
    assert isinstance(await lim.admit(AdmitRequest("a", (tier,), 100, T0)), Admitted)
    c = await lim.counters("key:k", T0)
    assert (c.global_day, c.allowance_day, c.allowance_month) == (100, None, None)
