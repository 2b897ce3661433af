"""The embedded mode's limiter forgets the token windows admission no longer reads."""

from __future__ import annotations

from gateway.limits import maths
from gateway.limits.memory import MemoryLimiter
from gateway.limits.types import AdmitRequest, Admitted
from gateway.policy.model import LimitSpec, TierLimit

T0 = 1_800_000_000.0  # 2027-01-15
TIERS = (TierLimit("team", "t", LimitSpec(tokens_per_minute=10_000, tokens_per_day=10**9,
                                          tokens_per_month=10**10)),
         TierLimit("key", "k", LimitSpec(tokens_per_minute=10_000)))


async def test_a_long_running_limiter_keeps_a_bounded_number_of_token_windows() -> None:
    """A request every ten minutes for 60 days: it holds a few minutes, days and months of
    each tier (as Redis, whose TTLs drop the rest), not every window it ever counted."""
    lim = MemoryLimiter()
    for i in range(60 * 24 * 6):
        now = T0 + i * 600.0
        v = await lim.admit(AdmitRequest(f"r{i}", TIERS, 10, now))
        assert isinstance(v, Admitted)
        await lim.settle(f"r{i}", 7)
    assert len(lim.tokens) <= 2 * 3 + 3 + 3  # minutes of 2 tiers, days and months of one
    day, month = maths.day_id(now), maths.month_id(now)
    assert lim.tokens[f"tpd:team:t:{day}"] > 0 and lim.tokens[f"tpmo:team:t:{month}"] > 0
    minute = maths.minute_index(now)
    assert lim.tokens[f"tpm:key:k:{minute}"] == 7
