"""The end of every request: exactly one usage event into the spool, one settlement."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from datetime import datetime

import orjson

from gateway import metrics
from gateway.errors import StoreUnavailable
from gateway.limits.ledger import Ledger
from gateway.limits.types import Orphan
from gateway.log import log
from gateway.metering import handoff
from gateway.metering.billing import Billed, orphaned, settle
from gateway.metering.cost import cost
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts, orphan_facts
from gateway.policy.prices import Rates
from gateway.sinks.spool import Spool
from gateway.token_weights import TokenWeights, limit_tokens
from gateway.usage_event import Usage, UsageEvent, event_json, rfc3339

# How long a stream ext_proc saw end early waits for Envoy's word on why (its access-log
# record, flushed every 50 ms), and how many such words are kept for streams not ended yet,
# and how long: a word whose stream never ends early here (it saw its end after all, an
# empty last chunk; or it had none, Envoy answered itself) is dropped then, not kept until
# TOLD_MAX newer ones push it out.
CUT_WAIT_S = 1.0
TOLD_MAX = 10_000
TOLD_KEEP_S = 30.0
SWEEP_BATCH = 100  # orphans claimed per store call
# While the spool cannot write (a full disk) nothing new is admitted, so the events waiting
# in memory are those of requests admitted before (as many as were in flight) and the
# denials of the requests refused meanwhile (503), which a client's retries can make without
# end. Past this many events held, a denial's event is counted and dropped instead: it bills
# nothing, and the memory it would take puts the held billed events at risk (an OOM kill
# loses them all). ~0.6 KB an event: ~60 MB.
DENIED_HELD_MAX = 100_000


def _no_prices(model: str, at: float) -> Rates | None:
    return None


class Recorder:
    def __init__(self, spool: Spool, spoke: str, ledger: Ledger,
                 price: Callable[[str, float], Rates | None] = _no_prices) -> None:
        self.spool = spool
        self.spoke = spoke
        self.ledger = ledger
        self.price = price  # the held policy's price of a model at an instant
        # ext_proc: streams that ended early, waiting to learn who ended them; and the
        # words that came before their stream's end did.
        self._waiting: dict[str, tuple[Callable[[frozenset[str], int], None],
                                       asyncio.TimerHandle]] = {}
        self._told: OrderedDict[str, tuple[frozenset[str], int, float]] = OrderedDict()
        self._stopping = False  # end_waits was called: a cut stream waits for no word
        self._dropping = False  # denials being dropped, the spool full (logged once a spell)
        spool.gate.listeners.append(self._gate_changed)

    async def run_sweeper(self, interval: float, grace: float = 0.0) -> None:
        """Give every orphaned request (its sidecar died mid-request) its one event, once
        its lease has been out for `grace` more seconds.

        With Envoy-fed metering (a watching ledger) a request outlives its sidecar: after
        an outage of every sidecar longer than a lease and the grace, the leases of streams
        Envoy still serves have run out, and only Envoy's next heartbeat renews them. So the
        first sweep waits as long as the ledger waits for a heartbeat before giving an
        admission up (`unheard_s`): a stream still heard is not claimed (an orphan event,
        then its real one under the same id, the consumer keeping the first).

        A round that comes over half an interval late (the event loop was held: a long GC
        pause, SIGSTOP, a starved CPU) is skipped: the leases this process renews ran out
        meanwhile, and the renewals and the streams' messages waiting since go first (a
        stream claimed here had an orphan event of no tokens, then its real one, kept as
        the duplicate: billed nothing)."""
        first = max(interval, self.ledger.unheard_s) if self.ledger.watches else interval
        await asyncio.sleep(first - interval)
        due = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            late, due = now - due, now + interval
            if late > interval / 2:
                log.info("orphan_sweep_deferred", late_s=round(late, 3),
                         why="the event loop was held: renewals first")
                continue
            try:
                while True:  # a batch at a time, until the backlog (an Envoy crash's) is done
                    batch = await self.ledger.sweep(time.time() - grace, SWEEP_BATCH)
                    for o in batch:
                        self.orphan(o)
                    if len(batch) < SWEEP_BATCH:
                        break
                    await asyncio.sleep(0)  # let the Checks waiting meanwhile through
            except StoreUnavailable:
                continue
            except Exception:
                log.exception("orphan_sweep_crashed")

    def orphan(self, o: Orphan) -> UsageEvent:
        facts = orphan_facts(o.request_id, o.meta)
        metrics.ORPHANS.inc()
        log.warning("orphaned_request", request_id=o.request_id, key_id=facts.key_id,
                    charged=o.charged, checkpoint=o.checkpoint)
        # It started when it was admitted (priced, and counted in a quota's period, at
        # that time, as any request), and ends now: the platform held its slot until this
        # sweep. A record an older sidecar wrote has no admission time: the sweep's time
        # for both. Never after its end (another instance's clock ahead of this one's).
        now = time.time()
        started = now if o.admitted_at is None else min(o.admitted_at, now)
        return self.emit(facts, orphaned(facts, o.checkpoint, o.charged, o.cache), started,
                         now)

    def _settlement(self, facts: RequestFacts, tokens: int) -> Callable[[], None] | None:
        if not facts.leased:
            return None
        return lambda: self.ledger.settled(facts.request_id, tokens)

    def finish(self, facts: RequestFacts, response: ResponseFacts, started: float,
               ended: float | None = None) -> UsageEvent:
        """Emit the request's one event (never awaits: safe in a cancelled stream's finally)."""
        return self.emit(facts, settle(facts, response), started,
                         time.time() if ended is None else ended)

    def answered_without_body(self, md: handoff.Metadata, status: int,
                              started: float) -> UsageEvent | None:
        """The Check answered a HEAD itself (ext_proc source): Envoy's answer has no body, and
        an ext_proc asked only about bodies (response headers SKIP) opens no stream for it.
        Emitted here, once, and `md` marked `metered` so that a stream or record of it (the
        shipped configs send a HEAD's response headers: they open a stream) emits none. A
        duplicate id: none (the live request's stream bills that id)."""
        facts = handoff.read(md)
        if facts.duplicate:
            return None
        handoff.metered(md)
        return self.finish(facts, ResponseFacts(status=status, ended=True), started)

    def finish_cut(self, facts: RequestFacts, response: ResponseFacts, started: float,
                   then: Callable[[UsageEvent], None] | None = None,
                   wait_s: float = CUT_WAIT_S) -> None:
        """A stream that ended before its end (ext_proc source). ext_proc sees an engine
        that cut it and a client that left the same way; Envoy knows (response flags UPE
        vs DC) and says so in an access-log record (`told`). The slot is freed now; the
        event waits for that word, or `wait_s`, then is settled with it: upstream_error or
        client_cancelled. (An Envoy without that log, a managed gateway: client_cancelled.)
        The record's status stands for a stream cut before its first body byte: on the
        API's POST routes ext_proc skips response headers and learns the status only with
        that byte. A word with a status and no flag is an answer with no body (a 204, an
        empty 500: no response message there at all), which Envoy ended normally: the
        response reached its end (completed, or upstream_error for a 5xx)."""
        rid = facts.request_id
        if facts.leased:
            self.ledger.released(rid)  # its next request must find the slot free
        ended = time.time()

        def emit(flags: frozenset[str], status: int) -> None:
            self._waiting.pop(rid, None)
            whole = response.ended or (bool(status) and not flags)  # Envoy's normal end
            event = self.finish(facts, replace(response, flags=flags, ended=whole,
                                               status=response.status or status),
                                started, ended=ended)
            if then is not None:
                then(event)

        word = self._told.pop(rid, None)
        if word is not None:
            emit(word[0], word[1])
            return
        if self._stopping:  # the spool's last commit comes next: no waiting for a word
            emit(frozenset(), 0)
            return
        timer = asyncio.get_running_loop().call_later(wait_s, emit, frozenset(), 0)
        self._waiting[rid] = (emit, timer)

    def end_waits(self) -> None:
        """Emit now every cut stream still waiting for Envoy's word: the sidecar is stopping,
        and an event emitted after its spool's last commit would be lost (left to the orphan
        sweep a lease later, without what had streamed). No word: client_cancelled. A stream
        cut after this (its handler's `finally` ran late) is emitted at once too."""
        self._stopping = True
        for emit, timer in list(self._waiting.values()):
            timer.cancel()
            emit(frozenset(), 0)

    def told(self, request_id: str, flags: frozenset[str], status: int = 0) -> None:
        """Envoy's record of how a stream ended (its flags, and the status it answered), for
        a stream ext_proc saw end early (or one that had no body to see). Used once: a
        word for a stream already settled (it saw its end, or its wait ran out) is kept
        TOLD_KEEP_S unused, never a second event."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is None:  # its stream has not ended here yet: keep the word for it
            now = time.monotonic()
            told = self._told
            told.pop(request_id, None)  # a batch sent again: to the back (oldest first)
            told[request_id] = (flags, status, now)
            while told and (len(told) > TOLD_MAX
                            or next(iter(told.values()))[2] < now - TOLD_KEEP_S):
                told.popitem(last=False)
            return
        emit, timer = waiting
        timer.cancel()
        emit(flags, status)

    def emit(self, facts: RequestFacts, b: Billed, started: float,
             ended: float) -> UsageEvent:
        """The event, into the spool; the leases freed now, the reservation settled once the
        event is durable. Both metering sources end here, with what billing settled."""
        usage, outcome = b.usage, b.outcome
        rates = self.price(facts.model, started) if outcome != "denied" else None
        if facts.leased:
            self.ledger.released(facts.request_id)
        seq = 0 if outcome == "denied" and self._drop_denial() else self.spool.next_seq()
        event = UsageEvent(
            event_id=facts.request_id, spoke=self.spoke, instance_id=self.spool.instance_id,
            seq=seq, started_at=rfc3339(started), ended_at=rfc3339(ended),
            key_id=facts.key_id, team=facts.team, model=facts.model,
            served_model=b.served_model, endpoint=facts.endpoint,
            stream=facts.stream, status_code=b.status,
            outcome=outcome, usage=usage, usage_source=b.source,
            ttft_ms=round(b.ttft_ms, 3), tpot_ms=round(b.tpot_ms, 3),
            duration_ms=round((ended - started) * 1000, 3), cancellation=b.cancellation,
            cost=cost(usage, rates) if rates else 0.0,
            price_effective=rfc3339(rates.effective) if rates else "")
        if not seq:  # dropped (DENIED_HELD_MAX): a seq of 0 is durable at once to a waiter
            return event
        # The token counters settle to what is billed: the same rule as the event (and
        # as `settlements`, which reads it back from a spool), weighted by the model's token
        # weights when the Check handed some over (the event's usage stays raw).
        self.spool.put(seq, event_json(event), on_durable=self._settlement(
            facts, limit_tokens(usage, facts.weights) if outcome != "denied" else 0))
        child = metrics.child  # each label set looked up once, not per event
        child(metrics.EVENTS, outcome).inc()
        if usage.total_tokens:
            child(metrics.TOKENS, facts.model, facts.team, "prompt").inc(usage.prompt_tokens)
            child(metrics.TOKENS, facts.model, facts.team, "completion").inc(
                usage.completion_tokens)
        if b.ttft_ms:
            child(metrics.TTFT, facts.model).observe(b.ttft_ms / 1000)
        if b.tpot_ms:
            child(metrics.TPOT, facts.model).observe(b.tpot_ms / 1000)
        return event

    def _drop_denial(self) -> bool:
        """True when a denial's event is to be dropped: the spool cannot write and holds
        DENIED_HELD_MAX events in memory already (logged once a spell, counted each)."""
        spool = self.spool
        if not spool.gate.closed or spool.in_memory < DENIED_HELD_MAX:
            return False
        metrics.DENIALS_DROPPED.inc()
        if not self._dropping:
            self._dropping = True
            log.error("usage_denials_dropped", reason=spool.gate.reason,
                      events_in_memory=spool.in_memory, held_max=DENIED_HELD_MAX)
        return True

    def _gate_changed(self, closed: bool) -> None:
        if not closed:
            self._dropping = False


def _no_weights(model: str) -> TokenWeights | None:
    return None


def settlements(lines: Iterable[bytes], since: float,
                weights: Callable[[str], TokenWeights | None] = _no_weights
                ) -> Iterator[tuple[str, int]]:
    """The settlements of spooled events that ended at or after `since` (epoch seconds),
    as `Recorder.emit` made them: (request id, the tokens billed, weighted by the event's
    model's token `weights` as the policy held at start-up has them). A denial settles
    nothing (it was not admitted); a line that is not an event is skipped."""
    for line in lines:
        try:
            e = orjson.loads(line)
            if (e["outcome"] != "denied"
                    and datetime.fromisoformat(e["ended_at"]).timestamp() >= since):
                u = e["usage"]
                w = weights(str(e["model"]))
                yield str(e["event_id"]), int(u["total_tokens"]) if w is None else limit_tokens(
                    Usage(int(u["prompt_tokens"]), int(u["completion_tokens"]),
                          int(u["total_tokens"]), int(u["cached_tokens"]), 0,
                          int(u["cache_creation_tokens"])), w)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
