"""Admitting ahead: the Redis round trip off the request's path (docs/admit-ahead.md).

Once a request is admitted through Redis, a *ticket* is admitted for the next request of
the same key and model. A ticket is an ordinary admission: admit.lua, all three tiers at
once. It has an id of its own that starts with TICKET, and admit.lua refuses it unless
every tier keeps a quarter of each of its limits free. The next Check for that key and
model takes the ticket if its reservation is no larger, and is answered without waiting
on Redis. The ticket is then renamed to the request (bind.lua), so Redis holds what
admitting the request itself would have written.
Guards:
- A ticket nobody takes within `ttl` is settled at zero, with no event: no request existed.
- A ticket is taken only while the connection it was admitted on lives, so a Redis that
  goes away fails closed as before.
- Limits under FLOOR never get tickets, so small limits behave exactly as without.
Off unless GATEWAY_ADMIT_AHEAD_MS is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway import metrics
from gateway.errors import StoreInDoubt, StoreUnavailable
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.standing import Counters
from gateway.limits.types import (
    TICKET,
    AdmitRequest,
    Admitted,
    Checkpoint,
    Ending,
    Limiter,
    Orphan,
    Settle,
    Verdict,
    Void,
)
from gateway.log import log
from gateway.policy.model import TierLimit

# No ticket for a tier with an rps burst or a concurrency under this, or a token limit
# under this many reservations: a test or a tight customer sees such limits request by
# request, and a ticket would hold a visible share of them. admit.lua applies it to the
# limits it enforces (a global quota's allowance among them); this is the cheap look first.
FLOOR = 16


def worth_a_ticket(tiers: tuple[TierLimit, ...], reserve: int) -> bool:
    """Whether every limit of these tiers is large enough for a ticket to hide in it."""
    tokens = FLOOR * max(reserve, 1)
    for t in tiers:
        sp = t.spec
        if sp.rps is not None and (sp.burst or 0) < FLOOR:
            return False
        if sp.concurrency is not None and sp.concurrency < FLOOR:
            return False
        for limit in (sp.tokens_per_minute, sp.tokens_per_day, sp.tokens_per_month,
                      sp.global_tokens_per_day, sp.global_tokens_per_month):
            if limit is not None and limit < tokens:
                return False
    return True


@dataclass(slots=True)
class _Ticket:
    id: str
    tiers: tuple[TierLimit, ...]
    reserve: int
    verdict: Admitted
    conn: object  # the connection it was admitted on
    expiry: asyncio.TimerHandle | None = None


class AheadLimiter(Limiter):
    """A RedisLimiter that answers from tickets where it holds one (module docstring)."""

    def __init__(self, inner: RedisLimiter, ttl: float) -> None:
        self.inner = inner
        self.ttl = ttl
        # Whether a request id is live here already (the ledger follows it): such a request
        # goes to Redis, which answers DuplicateId, rather than take a ticket.
        self.follows: Callable[[str], bool] = lambda request_id: False
        self._shelf: dict[int, _Ticket] = {}  # id(tiers) -> its ticket
        self._asking: set[int] = set()
        self._ids = itertools.count(1)
        self._prefix = f"{TICKET}{os.getpid():x}-{id(self):x}-"
        self._tasks: set[asyncio.Task[Any]] = set()

    async def admit(self, req: AdmitRequest) -> Verdict:
        key = id(req.tiers)
        t = self._shelf.get(key)
        if (t is not None and t.tiers is req.tiers and req.reserve <= t.reserve
                and t.conn is self.inner.answering() and not self.follows(req.request_id)):
            del self._shelf[key]
            if t.expiry is not None:
                t.expiry.cancel()
            metrics.child(metrics.TICKETS, "taken").inc()
            # The bind, then the next ticket: both written in the next turn of the loop, one
            # behind the other, so Redis (and this loop) wakes once for the two.
            self._spawn(self._bind(t, req))
            if worth_a_ticket(req.tiers, req.reserve):
                self._ask(req)
            return t.verdict
        try:
            verdict = await self.inner.admit(req)
        except StoreUnavailable:
            self._drop_all()
            raise
        if (isinstance(verdict, Admitted) and verdict.owes_settlement
                and worth_a_ticket(req.tiers, req.reserve)):
            self._ask(req)
        return verdict

    def _ask(self, req: AdmitRequest) -> None:
        key = id(req.tiers)
        # No ticket from a request no token window applies to (count_tokens): a request
        # that takes it may need them (a ticket from a request that counts them serves one
        # that does not: it passed more than it needed).
        if key in self._shelf or key in self._asking or not req.tokens:
            return
        self._asking.add(key)
        ticket = AdmitRequest(f"{self._prefix}{next(self._ids)}", req.tiers, req.reserve,
                              req.now, req.meta)
        self._spawn(self._fill(key, ticket))

    async def _fill(self, key: int, req: AdmitRequest) -> None:
        conn = self.inner.answering()
        try:
            verdict = await self.inner.admit_now(req)
        except StoreInDoubt:
            self._end(Void(req.request_id))  # it may have committed: undo it
            return
        except StoreUnavailable:
            return
        finally:
            self._asking.discard(key)
        if not isinstance(verdict, Admitted):
            metrics.child(metrics.TICKETS, "refused").inc()  # no headroom, or a limit
            return
        if conn is None or conn is not self.inner.answering() or key in self._shelf:
            self._end(Settle(req.request_id, 0))
            return
        t = _Ticket(req.request_id, req.tiers, req.reserve, verdict, conn)
        t.expiry = asyncio.get_running_loop().call_later(self.ttl, self._expire, key, t)
        self._shelf[key] = t

    def _expire(self, key: int, t: _Ticket) -> None:
        if self._shelf.get(key) is t:
            del self._shelf[key]
            metrics.child(metrics.TICKETS, "expired").inc()
            self._end(Settle(t.id, 0))

    async def _bind(self, t: _Ticket, req: AdmitRequest) -> None:
        try:
            bound = await self.inner.bind(t.id, req)
        except StoreUnavailable as exc:
            # The answer is given: the ticket stays under its own id until its lease runs
            # out and the sweep frees it; this request's settlement will find nothing.
            log.warning("ticket_not_bound", request_id=req.request_id, error=str(exc))
            metrics.child(metrics.TICKETS, "unbound").inc()
            return
        if bound != 1:
            log.warning("ticket_not_bound", request_id=req.request_id,
                        reason="ticket gone" if bound == 0 else "request id live")
            metrics.child(metrics.TICKETS, "unbound").inc()
            if bound == -1:
                self._end(Settle(t.id, 0))

    def _drop_all(self) -> None:
        """The store failed: no ticket admitted before may answer for it (fail closed)."""
        for t in self._shelf.values():
            if t.expiry is not None:
                t.expiry.cancel()
            self._end(Settle(t.id, 0))
        self._shelf.clear()

    def _end(self, end: Ending) -> None:
        self._spawn(self._end_quietly(end))

    async def _end_quietly(self, end: Ending) -> None:
        # Store away: its lease runs out, and the sweep frees it without an event (a ticket).
        with contextlib.suppress(StoreUnavailable):
            await self.inner.end_many([end])

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the rest is the store's ---------------------------------------------------------

    async def end_many(self, ends: Sequence[Ending]) -> None:
        await self.inner.end_many(ends)

    async def renew(self, request_ids: list[str], now: float,
                    checkpoints: Mapping[str, Checkpoint] | None = None) -> list[str]:
        return await self.inner.renew(request_ids, now, checkpoints)

    async def sweep(self, now: float, limit: int = 100) -> list[Orphan]:
        return await self.inner.sweep(now, limit)

    async def counters(self, tier_key: str, now: float) -> Counters:
        return await self.inner.counters(tier_key, now)

    async def ping(self) -> bool:
        return await self.inner.ping()

    async def ping_failure(self) -> str:
        return await self.inner.ping_failure()

    async def close(self) -> None:
        for t in self._shelf.values():
            if t.expiry is not None:
                t.expiry.cancel()
        if self._shelf:  # settled now, rather than left to their leases
            ends: list[Ending] = [Settle(t.id, 0) for t in self._shelf.values()]
            self._shelf.clear()
            with contextlib.suppress(StoreUnavailable, TimeoutError):
                await asyncio.wait_for(self.inner.end_many(ends), 1.0)
        for task in list(self._tasks):
            task.cancel()
        await self.inner.close()
