"""The pure maths of every limit kind: GCRA, the sliding minute, fits, calendar windows."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.limits import maths

T0 = 1_800_000_000.0  # a fixed "now" (2027-01-15T08:00:00Z)
EPS = 1e-6


def ts(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> float:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp()


def run_gcra(
    times: list[float], rps: float, burst: int, tat: float = 0.0
) -> tuple[list[bool], float]:
    allowed = []
    for now in times:
        g = maths.gcra(tat, now, rps, burst)
        if g.allowed:
            tat = g.new_tat
        allowed.append(g.allowed)
    return allowed, tat


# --- GCRA ---------------------------------------------------------------------------------------


def test_gcra_allows_burst_then_denies() -> None:
    allowed, _ = run_gcra([T0] * 6, rps=2.0, burst=4)
    assert allowed == [True, True, True, True, False, False]


def test_gcra_remaining_counts_down_from_fresh_bucket() -> None:
    tat, remaining = 0.0, []
    for _ in range(4):
        g = maths.gcra(tat, T0, 2.0, 4)
        tat = g.new_tat
        remaining.append(g.remaining)
    assert remaining == [3, 2, 1, 0]


def test_gcra_denial_is_exact_and_keeps_state() -> None:
    _, tat = run_gcra([T0] * 4, rps=2.0, burst=4)
    g = maths.gcra(tat, T0, 2.0, 4)
    assert not g.allowed
    assert g.retry_after == pytest.approx(0.5)  # one interval (1/rps) until a cell frees
    assert g.remaining == 0
    assert g.new_tat == tat  # a denial does not move the bucket
    assert g.reset == pytest.approx(2.0)  # four cells at 2/s refill in 2 s
    # just before retry_after: still denied; at it: allowed
    assert not maths.gcra(tat, T0 + 0.49, 2.0, 4).allowed
    assert maths.gcra(tat, T0 + 0.5, 2.0, 4).allowed


def test_gcra_refills_one_cell_per_interval() -> None:
    _, tat = run_gcra([T0] * 2, rps=4.0, burst=2)
    assert not maths.gcra(tat, T0, 4.0, 2).allowed
    g = maths.gcra(tat, T0 + 0.25, 4.0, 2)  # exactly 1/rps later: one cell back
    assert g.allowed and g.remaining == 0
    assert not maths.gcra(g.new_tat, T0 + 0.25, 4.0, 2).allowed


def test_gcra_full_after_idle_never_exceeds_burst() -> None:
    _, tat = run_gcra([T0], rps=1.0, burst=3)
    # idle for an hour: the bucket is full, but holds no more than `burst`
    allowed, _ = run_gcra([T0 + 3600] * 5, rps=1.0, burst=3, tat=tat)
    assert allowed == [True, True, True, False, False]


def test_gcra_fractional_rps() -> None:
    allowed, tat = run_gcra([T0, T0 + 1], rps=0.5, burst=1)
    assert allowed == [True, False]
    g = maths.gcra(tat, T0 + 1, 0.5, 1)
    assert g.retry_after == pytest.approx(1.0)
    assert maths.gcra(tat, T0 + 2, 0.5, 1).allowed


def test_gcra_allowed_reset_is_time_until_full() -> None:
    g = maths.gcra(0.0, T0, 10.0, 5)
    assert g.allowed and g.retry_after == 0.0
    assert g.reset == pytest.approx(0.1)  # one cell used, back in 1/rps


rates = st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.0, 10.0, 100.0])
bursts = st.integers(min_value=1, max_value=20)
gaps = st.lists(st.floats(min_value=0.0, max_value=2.0, allow_nan=False), min_size=1,
                max_size=80)


@settings(max_examples=150, deadline=None)
@given(rps=rates, burst=bursts, gaps=gaps)
def test_gcra_never_exceeds_burst_plus_rate_over_any_interval(
    rps: float, burst: int, gaps: list[float]
) -> None:
    times, now = [], T0
    for gap in gaps:
        now += gap
        times.append(now)
    allowed, _ = run_gcra(times, rps, burst)
    hits = [t for t, ok in zip(times, allowed, strict=True) if ok]
    for i in range(len(hits)):
        for j in range(i, len(hits)):
            count = j - i + 1
            # (1e-3: float error on epoch-sized timestamps; counts are integers anyway)
            assert count <= burst + rps * (hits[j] - hits[i]) + 1e-3


@settings(max_examples=150, deadline=None)
@given(rps=rates, burst=bursts, gaps=gaps)
def test_gcra_denial_retry_after_is_sufficient_and_remaining_is_honest(
    rps: float, burst: int, gaps: list[float]
) -> None:
    tat, now = 0.0, T0
    for gap in gaps:
        now += gap
        g = maths.gcra(tat, now, rps, burst)
        if not g.allowed:
            assert g.retry_after > 0
            assert maths.gcra(tat, now + g.retry_after + EPS, rps, burst).allowed
            continue
        tat = g.new_tat
        # `remaining` more requests fit now (give or take the float slack of a 1/10000th
        # interval the header value allows itself), and not one more
        probe, soon = tat, now + 1e-3 / rps
        for _ in range(g.remaining):
            step = maths.gcra(probe, soon, rps, burst)
            assert step.allowed
            probe = step.new_tat
        assert not maths.gcra(probe, now, rps, burst).allowed


@settings(max_examples=100, deadline=None)
@given(rps=rates, burst=bursts)
def test_gcra_fresh_bucket_allows_exactly_burst(rps: float, burst: int) -> None:
    allowed, _ = run_gcra([T0] * (burst + 3), rps, burst)
    assert allowed == [True] * burst + [False] * 3


# --- sliding minute ----------------------------------------------------------------------------


@pytest.mark.parametrize(("second", "expected"), [
    (0.0, 100.0 + 10),  # start of the minute: all of the previous minute still counts
    (15.0, 75.0 + 10),
    (30.0, 50.0 + 10),
    (45.0, 25.0 + 10),
    (59.0, 100.0 / 60 + 10),
])
def test_sliding_minute_weights_previous_minute(second: float, expected: float) -> None:
    start = maths.minute_index(T0) * maths.MINUTE
    assert maths.sliding_minute(100.0, 10.0, start + second) == pytest.approx(expected)


def test_minute_index_and_end() -> None:
    start = ts(2027, 1, 15, 8, 0)
    assert maths.minute_index(start) == maths.minute_index(start + 59.999)
    assert maths.minute_index(start + 60) == maths.minute_index(start) + 1
    assert maths.seconds_to_minute_end(start) == 60.0
    assert maths.seconds_to_minute_end(start + 45) == 15.0


# --- fits ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("used", "reserve", "limit", "ok"), [
    (0, 100, 100, True),  # exactly the whole window
    (60, 40, 100, True),  # exactly what is left
    (61, 40, 100, False),
    (100, 1, 100, False),
    (100, 0, 100, True),  # nothing reserved: nothing to refuse
    (0, 5000, 100, False),  # larger than the whole window: never (refused as impossible)
    (0, 101, 100, False),
    (99.5, 1, 100, False),  # fractional use from the sliding estimate counts
])
def test_fits(used: float, reserve: int, limit: int, ok: bool) -> None:
    assert maths.fits(used, reserve, limit) is ok


# --- sliding minute: when a refused reservation fits ------------------------------------------


def _used(counts: dict[int, float], t: float) -> float:
    """The sliding estimate at `t` from per-minute counts (no traffic after they were made)."""
    m = maths.minute_index(t)
    return maths.sliding_minute(counts.get(m - 1, 0.0), counts.get(m, 0.0), t)


def test_sliding_wait_within_the_minute_as_the_previous_one_slides_out() -> None:
    start = maths.minute_index(T0) * maths.MINUTE
    # previous minute 900, this one 0, limit 1000: 200 fits once 900 * (1 - f) <= 800
    wait = maths.sliding_wait(900, 0, start + 3, 200, 1000)
    assert wait == pytest.approx(60 / 9 - 3)


def test_sliding_wait_this_minutes_count_only_slides_in_the_next() -> None:
    """The issue's bug: waiting for the minute's end is not enough, since at the start of
    the next minute all of this minute's count still weighs."""
    start = maths.minute_index(T0) * maths.MINUTE
    wait = maths.sliding_wait(0, 900, start + 10, 200, 1000)
    assert wait == pytest.approx(50 + 60 / 9)
    counts = {maths.minute_index(T0): 900.0}
    assert not maths.fits(_used(counts, start + 60.5), 200, 1000)  # the old answer: refused


def test_sliding_wait_fits_now_or_never() -> None:
    assert maths.sliding_wait(500, 100, T0, 400, 1000) == 0.0
    assert maths.sliding_wait(0, 0, T0, 1001, 1000) is None
    assert maths.sliding_wait(0, 0, T0, 1000, 1000) == 0.0


def test_sliding_reset_is_when_the_window_counts_nothing() -> None:
    start = maths.minute_index(T0) * maths.MINUTE
    assert maths.sliding_reset(0, 0, start + 15) == 0.0
    assert maths.sliding_reset(50, 0, start + 15) == 45.0
    assert maths.sliding_reset(50, 1, start + 15) == 105.0


counts_st = st.integers(min_value=0, max_value=5000)  # the counters hold whole tokens


@settings(max_examples=400, deadline=None)
@given(prev=counts_st, cur=counts_st, second=st.floats(min_value=0, max_value=59.999),
       reserve=st.integers(min_value=1, max_value=5000),
       limit=st.integers(min_value=1, max_value=5000))
def test_sliding_wait_is_exactly_enough(prev: float, cur: float, second: float, reserve: int,
                                        limit: int) -> None:
    """Waiting the answer admits the reservation; any shorter wait does not (without new
    traffic, across the minute boundary too)."""
    m = maths.minute_index(T0)
    now = m * maths.MINUTE + second
    counts = {m - 1: prev, m: cur}
    wait = maths.sliding_wait(prev, cur, now, reserve, limit)
    if reserve > limit:
        assert wait is None
        return
    assert wait is not None and 0 <= wait <= 2 * maths.MINUTE
    # (1e-4 of a token: float error on epoch-sized timestamps; the store counts in ms)
    assert maths.fits(_used(counts, now + wait) - 1e-4, reserve, limit)
    if wait > 0.01:
        assert not maths.fits(_used(counts, now + wait - 0.01), reserve, limit)
        assert not maths.fits(_used(counts, now + wait * 0.5), reserve, limit)
    else:
        assert maths.fits(_used(counts, now), reserve, limit) or wait > 0


# --- calendar windows (UTC) ------------------------------------------------------------------


def test_day_and_month_ids_roll_over_new_year() -> None:
    last = ts(2026, 12, 31, 23, 59, 59)
    assert maths.day_id(last) == "20261231"
    assert maths.month_id(last) == "202612"
    assert maths.day_id(last + 1) == "20270101"
    assert maths.month_id(last + 1) == "202701"
    assert maths.seconds_to_day_end(last) == 1.0
    assert maths.seconds_to_month_end(last) == 1.0


def test_window_ends_at_exact_boundaries() -> None:
    midnight = ts(2027, 3, 1)
    assert maths.seconds_to_day_end(midnight) == 86400.0  # a new day has the whole day ahead
    assert maths.seconds_to_month_end(midnight) == 31 * 86400.0  # March
    assert maths.seconds_to_day_end(midnight - 0.25) == pytest.approx(0.25)
    assert maths.seconds_to_month_end(ts(2026, 12, 1)) == 31 * 86400.0
    assert maths.seconds_to_month_end(ts(2027, 4, 30, 12)) == 12 * 3600.0


def test_leap_february() -> None:
    assert maths.seconds_to_month_end(ts(2028, 2, 28)) == 2 * 86400.0  # Feb 29 exists
    assert maths.seconds_to_month_end(ts(2027, 2, 28)) == 86400.0
    assert maths.day_id(ts(2028, 2, 29, 12)) == "20280229"
    assert maths.month_id(ts(2028, 2, 29, 23, 59, 59)) == "202802"
    assert maths.month_id(ts(2028, 2, 29, 23, 59, 59) + 1) == "202803"
    assert maths.seconds_to_month_end(ts(2028, 2, 1)) == 29 * 86400.0
    assert maths.seconds_to_month_end(ts(2100, 2, 1)) == 28 * 86400.0  # century, not leap


def test_ids_use_utc_not_local_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setenv("TZ", "Pacific/Kiritimati")  # UTC+14
    time.tzset()
    try:
        assert maths.day_id(ts(2027, 1, 15, 23)) == "20270115"
        assert maths.seconds_to_day_end(ts(2027, 1, 15, 23)) == 3600.0
    finally:
        monkeypatch.undo()
        time.tzset()


seconds = st.integers(min_value=int(ts(2020, 1, 1)), max_value=int(ts(2100, 12, 31)))


@settings(max_examples=300, deadline=None)
@given(now=seconds)
def test_day_end_is_where_the_day_id_changes(now: int) -> None:
    left = maths.seconds_to_day_end(now)
    assert 0 < left <= 86400
    assert maths.day_id(now + left - 1) == maths.day_id(now)
    assert maths.day_id(now + left) != maths.day_id(now)
    assert datetime.fromtimestamp(now + left, UTC).time().isoformat() == "00:00:00"


@settings(max_examples=300, deadline=None)
@given(now=seconds)
def test_month_end_is_where_the_month_id_changes(now: int) -> None:
    left = maths.seconds_to_month_end(now)
    assert 0 < left <= 31 * 86400
    assert maths.month_id(now + left - 1) == maths.month_id(now)
    end = datetime.fromtimestamp(now + left, UTC)
    assert maths.month_id(now + left) != maths.month_id(now)
    assert (end.day, end.hour, end.minute, end.second) == (1, 0, 0, 0)
