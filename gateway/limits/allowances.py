"""A spoke's allowances of the global quotas (DESIGN §10): what the hub's allocator hands
it, written where admission reads them. The Redis store and the in-process limiter
implement the same `AllowanceStore`, so the follower and the tests drive either."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal, Protocol

from gateway.errors import StoreUnavailable
from gateway.limits.resp import RedisReplyError, RespClient, Script

Period = Literal["day", "month"]
PERIOD_WINDOW: dict[str, str] = {"day": "tpd", "month": "tpmo"}  # the keys' window names


@dataclass(frozen=True, slots=True)
class Allowance:
    """This spoke's total for one quota and period: not an increment, so the spoke's own
    counter stays the truth."""

    scope: str  # the tier's key: 'team:<name>' or 'key:<key id>'
    period: Period
    period_id: str  # UTC: YYYYMMDD for a day, YYYYMM for a month
    tokens: int
    # The use the allocator counted for this spoke in the period (its usage events): the
    # spoke's counter, where below, is raised to it plus the reservations in flight it
    # holds, so a quota added mid-period counts the period's earlier use on the spoke as it
    # does in the allocator.
    known: int = 0


@dataclass(frozen=True, slots=True)
class Applied:
    """What the spoke enforces after applying an allowance (never below what it used:
    `used` is its counter, reservations of requests in flight included)."""

    scope: str
    period: Period
    period_id: str
    allowance: int
    used: int


class AllowanceStore(Protocol):
    async def apply_allowances(self, generation: int,
                               entries: Sequence[Allowance]) -> list[Applied] | None:
        """Write `entries` unless this store already took a later generation (None then):
        an allocation never goes back to an older one. The one held, again, is applied
        again (idempotent)."""
        ...

    async def allowance_generation(self) -> int:
        """The last generation applied (0: none)."""
        ...


class RedisAllowances(AllowanceStore):
    """The spoke's Redis: one script applies a generation atomically (allowances.lua)."""

    def __init__(self, redis: RespClient) -> None:
        self.redis = redis
        text = resources.files("gateway.limits").joinpath("allowances.lua").read_text()
        self._apply = Script(redis, text)

    async def apply_allowances(self, generation: int,
                               entries: Sequence[Allowance]) -> list[Applied] | None:
        args: list[object] = [generation, len(entries)]
        for e in entries:
            args += [PERIOD_WINDOW[e.period], e.scope, e.period_id, e.tokens, _ttl_ms(e.period),
                     e.known]
        try:
            rows = await self._apply(*args)
        except (TimeoutError, RedisReplyError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        if not rows:
            return None
        return [Applied(e.scope, e.period, e.period_id, int(a), int(u))
                for e, (a, u) in zip(entries, rows[1:], strict=True)]

    async def allowance_generation(self) -> int:
        try:
            raw = await self.redis.call("GET", "gw:allow:gen")
        except (TimeoutError, RedisReplyError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        return int(raw or 0)


def _ttl_ms(period: Period) -> int:
    """As long as admission keeps the period's counter (admit.lua)."""
    return 172800000 if period == "day" else 3456000000
