"""OpenTelemetry traces through real Envoy: the sidecar's spans join the request's trace.

A real OTLP/gRPC receiver stands in for the collector; Envoy's OpenTelemetry tracer and
the sidecar's OTLP exporter both send to it.
"""

from __future__ import annotations

import secrets as pysecrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devspoke.procs import free_port
from devspoke.stack import Spoke
from gateway.settings import METERING_SOURCES
from testkit.otlp_receiver import Receiver, Span, otlp_receiver
from testkit.spoke import client, start_spoke

MSG = [{"role": "user", "content": "trace me"}]
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # ms between the sidecar's exports


def _stream(spoke: Spoke, key: str, headers: dict[str, str] | None = None) -> str:
    """A streamed chat of 5 tokens; its request id."""
    raw = client(spoke, key).chat.completions.with_raw_response.create(
        model="mock-model", messages=MSG, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers or {})
    list(raw.parse())
    return str(raw.headers["x-request-id"])


def _ours(spans: list[Span], rid: str) -> dict[str, Span]:
    return {s.name: s for s in spans
            if s.service == "gateway-sidecar" and s.attributes.get("gateway.request_id") == rid}


@pytest.fixture
def traced_spoke(tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str], Receiver]]:
    with otlp_receiver() as (address, receiver):
        # The ext_proc source: its stream has a span of its own. With the Envoy source the
        # sidecar's span is the Check's; the stream is in Envoy's own spans.
        spoke, keys = start_spoke(tmp_path / "spoke", kafka=False, otlp=address,
                                  sidecar_env=dict(FAST_EXPORT), metering="ext_proc")
        try:
            yield spoke, keys, receiver
        finally:
            spoke.stop()


def test_sidecar_spans_are_children_of_envoys(
        traced_spoke: tuple[Spoke, dict[str, str], Receiver]) -> None:
    spoke, keys, receiver = traced_spoke
    rid = _stream(spoke, keys["good"])
    deadline = time.monotonic() + 15
    while len(ours := _ours(receiver.wait_for(1), rid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    check, stream = ours["ext_authz Check"], ours["ext_proc stream"]
    assert check.trace_id == stream.trace_id
    envoy = {s.span_id: s for s in receiver.wait_for(5, check.trace_id)
             if s.service == "envoy"}  # Envoy exports every 5 s
    # ingress -> Envoy's egress span for each gRPC call -> ours
    assert envoy[check.parent_id].name.endswith("Authorization.Check egress")
    assert envoy[stream.parent_id].name.endswith("ExternalProcessor.Process egress")
    ingress = {envoy[check.parent_id].parent_id, envoy[stream.parent_id].parent_id}
    assert len(ingress) == 1 and envoy[ingress.pop()].name == "ingress"
    assert check.attributes["gateway.decision"] == "allowed"
    assert check.attributes["gateway.key_id"] == "good"
    assert stream.attributes["gateway.outcome"] == "completed"
    assert stream.attributes["gateway.usage.completion_tokens"] == 5
    assert not check.error and not stream.error


@pytest.mark.parametrize("metering", METERING_SOURCES)
def test_a_clients_trace_is_joined_when_envoy_does_not_trace(tmp_path: Path, metering: str
                                                             ) -> None:
    with otlp_receiver() as (address, receiver):
        env = {**FAST_EXPORT, "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{address}"}
        spoke, keys = start_spoke(tmp_path / "spoke", kafka=False, sidecar_env=env,
                                  metering=metering)
        try:
            trace_id, parent = pysecrets.token_hex(16), pysecrets.token_hex(8)
            rid = _stream(spoke, keys["good"], {"traceparent": f"00-{trace_id}-{parent}-01"})
            # The Envoy source has no stream in the sidecar: its span is the Check's.
            spans = {"ext_authz Check"} | ({"ext_proc stream"} if metering == "ext_proc" else set())
            ours = {s.name: s for s in receiver.wait_for(len(spans), trace_id)}
            assert set(ours) == spans
            assert all(s.parent_id == parent for s in ours.values())
            assert ours["ext_authz Check"].attributes["gateway.request_id"] == rid
            # Not sampled by the caller: nothing recorded, nothing exported.
            unsampled = pysecrets.token_hex(16)
            _stream(spoke, keys["good"], {"traceparent": f"00-{unsampled}-{parent}-00"})
            _stream(spoke, keys["good"])  # no trace context at all
            time.sleep(1.0)  # ten export intervals
            assert receiver.wait_for(0, unsampled) == []
            assert {s.trace_id for s in receiver.spans} == {trace_id}
        finally:
            spoke.stop()


def test_a_dead_collector_costs_requests_nothing_and_does_not_hold_up_exit(
        tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: every export is refused
    # The exporter left alone retries a batch for ~31 s (backoff 1+2+4+8+16 s, in 60 s):
    # an exit that waited for it stands far above the 15 s bound below, which leaves a
    # loaded machine's slow but clean exit room (it was < 5 s against the 10 s default).
    spoke, keys = start_spoke(tmp_path / "spoke", kafka=False, otlp=dead, sidecar_env={
        **FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "60"})
    try:
        for _ in range(10):
            trace_id, parent = pysecrets.token_hex(16), pysecrets.token_hex(8)
            _stream(spoke, keys["good"], {"traceparent": f"00-{trace_id}-{parent}-01"})
        time.sleep(1.0)  # the exporter is retrying by now
        sidecar = spoke.services["sidecar"]
        t0 = time.monotonic()
        sidecar.stop(timeout=60)
        took = time.monotonic() - t0
        assert took < 15.0, f"{took:.1f}s"  # the exporter alone: ~31 s
        log = sidecar.log_path.read_text()
        assert "trace_export_retrying" in log or "trace_export_failed" in log  # it did try
        assert sum(1 for _ in (tmp_path / "spoke" / "usage.jsonl").open()) == 10  # billed
    finally:
        spoke.stop()


def test_a_key_in_the_query_string_never_reaches_the_collector(
        traced_spoke: tuple[Spoke, dict[str, str], Receiver]) -> None:
    """Envoy's http.url tag is the whole URL by default: a client's ?api_key=... (the real
    key) went to the collector in Envoy's ingress span."""
    spoke, keys, receiver = traced_spoke
    trace_id, parent = pysecrets.token_hex(16), pysecrets.token_hex(8)
    client(spoke, keys["good"]).chat.completions.create(
        model="mock-model", messages=MSG, max_tokens=2,
        extra_query={"api_key": keys["good"], "key": "sk-wrong-9911"},
        extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    deadline = time.monotonic() + 15  # Envoy exports every 5 s
    while not (ingress := [s for s in receiver.wait_for(1, trace_id) if s.name == "ingress"]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    spans = receiver.wait_for(1, trace_id)
    assert ingress[0].attributes["http.url"] == "/v1/chat/completions"
    values = [str(v) for s in spans for v in s.attributes.values()]
    assert not [v for v in values if keys["good"] in v or "sk-wrong-9911" in v]
