"""Where a tier stands now: per limit, what is allowed, used and left, from the limiter's
own counters (not the usage topic), for `gateway keys show`.

`Counters` is what a store holds for one tier; `standing` turns it into numbers with the
same formulas admission uses (gateway/limits/maths.py, admit.lua), so "left" is what the
next admission would see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gateway.limits import maths
from gateway.policy.model import TierLimit


@dataclass(frozen=True, slots=True)
class Counters:
    """One tier's raw counters at `now`: the GCRA arrival time (seconds, 0 = none), live
    leases, token counts of the previous and current minute, the day and the month; and
    for a global quota, this spoke's count of the day and the month and the allowance it
    holds of each (None: none held, so admission enforces the fallback share)."""

    tat: float = 0.0
    in_flight: int = 0
    minute_prev: float = 0.0
    minute_cur: float = 0.0
    day: float = 0.0
    month: float = 0.0
    global_day: float = 0.0
    global_month: float = 0.0
    allowance_day: float | None = None
    allowance_month: float | None = None


@dataclass(frozen=True, slots=True)
class Window:
    limit: str  # rps | concurrency | tokens_per_minute | tokens_per_day | tokens_per_month
    #             | global_tokens_per_day | global_tokens_per_month
    allowed: float  # the limit (rps: the burst, requests at once; global: this spoke's share)
    used: float  # global: this spoke's use
    left: float
    resets_in: float | None  # seconds until it is whole again; None: it does not reset
    per_s: float | None = None  # rps: the refill rate
    quota: int | None = None  # global: the quota for all spokes together


@dataclass(frozen=True, slots=True)
class Standing:
    tier: str
    name: str
    windows: tuple[Window, ...]


def standing(t: TierLimit, c: Counters, now: float) -> Standing:
    s, out = t.spec, []
    if s.rps is not None and s.burst is not None:
        interval = 1.0 / s.rps
        tat = max(c.tat, now)
        left = max(0, min(s.burst, math.floor((now - (tat - s.burst * interval)) / interval
                                              + 1e-4)))
        out.append(Window("rps", s.burst, s.burst - left, left, tat - now, s.rps))
    if s.concurrency is not None:
        out.append(Window("concurrency", s.concurrency, c.in_flight,
                          max(0, s.concurrency - c.in_flight), None))
    if s.tokens_per_minute is not None:
        used = maths.sliding_minute(c.minute_prev, c.minute_cur, now)
        # the previous minute's share slides out by the next minute's end; the current's
        # by the end of the one after
        resets = maths.seconds_to_minute_end(now) + (maths.MINUTE if c.minute_cur else 0)
        out.append(_tokens("tokens_per_minute", s.tokens_per_minute, used,
                           resets if used else 0.0))
    if s.tokens_per_day is not None:
        out.append(_tokens("tokens_per_day", s.tokens_per_day, c.day,
                           maths.seconds_to_day_end(now)))
    if s.tokens_per_month is not None:
        out.append(_tokens("tokens_per_month", s.tokens_per_month, c.month,
                           maths.seconds_to_month_end(now)))
    if s.global_tokens_per_day is not None:
        out.append(_global("global_tokens_per_day", s.global_tokens_per_day, c.allowance_day,
                           c.global_day, maths.seconds_to_day_end(now)))
    if s.global_tokens_per_month is not None:
        out.append(_global("global_tokens_per_month", s.global_tokens_per_month,
                           c.allowance_month, c.global_month, maths.seconds_to_month_end(now)))
    return Standing(t.tier, t.name, tuple(out))


def _global(kind: str, quota: int, allowance: float | None, used: float,
            resets: float) -> Window:
    """A global quota as admission enforces it here: against this spoke's allowance, else
    the fallback share (admit.lua)."""
    limit = int(allowance) if allowance is not None else maths.fallback_allowance(quota)
    return replace(_tokens(kind, limit, used, resets), quota=quota)


def _tokens(kind: str, limit: int, used: float, resets: float) -> Window:
    used = math.ceil(used)
    return Window(kind, limit, used, max(0, limit - used), resets)


def redis_keys(tier_key: str, now: float) -> tuple[str, str, str, str, str, str]:
    """The counters admit.lua keeps for a tier ("team:team-a"), as of `now`."""
    minute = maths.minute_index(now)
    return (f"gw:rps:{tier_key}", f"gw:conc:{tier_key}", f"gw:tpm:{tier_key}:{minute - 1}",
            f"gw:tpm:{tier_key}:{minute}", f"gw:tpd:{tier_key}:{maths.day_id(now)}",
            f"gw:tpmo:{tier_key}:{maths.month_id(now)}")


def redis_global_keys(tier_key: str, now: float) -> tuple[str, str, str, str]:
    """A global quota's counters and allowances admit.lua reads (day, month of each)."""
    day, month = maths.day_id(now), maths.month_id(now)
    return (f"gw:gtpd:{tier_key}:{day}", f"gw:gtpmo:{tier_key}:{month}",
            f"gw:allow:tpd:{tier_key}:{day}", f"gw:allow:tpmo:{tier_key}:{month}")
