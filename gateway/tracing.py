"""OpenTelemetry traces that join Envoy's: one span per Check, one per ext_proc stream.

Off unless `OTEL_TRACES_EXPORTER` names an exporter: `otlp` (OTLP/gRPC to
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`, default
localhost:4317, by our own exporter, `tracing_otlp`, which no install order can break)
or `console` (JSON on stdout). The standard OTel variables apply (`OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, the exporter's).

A span is made only for a request that carries a W3C `traceparent`, and (unless
`OTEL_TRACES_SAMPLER` picks another sampler) only if that says sampled. It is taken from:

1. the gRPC call's metadata: Envoy's tracer puts its egress span for the call there, so
   our span is that span's child;
2. else the HTTP request's own header, which Envoy passes on when it does not trace (a
   client's trace). ext_proc sees no request headers, so the Check forwards this one to
   it in its dynamic metadata.

The sidecar never starts a trace of its own: the caller decides. With traces off (the
default) the hot path pays one `is None` test; on, an unsampled request pays the lookup
and a parse.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.tracing_otlp import OtlpSpanExporter, Target

__all__ = ["Span", "Status", "StatusCode", "Tracing", "from_env", "trace_context"]

_W3C = TraceContextTextMapPropagator()
SERVICE_NAME = "gateway-sidecar"


def trace_context(call_metadata: Iterable[tuple[str, str | bytes]] | None,
                  traceparent: str = "", tracestate: str = "") -> tuple[str, str]:
    """(traceparent, tracestate): the gRPC call's (Envoy's span) if it has one, else the
    request's own."""
    found: dict[str, str] = {}
    for k, v in call_metadata or ():
        if k in ("traceparent", "tracestate"):
            found[k] = v if isinstance(v, str) else v.decode("latin-1")
    if found.get("traceparent"):
        return found["traceparent"], found.get("tracestate", "")
    return traceparent, tracestate


class Tracing:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("gateway")

    def start(self, name: str, traceparent: str, tracestate: str = "",
              start_ns: int | None = None) -> Span | None:
        """A server span under the caller's `traceparent`, or None if it is not sampled
        (or malformed: a bad header is the caller's problem, never a failed request)."""
        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        parent: Context = _W3C.extract(carrier)
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER,
                                      start_time=start_ns)
        if span.is_recording():
            return span
        return None

    def start_traced(self, name: str, call_metadata: Iterable[tuple[str, str | bytes]] | None,
                     traceparent: str, tracestate: str = "") -> Span | None:
        """A span when the request is traced (the trace context from the gRPC call's
        metadata, or the request's own: trace_context), else None."""
        tp, ts = trace_context(call_metadata, traceparent, tracestate)
        return self.start(name, tp, ts) if tp else None

    def shutdown(self, timeout: float = 2.0) -> None:
        """Export what is buffered, waiting at most `timeout` seconds: a dead collector
        (the exporter retries for up to OTEL_EXPORTER_OTLP_TIMEOUT, 10 s) must not hold
        up the sidecar's exit. The spans still unsent are lost; requests never are."""
        done = threading.Thread(target=self.provider.shutdown, name="otel-shutdown",
                                daemon=True)
        done.start()
        done.join(timeout)


def from_env(environ: Mapping[str, str] = os.environ,
             exporter: SpanExporter | None = None) -> Tracing | None:
    """Tracing as the OTEL_* variables ask, or None when traces are off (the default)."""
    if exporter is None:
        kind = environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
        if kind in ("", "none"):
            return None
        if kind == "otlp":
            exporter = OtlpSpanExporter(Target.from_env(environ))
        elif kind == "console":
            exporter = ConsoleSpanExporter()
        else:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER={kind!r} is not supported (otlp, console or none)")
    # Sampler None: the SDK reads OTEL_TRACES_SAMPLER. Else follow the caller's decision.
    sampler = None if "OTEL_TRACES_SAMPLER" in environ else sampling.ParentBased(
        sampling.ALWAYS_OFF)
    resource = Resource.create(
        {} if "OTEL_SERVICE_NAME" in environ else {"service.name": SERVICE_NAME})
    # shutdown_on_exit=False: the app shuts it down, bounded; the SDK's atexit hook is not.
    provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider)
