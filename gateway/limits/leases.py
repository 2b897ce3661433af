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
from gateway.limits.types import Abandon, Ending, Limiter, Release, Settle, Void, first_lease
from gateway.log import log


class Leases:
    """`unheard_s`: how long an Envoy-fed admission (`watch`) is renewed without any word of
    its request from Envoy (its heartbeat records, `heard`): Envoy died, or lost the record.
    Past it the lease runs out and the orphan sweep frees and bills the request."""

    def __init__(self, limiter: Limiter, clock: Clock, lease_ttl: float,
                 start_ttl: float | None = None, unheard_s: float | None = None) -> None:
        self.limiter = limiter
        self.clock = clock
        self.unheard_s = lease_ttl if unheard_s is None else unheard_s
        self.heard_until: dict[str, float] = {}  # watched admissions: renewed until then
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

    def watch(self, request_id: str) -> None:
        """An admission whose request only Envoy follows (Envoy-fed metering): renewed while
        Envoy keeps reporting the request alive, not for as long as this process lives."""
        self.begin(request_id)
        self.heard_until[request_id] = self.clock.now() + self.unheard_s

    def heard(self, request_id: str, checkpoint: tuple[int, int] | None) -> None:
        """Envoy's heartbeat record of a request still in flight (perhaps admitted by another
        instance, or before a restart): renew its lease, checkpointing its usage so far."""
        if request_id not in self.active:  # adopted: renewed at the next tick
            self.active.add(request_id)
            self.fresh.add(request_id)
        self.heard_until[request_id] = self.clock.now() + self.unheard_s
        if checkpoint is not None:
            self.progress[request_id] = lambda: checkpoint

    def abandon(self, request_id: str) -> None:
        """Nobody will report this request's end (its record is unreadable): to the sweep."""
        self._forget(request_id)
        self._pending.append(Abandon(request_id))
        self._wake.set()

    def _forget(self, request_id: str) -> None:
        self.progress.pop(request_id, None)
        self.heard_until.pop(request_id, None)
        self.active.discard(request_id)
        self.fresh.discard(request_id)

    def release(self, request_id: str) -> None:
        """The response ended: free its concurrency slots at once (its next request must
        find them free). The rest of the settlement waits for the usage event (`settle`)."""
        was_active = request_id in self.active
        self._forget(request_id)
        if was_active:
            self._pending.append(Release(request_id))
            self._wake.set()

    def settle(self, request_id: str, actual_tokens: int | None) -> None:
        """Replace the reservation with the actual count, once the request's usage event is
        durable: a sidecar killed before that leaves the admission to the orphan sweep, so
        the request still gets exactly one event."""
        self._forget(request_id)
        self._pending.append(Settle(request_id, actual_tokens))
        self._wake.set()

    def void(self, request_id: str) -> None:
        """Undo an admission whose answer came too late (the client got a 503): whatever
        the store committed, or commits later, is released and charged nothing."""
        self._forget(request_id)
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

    def _give_up_unheard(self, now: float) -> None:
        """Stop renewing watched admissions Envoy has said nothing of for `unheard_s`: their
        leases run out and the orphan sweep frees and bills them."""
        gone = [r for r, until in self.heard_until.items() if until < now]
        if not gone:
            return
        for rid in gone:
            self._forget(rid)
        metrics.ADMISSIONS_UNHEARD.inc(len(gone))
        # One line a tick, not one per request: an Envoy that died with thousands of
        # requests in flight must not stall the event loop (and every Check) on logging.
        log.warning("admissions_unheard", count=len(gone), request_ids=gone[:10],
                    unheard_s=self.unheard_s)

    async def _renew_loop(self) -> None:
        last_all = self.clock.now()
        while True:
            await asyncio.sleep(self.tick)
            now = self.clock.now()
            if self.heard_until:
                self._give_up_unheard(now)
            metrics.ADMISSIONS_OPEN.set(len(self.active))
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
