"""The sidecar's OTLP/gRPC span exporter, on the project's own OTLP messages.

Why not opentelemetry-exporter-otlp-proto-grpc: it imports `opentelemetry.proto`, and
xds-protos installs an OTLP 0.x copy at those very paths; with a plain `pip install`
(xds-protos last) that exporter does not even import. These messages
(`protos/gateway/otlp/v1/otlp.proto`) carry OTLP 1.x's field numbers, so any collector
reads them. The standard variables apply, the traces-specific one first:
`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` [http://localhost:4317], `..._INSECURE`,
`..._HEADERS`, `..._TIMEOUT` [10 s], `..._COMPRESSION` (gzip), `..._CERTIFICATE`.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
from gateway.log import log

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"  # the wire path
RETRYABLE = frozenset({
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
ATTEMPTS = 6  # as the OTel SDK's exporter: 1, 2, 4, 8, 16 s apart, within the timeout
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # OTLP 1.x SpanFlags


@dataclass(frozen=True)
class Target:
    """Where and how to send: read from the OTEL_EXPORTER_OTLP_* variables."""
    address: str
    insecure: bool
    headers: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 10.0
    gzip: bool = False
    certificate: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Target:
        def get(name: str, default: str = "") -> str:
            return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}",
                               environ.get(f"OTEL_EXPORTER_OTLP_{name}", default))

        endpoint = get("ENDPOINT", "http://localhost:4317")
        url = urlparse(endpoint if "://" in endpoint else f"//{endpoint}")
        insecure_env = get("INSECURE")
        insecure = (url.scheme != "https" and (
            insecure_env.lower() == "true" if insecure_env else url.scheme == "http"))
        compression = get("COMPRESSION").strip().lower()
        if compression not in ("", "none", "gzip"):
            raise ValueError(f"OTEL_EXPORTER_OTLP_COMPRESSION={compression!r}: gzip or none")
        return cls(address=url.netloc or endpoint, insecure=insecure,
                   headers=_headers(get("HEADERS")), timeout_s=float(get("TIMEOUT", "10")),
                   gzip=compression == "gzip", certificate=get("CERTIFICATE"))


def _headers(text: str) -> tuple[tuple[str, str], ...]:
    """`k1=v1,k2=v2` (values URL-encoded), as the OTel spec writes them."""
    pairs = (item.split("=", 1) for item in text.split(",") if "=" in item)
    return tuple((unquote(k).strip().lower(), unquote(v).strip()) for k, v in pairs)


def _value(v: Any) -> otlp.AnyValue:
    if isinstance(v, bool):  # before int: a bool is an int
        return otlp.AnyValue(bool_value=v)
    if isinstance(v, int):
        return otlp.AnyValue(int_value=v)
    if isinstance(v, float):
        return otlp.AnyValue(double_value=v)
    if isinstance(v, bytes):
        return otlp.AnyValue(bytes_value=v)
    if isinstance(v, Sequence) and not isinstance(v, str):
        return otlp.AnyValue(array_value=otlp.ArrayValue(values=[_value(x) for x in v]))
    return otlp.AnyValue(string_value=str(v))


def _attributes(attrs: Mapping[str, Any] | None) -> list[otlp.KeyValue]:
    return [otlp.KeyValue(key=k, value=_value(v)) for k, v in (attrs or {}).items()]


def _span(s: ReadableSpan) -> otlp.Span:
    ctx, parent = s.get_span_context(), s.parent
    assert ctx is not None
    return otlp.Span(
        trace_id=ctx.trace_id.to_bytes(16, "big"), span_id=ctx.span_id.to_bytes(8, "big"),
        trace_state=ctx.trace_state.to_header() if ctx.trace_state else "",
        parent_span_id=parent.span_id.to_bytes(8, "big") if parent else b"",
        name=s.name,
        kind=s.kind.value + 1,  # type: ignore[arg-type]  # the SDK's INTERNAL is 0, OTLP's 1
        start_time_unix_nano=s.start_time or 0, end_time_unix_nano=s.end_time or 0,
        attributes=_attributes(s.attributes),
        events=[otlp.Span.Event(time_unix_nano=e.timestamp, name=e.name,
                                attributes=_attributes(e.attributes)) for e in s.events],
        status=otlp.Status(code=s.status.status_code.value,  # type: ignore[arg-type]
                           message=s.status.description or ""),
        flags=int(ctx.trace_flags) | _HAS_IS_REMOTE
        | (_IS_REMOTE if parent and parent.is_remote else 0))


def encode(spans: Sequence[ReadableSpan]) -> otlp.ExportTraceServiceRequest:
    """One request: spans grouped by resource, then by instrumentation scope."""
    groups: dict[int, tuple[otlp.ResourceSpans, dict[tuple[str, str], otlp.ScopeSpans]]] = {}
    for s in spans:
        key = id(s.resource)
        if key not in groups:
            groups[key] = (otlp.ResourceSpans(resource=otlp.Resource(
                attributes=_attributes(s.resource.attributes))), {})
        rs, scopes = groups[key]
        scope = s.instrumentation_scope
        name, version = (scope.name, scope.version or "") if scope else ("", "")
        if (name, version) not in scopes:
            scopes[(name, version)] = rs.scope_spans.add(
                scope=otlp.InstrumentationScope(name=name, version=version))
        scopes[(name, version)].spans.append(_span(s))
    return otlp.ExportTraceServiceRequest(resource_spans=[rs for rs, _ in groups.values()])


class OtlpSpanExporter(SpanExporter):
    """Sends each batch (from the SDK's BatchSpanProcessor thread), retrying transient
    errors with backoff until the timeout; a batch still refused is dropped and logged:
    traces never hold up requests."""

    def __init__(self, target: Target | None = None) -> None:
        self.target = target or Target.from_env()
        t = self.target
        compression = grpc.Compression.Gzip if t.gzip else grpc.Compression.NoCompression
        if t.insecure:
            self._channel = grpc.insecure_channel(t.address, compression=compression)
        else:
            root = Path(t.certificate).read_bytes() if t.certificate else None
            self._channel = grpc.secure_channel(
                t.address, grpc.ssl_channel_credentials(root), compression=compression)
        self._export = self._channel.unary_unary(
            EXPORT, request_serializer=otlp.ExportTraceServiceRequest.SerializeToString,
            response_deserializer=otlp.ExportTraceServiceResponse.FromString)
        self._stopping = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._stopping.is_set():
            return SpanExportResult.FAILURE
        request = encode(spans)
        deadline = time.monotonic() + self.target.timeout_s
        for attempt in range(ATTEMPTS):
            try:
                self._export(request, metadata=self.target.headers,
                             timeout=max(deadline - time.monotonic(), 0.01))
                return SpanExportResult.SUCCESS
            except grpc.RpcError as exc:
                code = exc.code()
                backoff = 2 ** attempt * random.uniform(0.8, 1.2)
                if (attempt == ATTEMPTS - 1 or code not in RETRYABLE
                        or backoff > deadline - time.monotonic()):
                    break
                log.warning("trace_export_retrying", collector=self.target.address,
                            code=str(code), after_s=round(backoff, 2))
                if self._stopping.wait(backoff):
                    break
        log.warning("trace_export_failed", collector=self.target.address, spans=len(spans))
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._stopping.set()
        self._channel.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
