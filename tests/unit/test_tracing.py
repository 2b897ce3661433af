"""Tracing: off by default, the caller's sampling decision, which trace context wins, and
the spans a Check leaves (the SDK's in-memory exporter; the real OTLP path is in
tests/e2e/test_tracing.py)."""

from __future__ import annotations

import importlib
import secrets as pysecrets
import sys

import pytest
from envoy.service.auth.v3 import external_auth_pb2 as pb
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import gateway
from gateway import tracing
from gateway.authz.check import Check
from gateway.authz.engine import Authorizer
from gateway.clock import FakeClock
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.policy import secrets
from gateway.policy.loader import load
from gateway.policy.model import Policy
from gateway.server.authz_service import AuthorizationService
from testkit.check_requests import check_request

SECRET = secrets.new_secret("alice")
TRACE, PARENT = pysecrets.token_hex(16), pysecrets.token_hex(8)
SAMPLED, UNSAMPLED = f"00-{TRACE}-{PARENT}-01", f"00-{TRACE}-{PARENT}-00"


def test_traces_are_off_unless_an_exporter_is_named() -> None:
    assert tracing.from_env({}) is None
    assert tracing.from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
    with pytest.raises(ValueError, match="zipkin"):
        tracing.from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    t = tracing.from_env({"OTEL_TRACES_EXPORTER": "otlp"})  # the exporter is installed
    assert t is not None
    t.shutdown()


def test_the_otlp_exporter_needs_no_opentelemetry_proto(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # As when xds-protos' OTLP 0.x copy of opentelemetry.proto was installed last: the
    # exporter is our own, on our own messages, and never imports it.
    for name in ("tracing", "tracing_otlp"):  # the re-import below rebinds them
        monkeypatch.setattr(gateway, name, getattr(gateway, name))
    for name in [m for m in sys.modules if m.startswith((
            "opentelemetry.proto", "opentelemetry.exporter", "gateway.tracing"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry.proto", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter", None)
    fresh = importlib.import_module("gateway.tracing")
    t = fresh.from_env({"OTEL_TRACES_EXPORTER": "otlp"})
    assert t is not None
    t.shutdown()


def test_the_grpc_calls_trace_context_wins_over_the_requests() -> None:
    envoys = f"00-{pysecrets.token_hex(16)}-{pysecrets.token_hex(8)}-01"
    assert tracing.trace_context([("traceparent", envoys), ("tracestate", "e=1")],
                                 SAMPLED, "c=1") == (envoys, "e=1")
    assert tracing.trace_context([("x-other", "1")], SAMPLED, "c=1") == (SAMPLED, "c=1")
    assert tracing.trace_context(None, "") == ("", "")


def test_only_the_callers_sampled_traces_are_recorded() -> None:
    t = tracing.from_env({}, exporter=InMemorySpanExporter())
    assert t is not None
    span = t.start("s", SAMPLED)
    assert span is not None
    ctx = span.get_span_context()
    assert f"{ctx.trace_id:032x}" == TRACE
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT
    assert t.start("s", UNSAMPLED) is None
    assert t.start("s", "00-garbage") is None  # a malformed header: no span, no error
    t.shutdown()


def policy() -> Policy:
    return load(f"""
models: {{m: {{}}}}
teams: {{t: {{models: ["*"]}}}}
keys: {{alice: {{team: t, sha256: "{secrets.digest(SECRET).hex()}"}}}}
""", revision=1)


def service(pol: Policy | None) -> tuple[AuthorizationService, tracing.Tracing,
                                          InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    t = tracing.from_env({}, exporter=exporter)
    assert t is not None
    limiter, clock = MemoryLimiter(), FakeClock(1_800_000_000.0)
    authz = Authorizer(lambda: pol, limiter, clock, ledger=Ledger(limiter, clock, 30))
    return AuthorizationService(Check(authz, t)), t, exporter


BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


async def test_an_allowed_check_leaves_a_span_and_forwards_the_trace_to_ext_proc() -> None:
    svc, t, exporter = service(policy())
    out = await svc.Check(check_request(SECRET, BODY, extra_headers={"traceparent": SAMPLED}),
                          None)  # type: ignore[arg-type]
    resp = pb.CheckResponse.FromString(out if isinstance(out, bytes) else out.SerializeToString())
    assert resp.dynamic_metadata.fields["traceparent"].string_value == SAMPLED
    t.provider.force_flush()
    [span] = exporter.get_finished_spans()
    assert span.name == "ext_authz Check"
    assert span.attributes is not None
    assert span.attributes["gateway.decision"] == "allowed"
    assert span.attributes["gateway.key_id"] == "alice"
    assert span.attributes["gateway.model"] == "m"


async def test_denials_are_annotated_and_a_503_is_an_error() -> None:
    svc, t, exporter = service(policy())
    await svc.Check(check_request("sk-unknown", BODY, extra_headers={"traceparent": SAMPLED}),
                    None)  # type: ignore[arg-type]
    svc_down, t_down, exporter_down = service(None)  # no policy yet: 503
    await svc_down.Check(check_request(SECRET, BODY, extra_headers={"traceparent": SAMPLED}),
                         None)  # type: ignore[arg-type]
    t.provider.force_flush()
    t_down.provider.force_flush()
    [denied] = exporter.get_finished_spans()
    assert denied.attributes is not None
    assert denied.attributes["http.response.status_code"] == 401
    assert denied.status.status_code is StatusCode.UNSET
    [down] = exporter_down.get_finished_spans()
    assert down.attributes is not None
    assert down.attributes["http.response.status_code"] == 503
    assert down.status.status_code is StatusCode.ERROR


async def test_an_untraced_check_has_no_span_and_no_trace_metadata() -> None:
    svc, t, exporter = service(policy())
    out = await svc.Check(check_request(SECRET, BODY), None)  # type: ignore[arg-type]
    resp = pb.CheckResponse.FromString(out if isinstance(out, bytes) else out.SerializeToString())
    assert "traceparent" not in resp.dynamic_metadata.fields
    t.provider.force_flush()
    assert exporter.get_finished_spans() == ()
