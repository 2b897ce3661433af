"""ext_proc Process: one gRPC stream per HTTP request, turned into exactly one usage event.

Modes (envoy/envoy-ext-proc.yaml): request body BUFFERED (one message, where
`stream_options` is injected), response headers SEND (every answer opens a stream, one with
no body too: end_of_stream on its headers ends it; the status is `:status`, SSE is told by
`content-type`) but SKIP on the API's POST routes (the request's body opens the stream; the
status rides as an attribute on the first body message, SSE is recognised by its first
bytes), response body FULL_DUPLEX_STREAMED: every chunk is echoed, so no per-message
timeout can ever reset a client's stream because the sidecar was slow (STREAMED resets it
after `message_timeout`; observability mode loses streams).

Envoy forwards ext_authz's decision as metadata on every message; only that is trusted.
The end of a request is certain only from end_of_stream; a client disconnect or upstream
reset just ends the gRPC stream, so the event is emitted in `finally`, without awaiting
(docs/envoy.md §4.7).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from gateway import metrics, tracing
from gateway.envoy_contract import AUTHZ_NAMESPACE, EXTPROC_ATTRIBUTES
from gateway.limits.ledger import Ledger
from gateway.metering import handoff
from gateway.metering.exchange import Exchange
from gateway.metering.handoff import RequestFacts
from gateway.metering.recorder import Recorder
from gateway.usage_event import UsageEvent

HVO = base_pb2.HeaderValueOption

_CONTINUE = {
    "request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
    "request_body": ep.ProcessingResponse(request_body=ep.BodyResponse()),
    "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
    "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}


_COUNT = {kind: metrics.EXTPROC_MESSAGES.labels(kind) for kind in _CONTINUE.keys() | {
    "response_body"}}


def _echo(body: bytes, end: bool) -> ep.ProcessingResponse:
    mutation = ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
        body=body, end_of_stream=end))
    return ep.ProcessingResponse(response_body=ep.BodyResponse(
        response=ep.CommonResponse(body_mutation=mutation)))


def _plain(md: struct_pb2.Struct | None) -> dict[str, object]:
    """A Struct's scalar fields as Python values (the handoff reads plain values)."""
    if md is None:
        return {}
    out: dict[str, object] = {}
    for k, v in md.fields.items():
        kind = v.WhichOneof("kind")
        if kind in ("string_value", "bool_value", "number_value"):
            out[k] = getattr(v, kind)
    return out


def _text(values: dict[str, object], key: str) -> str:
    v = values.get(key)
    return v if isinstance(v, str) else ""


class RequestStream(Exchange):
    """One ext_proc stream: each message read into a phase of the Exchange, each answer
    wrapped back into a message."""

    def handle(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        if self.facts is None:
            self._learn(msg)
        kind = msg.WhichOneof("request")
        _COUNT[kind].inc()
        if kind == "response_body":
            b = msg.response_body
            status = None if self.sniffed else _status(msg)
            return _echo(self.response_body(b.body, b.end_of_stream, status), b.end_of_stream)
        if kind == "request_body":
            return self._request_body(msg.request_body.body)
        if kind == "response_headers":
            self._response_headers(msg.response_headers)
        elif kind == "response_trailers":
            self.response_trailers()
        return _CONTINUE[kind]

    def _learn(self, msg: ep.ProcessingRequest) -> None:
        attrs = _plain(msg.attributes.get(EXTPROC_ATTRIBUTES))
        self.learn(handoff.read(
            _plain(msg.metadata_context.filter_metadata.get(AUTHZ_NAMESPACE)),
            _text(attrs, "request.path"), _text(attrs, "request.id")))

    def _request_body(self, body: bytes) -> ep.ProcessingResponse:
        new = self.request_body(body)
        if new is None:
            return _CONTINUE["request_body"]
        length = HVO(header=base_pb2.HeaderValue(key="content-length",
                                                 raw_value=str(len(new)).encode()),
                     append_action=HVO.OVERWRITE_IF_EXISTS_OR_ADD)
        common = ep.CommonResponse(body_mutation=ep.BodyMutation(body=new),
                                   header_mutation=ep.HeaderMutation(set_headers=[length]))
        return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))

    def _response_headers(self, h: ep.HttpHeaders) -> None:
        status, ctype = 0, ""
        for hv in h.headers.headers:
            if hv.key == ":status":
                status = int(hv.raw_value or hv.value or 0)
            elif hv.key == "content-type":
                ctype = (hv.raw_value or hv.value.encode()).decode("latin-1")
        self.response_headers(status, ctype, h.end_of_stream)


def _status(msg: ep.ProcessingRequest) -> int | None:
    """The response status Envoy sends as an attribute with the first response message."""
    attrs = msg.attributes.get(EXTPROC_ATTRIBUTES)
    if attrs is not None and "response.code" in attrs.fields:
        return int(attrs.fields["response.code"].number_value)
    return None


def _annotate(span: tracing.Span, e: UsageEvent) -> None:
    u = e.usage
    span.set_attributes({
        "gateway.request_id": e.event_id, "gateway.key_id": e.key_id, "gateway.team": e.team,
        "gateway.model": e.model, "gateway.outcome": e.outcome,
        "http.response.status_code": e.status_code, "gateway.usage.prompt_tokens": u.prompt_tokens,
        "gateway.usage.completion_tokens": u.completion_tokens,
        "gateway.usage_source": e.usage_source, "gateway.ttft_ms": e.ttft_ms})
    if e.outcome == "upstream_error":
        span.set_status(tracing.Status(tracing.StatusCode.ERROR, f"status {e.status_code}"))


class ExternalProcessorService(ep_grpc.ExternalProcessorServicer):
    def __init__(self, recorder: Recorder, ledger: Ledger,
                 tracer: tracing.Tracing | None = None) -> None:
        self.recorder = recorder
        self.ledger = ledger
        self.tracing = tracer
        self.open = 0  # streams whose handler has not finished (its `finally` included)

    async def drained(self, within: float) -> None:
        """Wait, up to `within`, for every stream's handler to finish. A stopping server
        cancels its streams, and each emits its event in its handler's `finally`, which
        may run after the server's stop returns: before the spool's last commit, that
        event is kept; after it, it would be lost (left to the orphan sweep a lease later,
        without what had streamed)."""
        deadline = time.monotonic() + within
        while self.open and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = RequestStream()
        metrics.STREAMS_ACTIVE.inc()
        self.open += 1
        finished = False
        span: tracing.Span | None = None

        def annotate(event: UsageEvent) -> None:
            if span is not None:
                _annotate(span, event)
                span.end()

        def finish(facts: RequestFacts) -> None:
            # its id is a live request's, whose stream bills it; or the Check emitted its
            # event (a HEAD it refused: its response headers open this stream)
            if facts.duplicate or facts.metered:
                if span is not None:
                    span.end()
                return
            # A stream that ended early: its client left, or the engine cut it (Envoy says)
            if stream.outcome() == "client_cancelled":
                self.recorder.finish_cut(facts, stream.response(), stream.started, annotate)
            else:
                annotate(self.recorder.finish(facts, stream.response(), stream.started))

        try:
            async for msg in request_iterator:
                first = stream.facts is None
                response = stream.handle(msg)
                if first and stream.facts:
                    if stream.facts.leased:  # renewed, with the usage seen so far
                        self.ledger.begun(stream.facts.request_id, stream.meter.checkpoint)
                    if self.tracing is not None:
                        tp, ts = tracing.trace_context(
                            context.invocation_metadata(), stream.facts.traceparent)
                        if tp:
                            span = self.tracing.start("ext_proc stream", tp, ts,
                                                      start_ns=int(stream.started * 1e9))
                if stream.ended and not finished and stream.facts is not None:
                    # Settle as soon as the end is seen, before the client has the last
                    # chunk: its next request must find the slot free.
                    finished = True
                    finish(stream.facts)
                yield response
        finally:
            metrics.STREAMS_ACTIVE.dec()
            try:
                if not finished and stream.facts is not None:
                    finish(stream.facts)
            finally:
                self.open -= 1
