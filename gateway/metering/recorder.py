"""The end of every request: exactly one usage event into the spool, one settlement."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from gateway import metrics
from gateway.endpoints import billed
from gateway.envoy_contract import UPSTREAM_FLAGS
from gateway.errors import StoreUnavailable
from gateway.limits.leases import Leases
from gateway.limits.types import Orphan
from gateway.log import log
from gateway.metering.cancel import NOT_CANCELLED, bill
from gateway.metering.cost import Rates, cost
from gateway.metering.events import UsageEvent, event_json, rfc3339
from gateway.metering.handoff import RequestFacts, orphan_facts
from gateway.metering.meter import Meter, Result
from gateway.metering.usage import Usage
from gateway.sinks.spool import Spool

# How long a stream ext_proc saw end early waits for Envoy's word on why (its access-log
# record, flushed every 50 ms), and how many such words are kept for streams not ended yet.
CUT_WAIT_S = 1.0
TOLD_MAX = 10_000
SWEEP_BATCH = 100  # orphans claimed per store call


def _no_prices(model: str, at: float) -> Rates | None:
    return None


class Recorder:
    def __init__(self, spool: Spool, spoke: str, leases: Leases,
                 price: Callable[[str, float], Rates | None] = _no_prices) -> None:
        self.spool = spool
        self.spoke = spoke
        self.leases = leases
        self.price = price  # the held policy's price of a model at an instant
        # ext_proc: streams that ended early, waiting to learn who ended them; and the
        # words that came before their stream's end did.
        self._waiting: dict[str, tuple[Callable[[str], None], asyncio.TimerHandle]] = {}
        self._told: OrderedDict[str, frozenset[str]] = OrderedDict()

    async def run_sweeper(self, interval: float, grace: float = 0.0) -> None:
        """Give every orphaned request (its sidecar died mid-request) its one event, once
        its lease has been out for `grace` more seconds."""
        while True:
            await asyncio.sleep(interval)
            try:
                while True:  # a batch at a time, until the backlog (an Envoy crash's) is done
                    batch = await self.leases.limiter.sweep(time.time() - grace, SWEEP_BATCH)
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
        meter = Meter(endpoint=facts.endpoint, stream=facts.stream)
        if o.checkpoint is not None:  # what its stream had used at its last lease renewal
            prompt, completion = o.checkpoint
            meter.reported = Usage(prompt, completion, prompt + completion)
        else:
            meter.reported = Usage(prompt_tokens=o.charged, total_tokens=o.charged)
        metrics.ORPHANS.inc()
        log.warning("orphaned_request", request_id=o.request_id, key_id=facts.key_id,
                    charged=o.charged, checkpoint=o.checkpoint)
        return self.finish(facts, meter, "upstream_error", time.time(),
                           source="checkpoint" if o.checkpoint is not None else "estimated")

    def _settlement(self, facts: RequestFacts, tokens: int) -> Callable[[], None] | None:
        if not facts.leased:
            return None
        return lambda: self.leases.settle(facts.request_id, tokens)

    def finish(self, facts: RequestFacts, meter: Meter, outcome: str, started: float,
               source: str | None = None, ended: float | None = None) -> UsageEvent:
        """Emit the request's one event (never awaits: safe in a cancelled stream's finally)."""
        r = meter.result()
        if not facts.endpoint:
            facts.endpoint = meter.endpoint
        return self.emit(facts, r, meter.status or facts.denied_status, outcome, started,
                         time.time() if ended is None else ended, source or r.source)

    def finish_cut(self, facts: RequestFacts, meter: Meter, started: float,
                   then: Callable[[UsageEvent], None] | None = None,
                   wait_s: float = CUT_WAIT_S) -> None:
        """A stream that ended before its end (ext_proc source). ext_proc sees an engine
        that cut it and a client that left the same way; Envoy knows (response flags UPE
        vs DC) and says so in an access-log record (`told`). The slot is freed now; the
        event waits for that word, or `wait_s`, then says upstream_error or
        client_cancelled. (An Envoy without that log, a managed gateway: client_cancelled.)"""
        rid = facts.request_id
        if facts.leased:
            self.leases.release(rid)  # its next request must find the slot free
        ended = time.time()

        def emit(outcome: str) -> None:
            self._waiting.pop(rid, None)
            event = self.finish(facts, meter, outcome, started, ended=ended)
            if then is not None:
                then(event)

        flags = self._told.pop(rid, None)
        if flags is not None:
            emit(_cut_outcome(flags))
            return
        timer = asyncio.get_running_loop().call_later(wait_s, emit, "client_cancelled")
        self._waiting[rid] = (emit, timer)

    def told(self, request_id: str, flags: frozenset[str]) -> None:
        """Envoy's record of how a stream ended, for a stream ext_proc saw end early."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is None:  # its stream has not ended here yet: keep the word for it
            self._told[request_id] = flags
            if len(self._told) > TOLD_MAX:
                self._told.popitem(last=False)
            return
        emit, timer = waiting
        timer.cancel()
        emit(_cut_outcome(flags))

    def emit(self, facts: RequestFacts, r: Result, status: int, outcome: str, started: float,
             ended: float, source: str) -> UsageEvent:
        """The event, into the spool; the leases freed now, the reservation settled once the
        event is durable. Both metering sources end here."""
        if not billed(facts.endpoint):  # e.g. count_tokens: admitted as a request, no tokens
            r, source = Result(Usage(), "reported", r.served_model, r.ttft_ms, 0.0), "reported"
        usage, cancellation = r.usage, NOT_CANCELLED
        if outcome == "client_cancelled":  # billed by the team's rule, as admitted
            usage, cancellation = bill(r.usage, r.delivered, facts.cancelled)
        rates = self.price(facts.model, started) if outcome != "denied" else None
        if outcome == "denied":
            source = ""  # nothing was metered: there is no usage to have a source
        if facts.leased:
            self.leases.release(facts.request_id)
        seq = self.spool.next_seq()
        event = UsageEvent(
            event_id=facts.request_id, spoke=self.spoke, instance_id=self.spool.instance_id,
            seq=seq, started_at=rfc3339(started), ended_at=rfc3339(ended),
            key_id=facts.key_id, team=facts.team, model=facts.model,
            served_model=r.served_model, endpoint=facts.endpoint,
            stream=facts.stream, status_code=status,
            outcome=outcome, usage=usage, usage_source=source,
            ttft_ms=round(r.ttft_ms, 3), tpot_ms=round(r.tpot_ms, 3),
            duration_ms=round((ended - started) * 1000, 3), cancellation=cancellation,
            cost=cost(usage, rates) if rates else 0.0,
            price_effective=rfc3339(rates.effective) if rates else "")
        # The token counters settle to what is billed: the same rule as the event.
        self.spool.put(seq, event_json(event), on_durable=self._settlement(
            facts, usage.total_tokens if outcome != "denied" else 0))
        metrics.EVENTS.labels(outcome).inc()
        if usage.total_tokens:
            metrics.TOKENS.labels(facts.model, facts.team, "prompt").inc(usage.prompt_tokens)
            metrics.TOKENS.labels(facts.model, facts.team, "completion").inc(
                usage.completion_tokens)
        if r.ttft_ms:
            metrics.TTFT.labels(facts.model).observe(r.ttft_ms / 1000)
        if r.tpot_ms:
            metrics.TPOT.labels(facts.model).observe(r.tpot_ms / 1000)
        return event


def _cut_outcome(flags: frozenset[str]) -> str:
    return "upstream_error" if flags & UPSTREAM_FLAGS else "client_cancelled"
