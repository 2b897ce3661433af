"""A real OTLP/gRPC trace receiver for tests and benchmarks: what a collector would be
sent, kept in memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc

from gateway.dev.procs import free_port


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


class Receiver(ts_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(self, request: ts.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> ts.ExportTraceServiceResponse:
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
        return ts.ExportTraceServiceResponse()

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
    ts_grpc.add_TraceServiceServicer_to_server(receiver, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        yield address, receiver
    finally:
        server.stop(0)
