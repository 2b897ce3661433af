"""A real OTLP/gRPC trace receiver for tests and benchmarks: what a collector would be
sent, kept in memory. It reads with the project's own OTLP messages (OTLP 1.x field numbers)
at the collector's wire path, so it works whichever copy of `opentelemetry.proto` pip left."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from devspoke.procs import free_port
from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    error: bool


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(self, request: otlp.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> otlp.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        service=str(res.get("service.name", "")), name=s.name,
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == 2))
        with self._lock:
            self.spans += got
        return otlp.ExportTraceServiceResponse()

    def wait_for(self, count: int, trace_id: str | None = None,
                 timeout: float = 15.0) -> list[Span]:
        """The spans received (of one trace), once there are at least `count`."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = [s for s in self.spans if trace_id is None or s.trace_id == trace_id]
            if len(spans) >= count or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


@contextmanager
def otlp_receiver() -> Iterator[tuple[str, Receiver]]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService", {
            "Export": grpc.unary_unary_rpc_method_handler(
                receiver.Export,
                request_deserializer=otlp.ExportTraceServiceRequest.FromString,
                response_serializer=otlp.ExportTraceServiceResponse.SerializeToString)}),))
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        yield address, receiver
    finally:
        server.stop(0)
