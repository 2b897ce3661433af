"""The sidecar's own OTLP span exporter: where it sends (the standard variables) and what
(SDK spans as OTLP 1.x messages, read back from the bytes). Through a real receiver and
real Envoy: tests/integration/test_tracing_export.py, tests/e2e/test_traces_through_envoy.py."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)

from gateway._proto.gateway.otlp.v1 import otlp_pb2 as otlp
from gateway.tracing_otlp import Target, encode


def test_target_defaults_to_a_plaintext_local_collector() -> None:
    assert Target.from_env({}) == Target(address="localhost:4317", insecure=True)


@pytest.mark.parametrize(("env", "address", "insecure"), [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "c:4317", True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4317"}, "c:4317", False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317"}, "c:4317", False),  # as the OTel SDK
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
     "c:4317", True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1",
      "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://b:2"}, "b:2", False),
])
def test_target_endpoint(env: dict[str, str], address: str, insecure: bool) -> None:
    t = Target.from_env(env)
    assert (t.address, t.insecure) == (address, insecure)


def test_target_headers_timeout_and_compression() -> None:
    t = Target.from_env({"OTEL_EXPORTER_OTLP_HEADERS": "Api-Key=a%20b, x=1,junk",
                         "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2.5",
                         "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"})
    assert t.headers == (("api-key", "a b"), ("x", "1"))
    assert (t.timeout_s, t.gzip) == (2.5, True)
    with pytest.raises(ValueError, match="gzip or none"):
        Target.from_env({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"})


def test_spans_encode_as_otlp_with_ids_kind_times_attributes_events_and_status() -> None:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("gateway", "1.2")
    remote = SpanContext(trace_id=0x0102, span_id=0x0304, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED))
    parent = set_span_in_context(NonRecordingSpan(remote))
    with tracer.start_as_current_span("check", context=parent, kind=SpanKind.SERVER) as s:
        s.set_attributes({"s": "x", "i": 7, "f": 0.5, "b": True, "l": ["a", "b"]})
        s.add_event("ev", {"n": 1})
        s.set_status(Status(StatusCode.ERROR, "boom"))
    tracer.start_span("plain").end()
    [sdk_span, _] = memory.get_finished_spans()

    wire = otlp.ExportTraceServiceRequest.FromString(
        encode(memory.get_finished_spans()).SerializeToString())
    [rs] = wire.resource_spans
    assert {kv.key: kv.value.string_value for kv in rs.resource.attributes}["service.name"] == \
        "svc"
    [ss] = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("gateway", "1.2")
    span, plain = ss.spans
    assert span.trace_id == (0x0102).to_bytes(16, "big")
    assert span.parent_span_id == (0x0304).to_bytes(8, "big")
    assert span.span_id == sdk_span.context.span_id.to_bytes(8, "big")
    assert span.name == "check" and span.kind == otlp.Span.SPAN_KIND_SERVER
    assert (span.start_time_unix_nano, span.end_time_unix_nano) == (
        sdk_span.start_time, sdk_span.end_time)
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert (attrs["s"].string_value, attrs["i"].int_value, attrs["f"].double_value,
            attrs["b"].bool_value) == ("x", 7, 0.5, True)
    assert [v.string_value for v in attrs["l"].array_value.values] == ["a", "b"]
    [ev] = span.events
    assert (ev.name, ev.attributes[0].key, ev.attributes[0].value.int_value) == ("ev", "n", 1)
    assert (span.status.code, span.status.message) == (otlp.Status.STATUS_CODE_ERROR, "boom")
    assert span.flags == 0x301  # sampled, has is_remote, parent is remote
    assert plain.parent_span_id == b"" and plain.kind == otlp.Span.SPAN_KIND_INTERNAL
    assert plain.flags & 0x200 == 0
