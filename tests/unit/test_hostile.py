"""Hostile input never crashes the sidecar: property tests over every parser on the path.

`HYPOTHESIS_PROFILE=fuzz` (make fuzz) runs each with many more examples.
"""

from __future__ import annotations

import contextlib
import os
import time

import orjson
import pytest
from envoy.service.auth.v3.external_auth_pb2 import CheckResponse
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.authz.check import answer
from gateway.authz.decision import Allow, Deny, Reply
from gateway.authz.engine import Authorizer
from gateway.authz.request import AuthzRequest, api_key, parse_body
from gateway.clock import FakeClock
from gateway.errors import BodyError, PolicyError
from gateway.limits.ledger import Ledger
from gateway.limits.memory import MemoryLimiter
from gateway.metering.billing import Billed, settle
from gateway.metering.handoff import RequestFacts
from gateway.metering.meter import Injected, Meter
from gateway.metering.sse import SseDecoder
from gateway.policy import loader, secrets
from gateway.server import check_grpc, check_http
from gateway.server.authz_service import to_request
from gateway.server.extproc_service import RequestStream

settings.register_profile("fuzz", max_examples=20000, deadline=None,
                          suppress_health_check=list(HealthCheck))
settings.register_profile("default", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

SECRET = secrets.new_secret("k1")
POLICY = loader.load(f"""
models: {{m: {{limits: {{rps: 1000000}}}}}}
teams: {{t: {{models: ["*"], limits: {{concurrency: 1000000}}}}}}
keys: {{k1: {{team: t, sha256: {secrets.digest(SECRET).hex()},
             limits: {{tokens_per_minute: 1000000000}}}}}}
""", 1)
STATUSES = {200, 400, 401, 403, 404, 429, 503}
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
header_text = st.text(st.characters(codec="utf-8"), max_size=80)
bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda d: orjson.dumps(d), st.dictionaries(
        st.sampled_from(["model", "stream", "max_tokens", "messages", "stream_options", "x"]),
        st.one_of(st.none(), st.booleans(), ints, st.text(max_size=10),
                  st.just("m"), st.lists(ints, max_size=3),
                  st.dictionaries(st.text(max_size=5), st.booleans(), max_size=2)))),
)


def result(m: Meter) -> Billed:
    """What the meter's facts bill, its response taken as ended (no cancellation rule)."""
    request = RequestFacts(key_id="k", endpoint=m.endpoint, prompt_estimate=m.prompt_estimate)
    return settle(request, m.facts(ended=True))



def authorizer() -> Authorizer:
    limiter, clock = MemoryLimiter(), FakeClock()
    return Authorizer(lambda: POLICY, limiter, clock, ledger=Ledger(limiter, clock, 30))


@given(headers=st.dictionaries(header_text, header_text, max_size=6), body=bodies,
       path=st.one_of(st.sampled_from(["/v1/chat/completions", "/v1/models", "/",
                                       "/v1/responses", "/v1/models/m", "/v1/chat/%63ompletions"]),
                      st.text(max_size=40)),
       method=st.sampled_from(["POST", "GET", "PUT"]), with_key=st.booleans())
async def test_any_request_gets_a_decision_never_an_exception(
        headers: dict[str, str], body: bytes, path: str, method: str, with_key: bool) -> None:
    if with_key:
        headers["authorization"] = f"Bearer {SECRET}"
    req = AuthzRequest("rid", method, path, headers, body)
    decision = await authorizer().check(req)
    assert isinstance(decision, Allow | Deny | Reply)
    if isinstance(decision, Deny):
        assert decision.status in STATUSES
    # the answer builds, and parses, for any decision; and goes through the HTTP door
    resp = check_grpc.encode(answer(decision, req))
    assert check_http.encode(answer(decision, req)).startswith(b"HTTP/1.1 ")
    if isinstance(resp, bytes):
        resp = CheckResponse.FromString(resp)
    assert resp.status.code == (0 if isinstance(decision, Allow) else 7)


@given(st.binary(max_size=2000))
def test_body_parser_raises_only_body_error(body: bytes) -> None:
    with contextlib.suppress(BodyError):
        parse_body(body)


def test_nesting_bombs_and_invalid_utf8_are_400() -> None:
    for body in (b"[" * 200_000, b'{"a":' * 100_000, b'{"model": "\xff\xfe"}',
                 b'{"model": "m", "x": "\xed\xa0\x80"}', b"\x00" * 1000):
        try:
            parse_body(body)
            raise AssertionError(f"accepted {body[:20]!r}")
        except BodyError:
            pass


@given(st.text(max_size=300))
def test_api_key_parser_never_returns_whitespace_or_commas(value: str) -> None:
    key = api_key({"authorization": value})
    assert key is None or (key.strip() == key and " " not in key and "," not in key
                           and key.isprintable())


@given(st.dictionaries(st.text(max_size=20), st.text(max_size=20), max_size=10))
def test_check_request_conversion_accepts_any_header_map(headers: dict[str, str]) -> None:
    from testkit.check_requests import check_request
    check = check_request("k", extra_headers=headers)
    req = to_request(check)
    assert req.method == "POST"


chunks = st.lists(st.binary(max_size=200), max_size=30)


@given(chunks, st.booleans())
def test_sse_decoder_and_meter_survive_any_bytes(parts: list[bytes], inject: bool) -> None:
    meter = Meter("/v1/chat/completions", True, Injected(include_usage=inject))
    meter.response_headers(200, "text/event-stream")
    for i, p in enumerate(parts):
        out = meter.chunk(p, i == len(parts) - 1)
        assert out is None or isinstance(out, bytes)
    r = result(meter)
    assert r.usage.total_tokens >= 0


def test_a_hundred_thousand_events_in_one_chunk() -> None:
    event = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    meter = Meter("/v1/chat/completions", True)
    meter.response_headers(200, "text/event-stream")
    t0 = time.process_time()
    meter.chunk(event * 100_000 + b"data: [DONE]\n\n", True)
    assert result(meter).usage.completion_tokens == 100_000
    assert time.process_time() - t0 < 10  # linear, not quadratic (a loose bound, not a bench)


def test_an_endless_event_is_passed_on_not_buffered() -> None:
    d = SseDecoder(max_event=1 << 16)
    passed = b""
    for _ in range(100):
        for ev in d.feed(b"data: " + b"x" * 4096):
            assert not ev.whole  # passed on unread, as the Lua filter does
            passed += ev.raw
    assert d.oversized == 1 and len(d.pending) <= 1 << 16
    assert passed == (b"data: " + b"x" * 4096) * 100  # every byte on its way, none held


@given(st.recursive(st.one_of(st.none(), st.booleans(), ints, st.floats(),
                              st.text(max_size=8)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.text(max_size=8), inner,
                                                            max_size=4)), max_leaves=30))
def test_policy_loader_raises_only_policy_error(data: object) -> None:
    for text in (orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS) if not isinstance(
            data, float) else b"1.5", repr(data).encode()):
        with contextlib.suppress(PolicyError):
            loader.load(text, 1)


kinds = st.sampled_from(["request_body", "response_headers", "response_body",
                         "response_trailers", "request_headers"])


@given(st.lists(st.tuples(kinds, st.binary(max_size=100), st.booleans()), max_size=8),
       st.booleans())
def test_ext_proc_stream_handles_messages_in_any_order(
        msgs: list[tuple[str, bytes, bool]], with_metadata: bool) -> None:
    stream = RequestStream()
    for i, (kind, body, eos) in enumerate(msgs):
        req = ep.ProcessingRequest()
        if kind in ("request_body", "response_body"):
            getattr(req, kind).body = body
            getattr(req, kind).end_of_stream = eos
        elif kind == "response_trailers":
            req.response_trailers.SetInParent()
        else:
            getattr(req, kind).end_of_stream = eos
        if i == 0 and with_metadata:
            md = struct_pb2.Struct()
            md.update({"request_id": "r", "stream": True, "leased": True, "key_id": "k",
                       "endpoint": "/v1/chat/completions", "model": "m", "hide_usage": True,
                       "splice": "\"stream_options\":{\"include_usage\":true},",
                       "splice_at": 1, "splice_cut": 0})
            req.metadata_context.filter_metadata["envoy.filters.http.ext_authz"].CopyFrom(md)
        assert stream.handle(req) is not None
    assert stream.outcome() in ("completed", "client_cancelled", "upstream_error", "denied")


@pytest.mark.parametrize("body, cap", [
    (b'{"model":"m","max_tokens":0}', 0),
    (b'{"model":"m","max_completion_tokens":0,"max_tokens":9}', 0),
    (b'{"model":"m","max_completion_tokens":"x","max_tokens":9}', 9),
    (b'{"model":"m","max_output_tokens":7}', 7),
    (b'{"model":"m"}', None),
])
def test_the_first_cap_the_body_gives_counts_zero_included(body: bytes, cap: int | None) -> None:
    """max_tokens 0 is a cap, not a missing one: a Messages body with it is not told
    'max_tokens: Field required' (the engine answers what it thinks of 0)."""
    assert parse_body(body).max_tokens == cap
    if cap is not None:
        assert parse_body(body, requires_max_tokens=True).max_tokens == cap
