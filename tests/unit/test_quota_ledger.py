"""The allocator's ledger (gateway/hub/quota_ledger.py): folded from topic messages only,
so these tests replay messages as the topics would hand them."""

from __future__ import annotations

from typing import Any

from gateway.hub.quota_ledger import QuotaLedger, quotas_of
from gateway.limits import maths

NOW = 1_800_000_000.0
DAY = maths.day_id(NOW)
CELL = ("team:g", "day", DAY)
DIGEST = "a" * 64
POLICY = {"revision": 3, "policy": {
    "teams": {"g": {"models": ["*"], "global_limits": {"tokens_per_day": 1000}}},
    "keys": {"k1": {"team": "g", "sha256": DIGEST,
                    "global_limits": {"tokens_per_month": 50}}}}}


def usage(spoke: str, eid: str, tokens: int, ts: float = NOW) -> dict[str, Any]:
    return {"event_id": eid, "spoke": spoke, "team": "g", "key_id": "k1",
            "usage": {"total_tokens": str(tokens)},  # proto3 JSON: int64 as a string
            "started_at": maths_rfc3339(ts)}


def maths_rfc3339(ts: float) -> str:
    from gateway.usage_event import rfc3339
    return rfc3339(ts)


def applied(ledger: QuotaLedger, spoke: str, msg: dict[str, Any], used: int = 0) -> dict[str, Any]:
    """What the spoke's follower reports after applying `msg`."""
    rep = {"kind": "applied", "spoke": spoke, "generation": msg["generation"], "applied": [
        {"scope": e["scope"], "period": e["period"], "period_id": e["period_id"],
         "allowance": max(e["allowance"], used), "used": used} for e in msg["allowances"]]}
    ledger.on_applied(spoke, rep)
    return rep


def day_allowance(msg: dict[str, Any]) -> int:
    return next(e["allowance"] for e in msg["allowances"] if e["scope"] == "team:g")


TEAM_ONLY = {"revision": 3, "policy": {
    "teams": {"g": {"models": ["*"], "global_limits": {"tokens_per_day": 1000}}}}}


def two_spokes() -> QuotaLedger:
    ledger = QuotaLedger()
    ledger.on_policy("*", TEAM_ONLY)
    for s in ("a", "b"):
        ledger.on_applied(s, {"generation": 0, "applied": []})  # the followers' hello
    return ledger


def test_quotas_come_from_the_feed_and_the_smallest_wins() -> None:
    assert quotas_of(POLICY["policy"]) == {("team:g", "day"): 1000, ("key:k1", "month"): 50}
    ledger = two_spokes()
    ledger.on_policy("*", POLICY)
    ledger.on_policy("b", {"revision": 4, "policy": {
        "teams": {"g": {"global_limits": {"tokens_per_day": 600}}}}})
    assert ledger.quotas()[("team:g", "day")] == 600
    ledger.on_policy("b", {"revision": 5, "policy": {"teams": {"g": {"oops": 1}}}})
    assert ledger.quotas()[("team:g", "day")] == 600 and "b" in ledger.rejected_policies
    ledger.on_policy("b", None)
    assert ledger.quotas()[("team:g", "day")] == 1000


def test_the_idle_spokes_share_moves_once_it_reports_its_lower_allowance() -> None:
    ledger = two_spokes()
    first = ledger.next_round(NOW)
    assert [day_allowance(first[s]) for s in "ab"] == [500, 500]
    for s in "ab":
        applied(ledger, s, first[s])
    ledger.on_usage(usage("a", "e1", 300))
    ledger.on_usage(usage("a", "e1", 300))  # a duplicate counts once
    second = ledger.next_round(NOW)
    assert list(second) == ["b"] and day_allowance(second["b"]) < 50  # b lowered; a waits
    applied(ledger, "b", second["b"])
    third = ledger.next_round(NOW)
    assert list(third) == ["a"] and day_allowance(third["a"]) > 900
    assert day_allowance(third["a"]) + day_allowance(second["b"]) <= 1000


def test_a_restarted_ledger_carries_on_and_hands_nothing_out_twice() -> None:
    ledger = two_spokes()
    log: list[tuple[str, str, dict[str, Any]]] = []  # the quota topic, in order
    first = ledger.next_round(NOW)
    for s, m in first.items():
        log += [("allowance", s, m), ("applied", s, applied(ledger, s, m))]
    ledger.on_usage(usage("a", "e1", 400))
    second = ledger.next_round(NOW)  # b lowered, not yet reported applied
    log += [("allowance", s, m) for s, m in second.items()]

    again = QuotaLedger()
    again.on_policy("*", TEAM_ONLY)
    again.on_usage(usage("a", "e1", 400))
    for kind, s, m in log:
        (again.on_allowance if kind == "allowance" else again.on_applied)(s, m)
    assert again.generation == ledger.generation
    assert again.use("b", CELL, 1000).held == 500  # b may still admit under its first 500
    nxt = again.next_round(NOW)
    assert all(m["generation"] > ledger.generation for m in nxt.values())
    # Whatever it hands out now, with what each spoke may still be admitting under, stays
    # within the quota (a ledger that forgot would give a 600 more while b still holds 500).
    assert sum(again.use(s, CELL, 1000).held for s in "ab") <= 1000


def test_a_new_day_starts_from_the_fallback_share() -> None:
    ledger = two_spokes()
    for s, m in ledger.next_round(NOW).items():
        applied(ledger, s, m)
    tomorrow = NOW + 86400
    cell = ("team:g", "day", maths.day_id(tomorrow))
    assert ledger.use("a", cell, 1000).held == maths.fallback_allowance(1000)
    nxt = ledger.next_round(tomorrow)
    assert {e["period_id"] for e in nxt["a"]["allowances"] if e["period"] == "day"} == {
        maths.day_id(tomorrow)}


def test_a_spoke_without_a_follower_is_not_promised_what_it_cannot_apply() -> None:
    ledger = two_spokes()
    ledger.on_usage(usage("north", "e9", 50))  # a spoke known from its usage alone
    out = ledger.next_round(NOW)
    assert day_allowance(out["north"]) == maths.fallback_allowance(1000)  # what it enforces
    assert day_allowance(out["a"]) + day_allowance(out["b"]) == 900  # the rest: theirs
    assert sum(ledger.use(s, CELL, 1000).held for s in ("a", "b", "north")) <= 1000


def test_a_lost_quota_topic_resumes_above_what_the_spokes_hold() -> None:
    """The topic was lost (a Tansu restart): the followers' hellos say which generation
    their Redis holds, so the new one continues above it and resends their allowances."""
    ledger = two_spokes()
    for s in "ab":
        ledger.on_applied(s, {"generation": 0, "applied": [], "holds": 41})
    out = ledger.next_round(NOW)
    assert sorted(out) == ["a", "b"] and min(m["generation"] for m in out.values()) > 41
    for s, m in out.items():
        applied(ledger, s, m)
    ledger.on_applied("a", {"generation": 0, "applied": [], "holds": out["a"]["generation"]})
    assert ledger.next_round(NOW) == {}  # a follower's restart alone resends nothing



def test_a_spoke_on_its_fallback_share_is_counted_at_the_share_it_enforces() -> None:
    """A spoke serves its own feed entry where it has one, else '*'s (DESIGN §10), and its
    fallback share is 10 % of the quota in that entry: the allocator divides the smallest
    quota, but counts what each spoke may really admit until it applies an allowance."""
    ledger = two_spokes()  # '*': 1000 a day
    ledger.on_policy("*", {"revision": 4, "policy": {
        "teams": {"g": {"models": ["*"], "global_limits": {"tokens_per_day": 600}}}}})
    ledger.on_policy("north", TEAM_ONLY)  # north's own entry: 1000 a day
    ledger.on_usage(usage("north", "e9", 50))  # known from its usage alone: no follower
    assert ledger.quotas()[("team:g", "day")] == 600
    assert ledger.use("north", CELL, 600).held == maths.fallback_allowance(1000)  # its own
    assert ledger.use("a", CELL, 600).held == maths.fallback_allowance(600)
    out = ledger.next_round(NOW)
    # north admits up to its 100 for good: a and b are not given that too.
    assert day_allowance(out["a"]) + day_allowance(out["b"]) + 100 <= 600


def test_a_quota_lowered_mid_period_hands_out_nothing_until_the_allowances_fit() -> None:
    """docs/hub-and-spokes.md: until the spokes apply their lower allowances they may serve
    their old ones; the allocator raises nobody meanwhile, and then the new quota holds."""
    ledger = two_spokes()
    first = ledger.next_round(NOW)
    for s in "ab":
        applied(ledger, s, first[s], used=100)  # 500 each of 1000, 100 used each
    ledger.on_policy("*", {"revision": 4, "policy": {
        "teams": {"g": {"models": ["*"], "global_limits": {"tokens_per_day": 400}}}}})
    lowered = ledger.next_round(NOW)
    assert all(100 <= day_allowance(lowered[s]) < 500 for s in "ab")
    assert [ledger.use(s, CELL, 400).held for s in "ab"] == [500, 500]  # still in force
    applied(ledger, "a", lowered["a"], used=100)
    assert ledger.next_round(NOW) == {}  # b may still admit up to 500: a is not raised
    applied(ledger, "b", lowered["b"], used=100)
    ledger.next_round(NOW)
    assert sum(ledger.use(s, CELL, 400).held for s in "ab") <= 400


def test_a_silent_spoke_is_given_only_its_fallback_share_in_later_periods() -> None:
    """docs/hub-and-spokes.md: a spoke that stops reporting keeps what it holds for the
    period, and its 10 % in every later one. Before, each new period's first allocation
    (no demand anywhere yet: an equal split) handed it half the quota, held all day since
    it never reported applying it, so the spoke that did serve was kept to the other half."""
    ledger = two_spokes()
    first = ledger.next_round(NOW)
    for s in "ab":
        applied(ledger, s, first[s])
    ledger.on_usage(usage("a", "e1", 300, NOW + 5))
    lowered = ledger.next_round(NOW + 5)  # b lowered; b never reports again
    assert "b" in lowered
    tomorrow = NOW + 86400
    cell = ("team:g", "day", maths.day_id(tomorrow))
    out = ledger.next_round(tomorrow)
    assert day_allowance(out["b"]) <= maths.fallback_allowance(1000)
    assert ledger.use("b", cell, 1000, tomorrow).held == maths.fallback_allowance(1000)
    applied(ledger, "a", out["a"])
    assert day_allowance(out["a"]) == 1000 - maths.fallback_allowance(1000)


def test_a_spoke_that_applies_late_is_not_taken_for_silent() -> None:
    """Its report of the allowance pending: raised again like any spoke."""
    ledger = two_spokes()
    first = ledger.next_round(NOW)
    for s in "ab":
        applied(ledger, s, first[s])
    ledger.on_usage(usage("a", "e1", 300, NOW + 5))
    lowered = ledger.next_round(NOW + 5)
    applied(ledger, "b", lowered["b"])  # b reports, if late
    tomorrow = NOW + 86400
    out = ledger.next_round(tomorrow)
    assert day_allowance(out["b"]) > maths.fallback_allowance(1000)


def test_a_quota_removed_and_added_again_counts_the_allowance_the_spoke_kept() -> None:
    """A spoke keeps each period's allowance in its Redis until a later one for that period
    replaces it: a message without it (the quota removed) leaves it there, and admission
    reads it again once the quota is back. Before, the allocator then counted that spoke
    as on its fallback share and handed the rest out again."""
    ledger = two_spokes()
    redis: dict[str, dict[tuple[str, str, str], int]] = {"a": {}, "b": {}}  # what admit reads

    def take(out: dict[str, dict[str, Any]]) -> None:
        for s, m in out.items():
            rep = applied(ledger, s, m)
            redis[s].update({(e["scope"], e["period"], e["period_id"]): e["allowance"]
                             for e in rep["applied"]})

    take(ledger.next_round(NOW))
    ledger.on_usage(usage("b", "e1", 200, NOW + 5))
    for t in (NOW + 10, NOW + 15):  # the share moves to b, the busy one
        take(ledger.next_round(t))
    assert redis["b"][CELL] > 800
    ledger.on_policy("*", {"revision": 4, "policy": {"teams": {"g": {"models": ["*"]}}}})
    take(ledger.next_round(NOW + 20))  # no quota: each spoke gets no allowance
    assert redis["b"][CELL] > 800  # kept in its Redis
    ledger.on_policy("*", {"revision": 5, "policy": TEAM_ONLY["policy"]})
    for i in range(4):  # a now busy, b idle
        ledger.on_usage(usage("a", f"a{i}", 10, NOW + 25 + i))
        out = ledger.next_round(NOW + 25 + i)
        # what each spoke may admit under: the newest allowance, or the one it kept
        may = {s: max([redis[s].get(CELL, maths.fallback_allowance(1000))]
                      + ([day_allowance(out[s])] if s in out else [])) for s in "ab"}
        assert sum(may.values()) <= 1000, may
        take(out)


def test_last_months_use_is_kept_into_the_next_month_whatever_its_length() -> None:
    """Yesterday and last month are kept (late events); 32 days back from the 1st of a
    month is the month before last, so last month's use was dropped at its turn."""
    from datetime import UTC, datetime
    for end in ("2027-02-28", "2027-04-30", "2027-03-31", "2028-02-29"):
        last = datetime.fromisoformat(end + "T23:59:59+00:00").timestamp()
        ledger = two_spokes()
        ledger.on_usage(usage("a", "e1", 40, last))
        cell = ("team:g", "month", maths.month_id(last))
        ledger.next_round(last + 3600)  # the 1st of the next month
        assert ledger.use("a", cell, 1000).used == 40, end
        assert datetime.fromtimestamp(last + 3600, UTC).day == 1


def test_a_report_read_before_the_allowance_it_answers_leaves_the_spoke_answered() -> None:
    """Restarted, the allocator may read a spoke's report before its own message it
    answers (`SPOKE` and `SPOKE/applied` are different keys): that spoke is not silent."""
    ledger = two_spokes()
    log = []
    for s, m in ledger.next_round(NOW).items():
        m = {**m, "at": maths_rfc3339(NOW)}
        log.append((s, m, applied(ledger, s, m)))
    again = QuotaLedger()
    again.on_policy("*", TEAM_ONLY)
    for s, m, rep in log:
        again.on_applied(s, rep)
        again.on_allowance(s, m)
    assert not again.silent("a", NOW + 3600)


def test_a_key_quota_and_its_teams_quota_are_divided_each_from_the_same_events() -> None:
    ledger = two_spokes()
    ledger.on_policy("*", POLICY)  # team g: 1000 a day; key k1 (of g): 50 a month
    ledger.on_usage(usage("a", "e1", 30))
    out = ledger.next_round(NOW)
    month = ("key:k1", "month", maths.month_id(NOW))
    for scope, quota, cell in (("team:g", 1000, CELL), ("key:k1", 50, month)):
        got = {s: next(e["allowance"] for e in out[s]["allowances"] if e["scope"] == scope)
               for s in "ab"}
        assert got["a"] >= 30 and sum(got.values()) <= quota, (scope, got)
        assert ledger.use("a", cell, quota).used == 30


def test_a_late_event_counts_in_its_own_period_and_a_repeated_one_once() -> None:
    ledger = two_spokes()
    ledger.on_usage(usage("a", "e1", 100))
    ledger.next_round(NOW + 86400)  # the next day
    ledger.on_usage(usage("a", "e2", 70))  # yesterday's, arriving late
    ledger.on_usage(usage("a", "e1", 100))  # and one again
    tomorrow = ("team:g", "day", maths.day_id(NOW + 86400))
    assert ledger.use("a", tomorrow, 1000).used == 0
    assert ledger.use("a", CELL, 1000).used == 170


def test_a_spoke_joining_mid_period_is_counted_at_its_fallback_share_until_it_applies() -> None:
    ledger = two_spokes()
    first = ledger.next_round(NOW)
    for s in "ab":
        applied(ledger, s, first[s])  # 500 each
    ledger.on_usage(usage("a", "e1", 400, NOW + 1))
    assert ledger.on_applied("c", {"generation": 0, "applied": []})  # hello: allocate now
    assert ledger.use("c", CELL, 1000).held == maths.fallback_allowance(1000)
    t = NOW + 2
    for _ in range(4):  # a round, the spokes apply, the next
        out = ledger.next_round(t)
        held = {s: max(ledger.use(s, CELL, 1000).held, ledger.allowances(s).get(CELL, 0))
                for s in "abc"}
        # never more in force than before c was heard of (its 10 % was the overshoot term)
        assert sum(held.values()) <= 1000 + maths.fallback_allowance(1000)
        for s, m in out.items():
            applied(ledger, s, m)
        t += 5
    assert sum(ledger.use(s, CELL, 1000).held for s in "abc") <= 1000
    assert ledger.allowances("c")[CELL] > 0
