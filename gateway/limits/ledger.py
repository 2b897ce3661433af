"""The ledger of admissions: where each admission this process follows stands, from the
Check to its one end, and the store calls that move it on.

An admission the store committed (`Admitted(owes_settlement=True)`) holds concurrency slots
and a token reservation until it ends. One idempotent method per transition (the stages,
and which may follow which: gateway/limits/stages.py):

    admitted ──> begun ──> released ──> settled     (Envoy-fed metering: no `begun`)
        └──────────┴───────────┴──────> voided | orphaned (or settled without a release)

    heard: Envoy's heartbeat of a request in flight (renew it; adopt it if unknown here)
    given up by the renewal loop: unheard (Envoy said nothing of it for `unheard_s`) or
    expired (older than `max_lifetime_s`): no longer renewed, its lease runs out and the
    orphan sweep frees and bills it (its last checkpoint), unless its end comes first.

Callers never await the store (a stream that Envoy reset must not wait on Redis in its
`finally`): endings go to the outbox (gateway/limits/outbox.py), which sends them in
batches from one background task, retried while the store is down. A second task renews
what this process follows (begun streams, watched admissions) in one store call per tick,
checkpointing each one's usage so far. An admission nobody ends still runs out on its own
(crash safety).

A tick costs what it renews, not what is followed: the admissions are filed at each
transition by what the renewal loop does with them (gateway/limits/followed.py), so that a
tick between two rounds of everyone touches only the fresh ones.

A transition with no request id, or from a stage it cannot come from, is a no-op, counted
in gateway_ledger_refused_total and logged once per kind, never raised: the caller is a
stream's `finally` or a batch of Envoy's records, which must not fail for it. Repeating
a transition (a cut stream's second release) is quietly nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from gateway import metrics
from gateway.clock import Clock
from gateway.errors import StoreUnavailable
from gateway.limits.followed import Followed
from gateway.limits.outbox import Outbox
from gateway.limits.stages import FROM, GIVEN_UP, REPEATS, Admission, Progress, Stage
from gateway.limits.types import (
    Abandon,
    Checkpoint,
    Limiter,
    Orphan,
    Release,
    Settle,
    Void,
    first_lease,
)
from gateway.log import log
from gateway.tasks import cancel_all, watched

# A round of renewals goes this many ids at a time, the event loop free between two (the
# Redis store's own batch, redis_store.MAX_BATCH: one script a chunk).
RENEW_CHUNK = 256

class Ledger:
    """`watches`: admissions only Envoy follows (Envoy-fed metering, no stream here): each
    is renewed from the Check on, while Envoy's heartbeats (`heard`) say its request lives.
    Otherwise an admission is renewed once its metering stream has `begun`.

    `unheard_s`: how long a watched admission is renewed without any word of its request
    from Envoy (Envoy died, or lost the record). `max_lifetime_s`: no admission is renewed
    past it (a stream or a heartbeat that never stops must not hold a slot for ever).

    `hears`: False in a process Envoy's records never reach (a door process, app.Role): it
    renews its admissions until another process hears of them, so giving one up unheard
    there is expected, not Envoy's loss: neither counted nor logged as one (if Envoy did
    lose it, the orphan sweep still frees, bills and counts it)."""

    def __init__(self, limiter: Limiter, clock: Clock, lease_ttl: float,
                 start_ttl: float | None = None, *, watches: bool = False,
                 unheard_s: float | None = None, max_lifetime_s: float = float("inf"),
                 hears: bool = True) -> None:
        self._limiter = limiter
        self._clock = clock
        self.watches = watches
        self.hears = hears
        self.unheard_s = lease_ttl if unheard_s is None else unheard_s
        self.max_lifetime_s = max_lifetime_s
        self.first_lease = first_lease(lease_ttl, start_ttl)
        self.renew_every = max(lease_ttl / 3, 0.05)
        # Streams that began since the last tick get their first renewal within a third of
        # the start TTL; the rest are renewed every third of the lease TTL.
        self.tick = max(self.first_lease / 3, 0.05)
        self._followed = Followed()
        self._last_all = clock.now()  # the last round of everyone
        self._refused: set[tuple[str, str]] = set()  # kinds of refusal already logged
        self.outbox = Outbox(limiter)  # the endings, on their way to the store
        self._tasks: list[asyncio.Task[None]] = []
        self._occupied = asyncio.Event()  # set when an admission is taken on (_hold)

    def start(self) -> None:
        self._tasks = [watched(self.outbox.run(), "settlement_outbox"),
                       watched(self._renew_loop(), "lease_renewer")]

    async def stop(self) -> None:
        """Flush what is pending (best effort), then stop the background tasks."""
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(2):
                await self.outbox.flush()
        await cancel_all(self._tasks)

    def stage(self, request_id: str) -> Stage | None:
        """Where this admission stands here (None: unknown, or ended long enough ago)."""
        a = self._followed.find(request_id)
        return a.stage if a is not None else None

    # --- the transitions ---------------------------------------------------------------

    def admitted(self, request_id: str) -> None:
        """The Check admitted it and the store holds something of it. Watched, it is renewed
        from now on; otherwise its metering stream takes it on (`begun`, here or in another
        process) and this entry is forgotten once the first lease has run out."""
        a = self._followed.find(request_id)
        if not self._may("admitted", request_id, a):
            return
        now = self._clock.now()
        self._hold(request_id, Admission(
            Stage.ADMITTED, now, heard_until=now + self.unheard_s if self.watches else None))

    def begun(self, request_id: str, progress: Progress | None = None) -> None:
        """Its metering stream began: renew its lease from now on; `progress` (prompt,
        completion tokens so far, and the weighted count for a model with token weights) is
        checkpointed with each renewal."""
        a = self._followed.find(request_id)
        if not self._may("begun", request_id, a):
            return
        if a is not None and a.stage is Stage.ADMITTED:
            a.stage, a.heard_until, a.progress = Stage.BEGUN, None, progress
            self._followed.track(request_id, a)
            return
        # admitted by another process (or a new request)
        self._hold(request_id, Admission(Stage.BEGUN, self._clock.now(), progress=progress))

    def heard(self, request_id: str, checkpoint: Checkpoint | None) -> None:
        """Envoy's heartbeat record of a request still in flight (perhaps admitted by another
        instance, or before a restart): renew it, checkpointing its usage so far. One given
        up as unheard is taken back (within its lifetime); an expired one only stays known."""
        a = self._followed.find(request_id)
        if not self._may("heard", request_id, a):
            return
        now = self._clock.now()
        if a is not None and a.stage in GIVEN_UP and now - a.since >= self.max_lifetime_s:
            # kept known while heard, not renewed
            self._followed.remember(request_id, a, Stage.EXPIRED, now)
            return
        if a is None:  # adopted: renewed at the next tick
            a = Admission(Stage.ADMITTED, now)
        elif a.stage is Stage.UNHEARD:  # taken back (_hold, below)
            a.stage, a.fresh = Stage.ADMITTED, True
        a.heard_until = now + self.unheard_s
        if checkpoint is not None:
            a.progress = lambda: checkpoint
        if a.stage is Stage.ADMITTED:
            self._hold(request_id, a)

    def released(self, request_id: str) -> None:
        """The response ended: free its concurrency slots at once (its next request must
        find them free). The rest of the settlement waits for the usage event (`settled`).
        Only what this process renews is released early; any other admission is freed by
        its settlement, moments later."""
        a = self._followed.find(request_id)
        if not self._may("released", request_id, a):
            return
        if a is not None and a.renewed():
            self.outbox.put(Release(request_id))
        if a is None:
            a = Admission(Stage.RELEASED, self._clock.now())
        a.stage, a.heard_until, a.progress = Stage.RELEASED, None, None
        self._hold(request_id, a)

    def settled(self, request_id: str, actual_tokens: int | None) -> None:
        """Replace the reservation with the actual count, once the request's usage event is
        durable: a sidecar killed before that leaves the admission to the orphan sweep, so
        the request still gets exactly one event."""
        if self._end("settled", request_id, Stage.SETTLED):
            self.outbox.put(Settle(request_id, actual_tokens))

    def voided(self, request_id: str) -> None:
        """Undo an admission nobody will act on (its answer came too late, or the Check was
        cancelled): whatever the store committed, or commits later, is released and
        charged nothing."""
        if self._end("voided", request_id, Stage.VOIDED):
            self.outbox.put(Void(request_id))

    def orphaned(self, request_id: str) -> None:
        """Nobody will report this request's end (its record is unreadable): to the sweep,
        which frees it and bills its last checkpoint."""
        if self._end("orphaned", request_id, Stage.ORPHANED):
            self.outbox.put(Abandon(request_id))

    def settled_before(self, ends: Iterable[tuple[str, int]]) -> int:
        """Settlements a previous run may have lost (killed after an event was durable,
        before its settlement reached the store): (request id, actual tokens), sent as
        they are, not followed here. The store ignores those it no longer holds (settled,
        or swept), so sending the tail of a spool again is safe. How many were sent."""
        n = 0
        for request_id, actual_tokens in ends:
            self.outbox.put(Settle(request_id, actual_tokens))
            n += 1
        return n

    async def sweep(self, now: float, limit: int) -> list[Orphan]:
        """Claim (once, across instances) admissions whose lease ran out unsettled: each
        is freed and billed by the store, and ends here as orphaned."""
        orphans = await self._limiter.sweep(now, limit)
        for o in orphans:
            if o.lost:
                metrics.ORPHAN_RECORDS_LOST.inc()
                log.error("orphan_record_lost", request_id=o.request_id,
                          why="its record expired before any sidecar swept it: no event, "
                              "and its reservation stays on the token counters")
        orphans = [o for o in orphans if not o.lost]
        at = self._clock.now()
        for o in orphans:
            a = self._followed.find(o.request_id) or Admission(Stage.ORPHANED, at)
            self._followed.remember(o.request_id, a, Stage.ORPHANED, at)
        return orphans

    # --- bookkeeping -------------------------------------------------------------------

    def _may(self, transition: str, request_id: str, a: Admission | None) -> bool:
        """Whether `transition` applies now: a repeat is quietly nothing, the rest refused."""
        if not request_id:
            self._refuse(transition, request_id, "no_id")
            return False
        if a is not None and a.stage is REPEATS.get(transition):
            return False
        if (a.stage if a is not None else None) in FROM[transition]:
            return True
        self._refuse(transition, request_id, a.stage.value if a is not None else "unknown")
        return False

    def _refuse(self, transition: str, request_id: str, stage: str) -> None:
        metrics.LEDGER_REFUSED.labels(transition, stage).inc()
        if (transition, stage) not in self._refused:  # once a kind: a bug, not a flood
            self._refused.add((transition, stage))
            log.warning("ledger_transition_refused", transition=transition, stage=stage,
                        request_id=request_id[:80], note="counted from now on, not logged")

    def _end(self, transition: str, request_id: str, stage: Stage) -> bool:
        a = self._followed.find(request_id)
        if not self._may(transition, request_id, a):
            return False
        now = self._clock.now()
        self._followed.remember(request_id, a or Admission(stage, now), stage, now)
        return True

    def _hold(self, request_id: str, a: Admission) -> None:
        """Follow it (after any change to it), and wake the renewal loop if it sleeps."""
        self._followed.hold(request_id, a)
        self._occupied.set()

    def _due(self, now: float, rids: list[str], unheard: list[str], expired: list[str]
             ) -> tuple[list[str], dict[str, Checkpoint], list[tuple[str, Admission]]]:
        """Of `rids`, those still renewed here that are due a renewal now, their usage so
        far, and the fresh ones among them; those past their lifetime or unheard are given
        up instead (added to `unheard`, `expired`)."""
        ids: list[str] = []
        checkpoints: dict[str, Checkpoint] = {}
        fresh: list[tuple[str, Admission]] = []
        for rid in rids:
            if (a := self._followed.renewed.get(rid)) is None:
                continue  # ended (or released) since the tick began
            if now - a.since >= self.max_lifetime_s:
                self._followed.remember(rid, a, Stage.EXPIRED, now)
                expired.append(rid)
                continue
            if a.heard_until is not None and a.heard_until < now:
                self._followed.remember(rid, a, Stage.UNHEARD, now)
                unheard.append(rid)
                continue
            ids.append(rid)
            if a.fresh:
                fresh.append((rid, a))
            if (read := a.progress) is not None:
                try:
                    seen = read()
                except Exception:  # a checkpoint is best effort; the renewal is not
                    log.exception("checkpoint_failed", request_id=rid)
                    continue
                if seen is not None:
                    checkpoints[rid] = seen
        return ids, checkpoints, fresh

    def _gave_up(self, unheard: list[str], expired: list[str]) -> None:
        # One line a tick, not one per request: an Envoy that died with thousands of
        # requests in flight must not stall the event loop (and every Check) on logging.
        if unheard and self.hears:
            metrics.ADMISSIONS_UNHEARD.inc(len(unheard))
            log.warning("admissions_unheard", count=len(unheard), request_ids=unheard[:10],
                        unheard_s=self.unheard_s)
        if expired:
            metrics.ADMISSIONS_EXPIRED.inc(len(expired))
            log.warning("admissions_expired", count=len(expired), request_ids=expired[:10],
                        max_lifetime_s=self.max_lifetime_s)

    # --- the background tasks ----------------------------------------------------------

    async def _renew_loop(self) -> None:
        self._last_all = self._clock.now()
        while True:
            if not self._followed.live and not self._followed.ended:
                # Nothing to renew, give up or forget: an idle sidecar does not tick (a
                # wakeup every `tick` for nothing) until an admission is taken on.
                self._occupied.clear()
                await self._occupied.wait()
            await asyncio.sleep(self.tick)
            await self._wakeup()

    async def _wakeup(self) -> None:
        """One tick: every `renew_every` a round of everyone, otherwise the fresh admissions
        only, so that a tick between rounds costs what it renews. Either way those due are
        looked at first (_due): none is renewed past its lifetime or unheard, as when every
        tick looked at everyone; only the giving up of the others (stage, count, log) waits
        for the next round. A round goes RENEW_CHUNK ids at a time, yielding between them:
        reading 50,000 streams' checkpoints at once would hold every Check for a quarter of
        a second. A round whose store call fails is tried again at the next tick."""
        now = self._clock.now()
        everyone = now - self._last_all >= self.renew_every - self.tick / 2
        followed = self._followed
        if everyone:  # forget what is not worth following any more
            followed.forget_old(now, self.first_lease)
        due = list(followed.renewed if everyone else followed.fresh)
        unheard: list[str] = []
        expired: list[str] = []
        try:
            for i in range(0, len(due), RENEW_CHUNK):
                if i:
                    await asyncio.sleep(0)  # whatever the store: Checks run between chunks
                ids, checkpoints, fresh = self._due(now, due[i:i + RENEW_CHUNK], unheard,
                                                    expired)
                if not ids:
                    continue
                try:
                    gone = await self._limiter.renew(ids, now, checkpoints)
                except Exception as exc:
                    log.warning("lease_renew_failed", active=len(due), error=repr(exc))
                    return
                for rid, a in fresh:
                    followed.renewed_once(rid, a)
                for rid in gone:  # it holds nothing any more (settled elsewhere, or swept)
                    if (held := followed.live.get(rid)) is not None and held.renewed():
                        followed.drop(rid)
        finally:
            self._gave_up(unheard, expired)
        if everyone:
            self._last_all = now
