"""The endings on their way to the limiter store: queued by the ledger's transitions
(gateway/limits/ledger.py), sent in batches by one background task, retried while the store
is down, in the order they were queued.

Callers never await the store here (a stream that Envoy reset must not wait on Redis in
its `finally`); those that must know an ending arrived wait for it: `sent` (a batch of
Envoy's records, answered only once its settlements are in the store) and `next_flush` (a
concurrency denial waiting for slots on their way back).
"""

from __future__ import annotations

import asyncio
import contextlib

from gateway import batching, metrics
from gateway.limits.types import Ending, Limiter
from gateway.log import log


class Outbox:
    def __init__(self, limiter: Limiter) -> None:
        self._limiter = limiter
        self._pending: list[Ending] = []
        # Endings ever queued, and how many of them reached the store: the first `_sent`
        # (the queue keeps its order, a failed batch going back to its front).
        self._queued = 0
        self._sent = 0
        self._wake = asyncio.Event()
        self._flushed = asyncio.Event()  # replaced by a fresh one after every flush

    @property
    def queued(self) -> int:
        """How many endings were ever queued (a mark: did a call queue any?)."""
        return self._queued

    def put(self, end: Ending) -> None:
        self._pending.append(end)
        self._queued += 1
        self._wake.set()

    async def sent(self, timeout: float) -> bool:
        """Wait until every ending queued so far has reached the store; False if `timeout`
        came first (the store is down: they stay queued, retried). A batch of Envoy's
        records is answered only after this: answered before, a sidecar killed between the
        answer and the flush would lose the settlements of records Envoy then never sends
        again, and their admissions would wait for the orphan sweep, billed their
        reservation."""
        mark = self._queued
        if self._sent >= mark:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self._sent < mark:
                    await self._flushed.wait()
        return self._sent >= mark

    async def next_flush(self, timeout: float) -> None:
        """Wait until the next batch of endings reached the store, or `timeout`: an
        admission denied for concurrency may find the slot it needs freed by then."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flushed.wait(), timeout)

    async def flush(self) -> None:
        """Send what is queued now, in one batch (the store's calls: at most MAX_BATCH
        each); on failure it goes back to the front of the queue, and the error is raised."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        try:
            await self._limiter.end_many(batch)
        except Exception:
            self._pending = batch + self._pending
            raise
        self._sent += len(batch)
        self._flushed.set()
        self._flushed = asyncio.Event()

    async def run(self) -> None:
        """The background task: flush as endings come, retrying while the store is away."""
        backoff = 0.05
        while True:
            await self._wake.wait()
            await batching.gather(lambda: len(self._pending))  # requests ending together
            self._wake.clear()
            try:
                await self.flush()
                backoff = 0.05
            except Exception as exc:  # StoreUnavailable, or anything: never stop settling
                metrics.SETTLE_ERRORS.inc()
                log.warning("settle_deferred", pending=len(self._pending), error=repr(exc))
                # Retry soon, and at once when another request ends: a slot held one second
                # too long after Redis returns is a spurious 429 for someone.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), backoff)
                backoff = min(backoff * 2, 0.5)
                self._wake.set()
