"""The pure maths of every limit kind, shared in spirit with the Lua scripts (same formulas).

Times are in seconds here; the Lua side uses integer milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache

MINUTE = 60.0


@dataclass(frozen=True, slots=True)
class Gcra:
    """Outcome of one GCRA (generic cell rate algorithm) step for one bucket."""

    allowed: bool
    new_tat: float  # theoretical arrival time to store when allowed
    retry_after: float  # seconds until a request would be allowed (0 when allowed)
    remaining: int  # requests still allowed right now after this one
    reset: float  # seconds until the bucket is full again


def gcra(tat: float, now: float, rps: float, burst: int) -> Gcra:
    """GCRA: a token bucket of `burst` cells refilled at `rps`, stored as one timestamp."""
    interval = 1.0 / rps
    tat = max(tat, now)
    new_tat = tat + interval
    allow_at = new_tat - burst * interval
    if now < allow_at:
        return Gcra(False, tat, allow_at - now, 0, tat - now)
    remaining = math.floor((now - allow_at) / interval + 1e-4)  # float slack
    return Gcra(True, new_tat, 0.0, remaining, new_tat - now)


def minute_index(now: float) -> int:
    return int(now // MINUTE)


def sliding_minute(prev: float, cur: float, now: float) -> float:
    """Sliding-window estimate: the previous minute weighted by how much of it still overlaps."""
    into = (now % MINUTE) / MINUTE
    return prev * (1.0 - into) + cur


def fits(used: float, reserve: int, limit: int) -> bool:
    """A request fits if its reservation fits what is left. One larger than the whole
    window never fits: admission refuses it as impossible before asking the store."""
    return used + reserve <= limit


def sliding_wait(prev: float, cur: float, now: float, reserve: int, limit: int) -> float | None:
    """Seconds until `reserve` fits the sliding minute if nothing else is admitted meanwhile
    (0 if it fits now; None if it never can: larger than the whole limit).

    The previous minute's count slides out linearly over the current minute; the current
    minute's never does before it becomes the previous one. The sliding estimate is
    continuous and, without new traffic, never rises: so waiting this long is enough, and
    any shorter wait is not.
    """
    room = limit - reserve
    if room < 0:
        return None
    into = now % MINUTE
    if prev * (1.0 - into / MINUTE) + cur <= room:
        return 0.0
    if cur <= room:  # within this minute, once enough of the previous one slid out
        return max(0.0, (1.0 - (room - cur) / prev) * MINUTE - into)
    # only in the next minute, where this minute's count slides out in turn
    return MINUTE - into + (1.0 - room / cur) * MINUTE


def sliding_reset(prev: float, cur: float, now: float) -> float:
    """Seconds until the sliding minute counts nothing again (OpenAI's "reset": back to the
    whole limit), without new traffic."""
    if cur > 0:
        return seconds_to_minute_end(now) + MINUTE
    return seconds_to_minute_end(now) if prev > 0 else 0.0


# A spoke that holds no allowance for a global quota's period (the hub's allocator has not
# reached it yet, or its Redis was wiped) admits up to this share of the quota: never
# unlimited, and enough to serve while the allocator catches up (README "One quota across
# spokes"). The allocator counts every spoke it has not yet heard apply an allowance as
# holding this much.
GLOBAL_FALLBACK_SHARE = 0.1


def fallback_allowance(quota: int) -> int:
    return int(quota * GLOBAL_FALLBACK_SHARE)


DAY = 86400.0  # a UTC day in Unix time (which has no leap seconds)


@lru_cache(maxsize=4)
def _calendar(day: int) -> tuple[str, str, float, float]:
    """(day id, month id, day end, month end) of one UTC day: computed once a day, not
    once per request."""
    d = datetime.fromtimestamp(day * DAY, UTC)
    nxt = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=UTC)
    return d.strftime("%Y%m%d"), d.strftime("%Y%m"), (day + 1) * DAY, nxt.timestamp()


def day_id(now: float) -> str:
    return _calendar(int(now // DAY))[0]


def month_id(now: float) -> str:
    return _calendar(int(now // DAY))[1]


def seconds_to_day_end(now: float) -> float:
    return _calendar(int(now // DAY))[2] - now


def seconds_to_month_end(now: float) -> float:
    return _calendar(int(now // DAY))[3] - now


def seconds_to_minute_end(now: float) -> float:
    return MINUTE - (now % MINUTE)
