"""Leases of admitted requests: renewed while they stream, settled exactly once when they end.

Metering calls `begin`, `release`, `settle` and `void`; it never awaits the store itself (a stream
that Envoy reset must not wait on Redis in its `finally`). Settlements are queued and sent
in batches by one background task, retried while the store is down; leases that are never
settled still expire on their own (crash safety).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from gateway import batching, metrics
from gateway.clock import Clock
from gateway.errors import StoreUnavailable
from gateway.limits.types import Ending, Limiter, Release, Settle, Void, first_lease
from gateway.log import log


class Leases:
    def __init__(self, limiter: Limiter, clock: Clock, lease_ttl: float,
                 start_ttl: float | None = None) -> None:
        self.limiter = limiter
        self.clock = clock
        self.renew_every = max(lease_ttl / 3, 0.05)
        # Streams that began since the last tick get their first renewal within a third of
        # the start TTL; the rest are renewed every third of the lease TTL.
        self.tick = max(first_lease(lease_ttl, start_ttl) / 3, 0.05)
        self.active: set[str] = set()
        self.fresh: set[str] = set()
        self._pending: list[Ending] = []
        self._wake = asyncio.Event()
        self._flushed = asyncio.Event()  # replaced by a fresh one after every flush
        self._tasks: list[asyncio.Task[None]] = []
        # What each stream has used so far, read at every renewal and kept with its lease:
        # a sidecar that dies mid-stream leaves the orphan sweep that much to bill.
        self.progress: dict[str, Callable[[], tuple[int, int] | None]] = {}

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._settle_loop()),
                       asyncio.create_task(self._renew_loop())]

    async def stop(self) -> None:
        """Flush what is pending (best effort), then stop the background tasks."""
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(2):
                await self._flush()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def begin(self, request_id: str,
              progress: Callable[[], tuple[int, int] | None] | None = None) -> None:
        """Renew this request's leases from now on; `progress` (prompt, completion tokens
        so far) is checkpointed with each renewal."""
        self.active.add(request_id)
        self.fresh.add(request_id)
        if progress is not None:
            self.progress[request_id] = progress

    def release(self, request_id: str) -> None:
        """The response ended: free its concurrency slots at once (its next request must
        find them free). The rest of the settlement waits for the usage event (`settle`)."""
        self.progress.pop(request_id, None)
        if request_id in self.active:
            self.active.discard(request_id)
            self.fresh.discard(request_id)
            self._pending.append(Release(request_id))
            self._wake.set()

    def settle(self, request_id: str, actual_tokens: int | None) -> None:
        """Replace the reservation with the actual count, once the request's usage event is
        durable: a sidecar killed before that leaves the admission to the orphan sweep, so
        the request still gets exactly one event."""
        self.progress.pop(request_id, None)
        self.active.discard(request_id)
        self.fresh.discard(request_id)
        self._pending.append(Settle(request_id, actual_tokens))
        self._wake.set()

    def void(self, request_id: str) -> None:
        """Undo an admission whose answer came too late (the client got a 503): whatever
        the store committed, or commits later, is released and charged nothing."""
        self.progress.pop(request_id, None)
        self.active.discard(request_id)
        self.fresh.discard(request_id)
        self._pending.append(Void(request_id))
        self._wake.set()

    async def _flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        try:
            await self.limiter.end_many(batch)
        except Exception:
            self._pending = batch + self._pending
            raise
        self._flushed.set()
        self._flushed = asyncio.Event()

    async def next_flush(self, timeout: float) -> None:
        """Wait until the next batch of releases reached the store, or `timeout`: an
        admission denied for concurrency may find the slot it needs freed by then."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flushed.wait(), timeout)

    async def _settle_loop(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            await batching.gather(lambda: len(self._pending))  # requests ending together
            self._wake.clear()
            try:
                await self._flush()
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

    def _checkpoints(self, ids: list[str]) -> dict[str, tuple[int, int]]:
        out = {}
        for rid in ids:
            read = self.progress.get(rid)
            try:
                seen = read() if read is not None else None
            except Exception:  # a checkpoint is best effort; the renewal is not
                log.exception("checkpoint_failed", request_id=rid)
                continue
            if seen is not None:
                out[rid] = seen
        return out

    async def _renew_loop(self) -> None:
        last_all = self.clock.now()
        while True:
            await asyncio.sleep(self.tick)
            now = self.clock.now()
            everyone = now - last_all >= self.renew_every - self.tick / 2
            ids = list(self.active if everyone else self.fresh)
            if not ids:
                if everyone:
                    last_all = now
                continue
            try:
                gone = await self.limiter.renew(ids, now, self._checkpoints(ids))
            except Exception as exc:
                log.warning("lease_renew_failed", active=len(ids), error=repr(exc))
                continue
            self.fresh.difference_update(ids)
            self.active.difference_update(gone)
            if everyone:
                last_all = now
