"""Envoy's per-request records (GATEWAY_METERING=envoy): OTLP logs → usage events.

Envoy's OpenTelemetry access logger sends `LogsService/Export` batches (every 50 ms) over
gRPC and retries a batch the sidecar did not acknowledge. So an Export is answered only
once its events are durable in the spool: a sidecar killed before that loses nothing, Envoy
sends the batch again after the restart. That makes delivery at-least-once; a request id
seen recently is not recorded twice (after a restart, the billing consumer's `event_id`
dedup does the rest, as for every event). `export` is the transport-neutral part; the same
batches can also come over OTLP/HTTP (gateway/server/records_http.py), which Envoy 1.40
never retries (docs/envoy.md §6).

The messages are the project's own (`protos/gateway/otlp/v1/otlp.proto`, OTLP 1.x field
numbers), served at Envoy's wire path by a generic handler: the `opentelemetry.proto`
modules can be xds-protos' OTLP 0.x copy, depending on what pip installed last.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

import grpc

from gateway import metrics
from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
from gateway.limits.ledger import Ledger
from gateway.log import log
from gateway.metering import billing, record
from gateway.metering.recorder import Recorder

# A batch holds 50 ms of requests (~30-50 at c=1, ~60 µs each on a slow core: ~2-3 ms of
# the event loop in one go). While at most SLICE_UP_TO Checks wait on the store (light
# load), the loop is let through after each SLICE_S of it: a Check that arrives meanwhile
# waits for one slice, not for the whole batch (the c=1 p99, docs/benchmarks.md). Under
# load the batch is read whole: the Checks that pile up behind it then share one admission
# call, and slicing it measured more CPU per request at c=32. The gauge is the HTTP door's
# (authz_http.waiting); without it (the gRPC Check) a batch is read whole, as before.
SLICE_S = 0.0002
SLICE_UP_TO = 1
# A batch is answered once its events are durable and its settlements reached the store,
# or after this if the store does not answer (the settlements stay queued, retried).
SETTLE_WAIT_S = 1.0
SEEN_MAX = 200_000  # request ids kept for dedup (~200 B each, ~40 MB full): minutes of traffic
SERVICE = "opentelemetry.proto.collector.logs.v1.LogsService"  # Envoy's wire name


def _text(v: otlp.AnyValue) -> str:
    kind = v.WhichOneof("value")
    return v.string_value if kind == "string_value" else str(getattr(v, kind)) if kind else ""


class RecordsService:
    """`emits`: the records are the requests' events (GATEWAY_METERING=envoy). Otherwise
    (ext_proc, which emits its own) Envoy sends records only for streams that ended early
    (or for an API POST answered with no body, whose stream ends the same way), and each
    only tells the recorder who ended it (the response flags) and the status.

    `settle_wait_s`: how long a batch's answer waits for its settlements (SETTLE_WAIT_S;
    0: not at all, for a bench of the records' CPU without a store)."""

    def __init__(self, recorder: Recorder, ledger: Ledger, emits: bool = True,
                 checks_waiting: Callable[[], int] | None = None,
                 settle_wait_s: float = SETTLE_WAIT_S) -> None:
        self.recorder = recorder
        self.settle_wait_s = settle_wait_s
        self.checks_waiting = checks_waiting
        self.ledger = ledger
        self.emits = emits
        self._seen: OrderedDict[str, int] = OrderedDict()  # request id: its event's seq

    def register(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Export": grpc.unary_unary_rpc_method_handler(
                self.Export,
                request_deserializer=otlp.ExportLogsServiceRequest.FromString,
                response_serializer=otlp.ExportLogsServiceResponse.SerializeToString),
        }),))

    async def Export(self, request: otlp.ExportLogsServiceRequest,
                     context: grpc.aio.ServicerContext) -> otlp.ExportLogsServiceResponse:
        await self.export(request)
        return otlp.ExportLogsServiceResponse()

    async def export(self, request: otlp.ExportLogsServiceRequest) -> None:
        """Record a batch; returns once its events are durable and their settlements
        reached the store (then the batch is answered, and Envoy forgets it)."""
        last_seq = n = 0
        queued = self.ledger.outbox.queued
        clock = time.perf_counter
        until = clock() + SLICE_S
        for rl in request.resource_logs:
            for sl in rl.scope_logs:
                n += len(sl.log_records)
                for lr in sl.log_records:
                    # Envoy renders every attribute as a string: read it directly (a
                    # WhichOneof per attribute cost ~3 µs a record); _text only for another
                    # kind, or an empty one.
                    seq = self._one({kv.key: kv.value.string_value or _text(kv.value)
                                     for kv in lr.attributes})
                    last_seq = max(last_seq, seq)
                    if (clock() >= until and self.checks_waiting is not None
                            and self.checks_waiting() <= SLICE_UP_TO):
                        await asyncio.sleep(0)  # the Check that came meanwhile goes first
                        until = clock() + SLICE_S
        metrics.RECORDS.inc(n)  # once a batch: a Counter's inc takes a lock (~1 µs)
        if last_seq:
            await self.recorder.spool.until_durable(last_seq)  # queues their settlements
        if (self.settle_wait_s and self.ledger.outbox.queued != queued
                and not await self.ledger.outbox.sent(self.settle_wait_s)):
            metrics.RECORDS_ANSWERED_UNSETTLED.inc()

    def _one(self, attrs: dict[str, str]) -> int:
        """Record one request's event; its seq, or 0 if there was nothing new to record."""
        if not self.emits:
            rid = record.request_id(attrs)
            if rid is None:
                return 0
            if not record.unanswered_check(attrs):  # a stream that ended early: who ended it
                self.recorder.told(rid, record.flags_of(attrs), record.status_of(attrs))
                return 0
            # Envoy answered a failed Check itself (bodiless on the API's POST routes: no
            # ext_proc stream), and this record is all there is of that request: its
            # event is made from it, as with the Envoy source
        if record.is_heartbeat(attrs):
            self._heard(attrs)
            return 0
        try:
            rec = record.read(attrs)
        except Exception as exc:  # must not fail the batch (Envoy would retry it forever)
            self._unreadable(attrs, exc)
            return 0
        if rec is None or rec.facts.metered:  # metered: the Check emitted its event
            return 0
        if (seq := self._seen.get(rec.request_id)) is not None:
            # A batch sent again: answered only once the first send's event is on disk
            # (it may still wait in memory, the disk full), or Envoy forgets the record.
            metrics.RECORD_DUPLICATES.inc()
            return seq
        event = self.recorder.emit(rec.facts, billing.settle(rec.facts, rec.response),
                                   rec.started, rec.ended)
        self._seen[rec.request_id] = event.seq
        if len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)
        if not rec.facts.key_id and not rec.facts.denied_status:
            # Envoy answered itself: perhaps the Check never came back (a sidecar killed
            # mid-Check), having committed an admission nobody will use: void it now rather
            # than leave it to the orphan sweep (a no-op when there is none).
            self.ledger.voided(rec.request_id)
        return event.seq

    def _heard(self, attrs: dict[str, str]) -> None:
        """A request still in flight: its admission lives on, checkpointed."""
        rid = record.request_id(attrs)
        if rid is None or rid in self._seen:  # its end came first (a retried batch)
            return
        metrics.RECORD_HEARTBEATS.inc()
        try:
            rec = record.read(attrs)
            checkpoint = None if rec is None else billing.checkpoint(rec.facts, rec.response)
        except Exception:
            checkpoint = None  # its final record (or the sweep) bills it
        self.ledger.heard(rid, checkpoint)

    def _unreadable(self, attrs: dict[str, str], exc: Exception) -> None:
        """A record that names its request but whose facts cannot be read: the request is
        handed to the orphan sweep, which bills it from what its admission stored."""
        metrics.RECORDS_UNREADABLE.inc()
        rid = record.request_id(attrs)
        log.error("record_unreadable", request_id=rid, error=repr(exc))
        if rid is not None and rid not in self._seen:
            self._seen[rid] = 0  # no event here: the sweep's
            self.ledger.orphaned(rid)
