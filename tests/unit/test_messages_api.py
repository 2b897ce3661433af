"""The Anthropic Messages API without servers: its usage read from any chunk split, cut and
failed streams, the Envoy record's reading of the same, and answers in Anthropic's shape."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.authz import answers
from gateway.authz.decision import Deny
from gateway.endpoints import ENDPOINTS, Api, api_of
from gateway.limits.types import RateInfo, Refused
from gateway.metering import billing, record
from gateway.metering.billing import Billed, settle
from gateway.metering.handoff import RequestFacts
from gateway.metering.meter import Meter
from gateway.metering.usage import MessagesStream, from_messages
from gateway.usage_event import Usage

MESSAGES = "/v1/messages"
START_USAGE = {"input_tokens": 5, "cache_creation_input_tokens": 3,
               "cache_read_input_tokens": 2, "output_tokens": 1}


def result(m: Meter) -> Billed:
    """What the meter's facts bill, its response taken as ended (no cancellation rule)."""
    request = RequestFacts(key_id="k", endpoint=m.endpoint, prompt_estimate=m.prompt_estimate)
    return settle(request, m.facts(ended=True))



def event(kind: str, **fields: object) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(
        {"type": kind, **fields}) + b"\n\n"


def stream(tokens: int = 3, delta_usage: dict[str, int] | None = None,
           end: bool = True) -> bytes:
    body = event("message_start", message={
        "id": "msg_1", "type": "message", "role": "assistant", "model": "served-m",
        "content": [], "stop_reason": None, "stop_sequence": None, "usage": START_USAGE})
    body += event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    body += event("ping")
    for i in range(tokens):
        body += event("content_block_delta", index=0,
                      delta={"type": "text_delta", "text": f"t{i}"})
    if end:
        body += event("content_block_stop", index=0)
        body += event("message_delta", delta={"stop_reason": "end_turn"},
                      usage=delta_usage or {"output_tokens": tokens})
        body += event("message_stop")
    return body


def run(body: bytes, cuts: list[int] | None = None) -> tuple[Meter, bytes]:
    m = Meter(MESSAGES, True, prompt_estimate=99)
    m.response_headers(200, "text/event-stream")
    bounds = [0, *sorted(set(cuts or [])), len(body)]
    out = b""
    for a, b in itertools.pairwise(bounds):
        piece = m.chunk(body[a:b], b == len(body))
        out += body[a:b] if piece is None else piece
    return m, out


def test_a_whole_stream_bills_what_the_engine_reported_cache_tokens_included() -> None:
    m, out = run(stream())
    r = result(m)
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (10, 3, 13)
    assert (u.cached_tokens, u.cache_creation_tokens) == (2, 3)
    assert r.source == "reported" and r.served_model == "served-m"
    assert out == stream() and m.saw_end and not m.engine_error


@given(st.lists(st.integers(min_value=1, max_value=len(stream()) - 1), max_size=12))
def test_any_chunk_split_gives_the_same_usage_and_bytes(cuts: list[int]) -> None:
    m, out = run(stream(), cuts)
    assert out == stream()  # nothing is ever injected into, or hidden from, this API
    assert result(m).usage == result(run(stream())[0]).usage
    assert m.content_events == 3 and m.saw_end


def test_message_delta_replaces_only_the_fields_it_carries() -> None:
    """Newer engines repeat the input side in message_delta: it replaces message_start's,
    and the cache counts message_delta leaves out are kept, not zeroed."""
    m, _ = run(stream(delta_usage={"output_tokens": 3, "input_tokens": 6}))
    u = result(m).usage
    assert (u.prompt_tokens, u.cached_tokens, u.cache_creation_tokens) == (11, 2, 3)
    s = MessagesStream()
    s.start({"usage": START_USAGE})
    assert s.usage() is None  # output_tokens 1 is not the engine's last
    assert s.input_side() == Usage(10, 0, 10, cached_tokens=2, cache_creation_tokens=3)
    assert MessagesStream().input_side() is None  # no message_start: nothing exact to say


def test_a_cut_stream_has_the_exact_input_and_an_estimated_output() -> None:
    m, _ = run(stream(tokens=5, end=False))
    r = result(m)
    assert r.source == "estimated" and not m.saw_end
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (10, 5)  # not the estimate 99
    # message_start's cache counts are kept (issue 21: a cut stream billed them 0)
    assert (r.usage.cached_tokens, r.usage.cache_creation_tokens) == (2, 3)
    assert r.served_model == "served-m"


def test_an_error_event_mid_stream_is_an_engine_failure() -> None:
    body = stream(tokens=2, end=False) + event(
        "error", error={"type": "overloaded_error", "message": "Overloaded"})
    m, _ = run(body)
    assert m.engine_error and not m.saw_end
    assert result(m).usage.completion_tokens == 2


def test_a_whole_answer_and_count_tokens() -> None:
    m = Meter(MESSAGES, False)
    m.response_headers(200, "application/json")
    m.chunk(orjson.dumps({"type": "message", "model": "served-m", "usage": {
        "input_tokens": 4, "output_tokens": 7, "cache_read_input_tokens": 1}}), True)
    u = result(m).usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (5, 7, 1)
    assert from_messages(None) is None
    assert not ENDPOINTS["/v1/messages/count_tokens"].billed  # the recorder bills it nothing


def test_the_envoy_record_reads_the_same_usage() -> None:
    authz = {"request_id": "r1", "key_id": "k", "team": "t", "model": "m",
             "endpoint": MESSAGES, "stream": True, "leased": True, "prompt_estimate": 99}

    def rec(usage: dict[str, object], counted: dict[str, object], flags: str = "-"
            ) -> billing.Billed:
        out = record.read({"rid": "r1", "path": MESSAGES, "code": "200", "flags": flags,
                           "start": "1.0", "duration_us": "1000",
                           "authz": orjson.dumps(authz).decode(),
                           "usage": orjson.dumps(usage).decode(),
                           "counted": orjson.dumps(counted).decode()})
        assert out is not None
        return billing.settle(out.facts, out.response)

    whole = rec({"prompt_tokens": 5.0, "completion_tokens": 3.0, "model": "served-m",
                 "cache_read_input_tokens": 2.0, "cache_creation_input_tokens": 3.0},
                {"content_events": 3, "done": True})
    u = whole.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_creation_tokens) \
        == (10, 3, 2, 3)
    assert whole.outcome == "completed" and whole.source == "reported"
    assert whole.served_model == "served-m"
    cut = rec({"prompt_tokens": 5.0, "cache_read_input_tokens": 2.0},
              {"content_events": 4, "content_chars": 12}, flags="DC")
    assert cut.outcome == "client_cancelled" and cut.source == "estimated"
    assert (cut.usage.prompt_tokens, cut.usage.completion_tokens) == (7, 4)
    failed = rec({"prompt_tokens": 5.0}, {"content_events": 2, "failed": True})
    assert failed.outcome == "upstream_error"


# --- answers in Anthropic's shape --------------------------------------------------------


def test_the_answer_family_follows_the_path() -> None:
    assert api_of(MESSAGES) is Api.ANTHROPIC and api_of("/v1/messages/batches") is Api.ANTHROPIC
    assert api_of("/v1/chat/completions") is Api.OPENAI and api_of("/v1/x") is Api.OPENAI


def test_error_bodies_in_anthropics_shape() -> None:
    for status, kind in ((400, "invalid_request_error"), (401, "authentication_error"),
                         (403, "permission_error"), (404, "not_found_error"),
                         (429, "rate_limit_error"), (503, "api_error"),
                         (500, "api_error")):
        deny = Deny(status, "x", "why", "r", api=Api.ANTHROPIC)
        body = orjson.loads(answers.error_body(deny, "req-1"))
        assert body == {"type": "error", "error": {"type": kind, "message": "why"},
                        "request_id": "req-1"}


# Every status the gateway answers on Anthropic routes: the sidecar's denials (authz/check.py,
# request.py) and Envoy's own replies (envoyconf/filters.py: 503 Check failed, 413).
ANSWERED = (400, 401, 403, 404, 409, 413, 415, 429, 503)


def test_each_answered_status_has_anthropics_documented_type() -> None:
    """Before: a 503 (limiter store, spool or sidecar away) was `overloaded_error`, which
    Anthropic documents for 529 only (its whole API short of capacity); a status it does not
    list is `api_error` from 500 up. The mock engine's table is its own copy of the docs."""
    from devspoke.mock_tokens import ANTHROPIC_ERROR_TYPES, anthropic_error
    for status in sorted({*ANSWERED, *ANTHROPIC_ERROR_TYPES}):
        assert answers.anthropic_error_type(status) == \
            anthropic_error(status, "m")["error"]["type"], status
    assert answers.ANTHROPIC_TYPES == ANTHROPIC_ERROR_TYPES
    assert answers.anthropic_error_type(503) == "api_error"


def test_envoys_own_replies_carry_the_type_of_their_status() -> None:
    from gateway.envoyconf import filters
    for status, mappers in ((503, filters.authz_error_replies()),
                            (413, filters.too_large_replies(1 << 23))):
        body = mappers[0].body_format_override.json_format.to_dict()  # the Messages API's
        assert body["error"]["type"] == answers.anthropic_error_type(status), status


def test_a_429_carries_anthropics_rate_limit_headers_for_the_binding_tier() -> None:
    rate = RateInfo(req_limit=10, req_remaining=0, req_reset=0.5,
                    tok_limit=1000, tok_remaining=20, tok_reset=30.0)
    deny = answers.limit_denial(Refused("team", "rps", 10, 0.5, rate=rate))

    h = answers.denial_headers(replace(deny, api=Api.ANTHROPIC))
    assert h["retry-after"] == "1" and h["x-gateway-limit-tier"] == "team"
    assert not any(k.startswith("x-ratelimit-") for k in h)
    assert h["anthropic-ratelimit-requests-limit"] == "10"
    assert h["anthropic-ratelimit-requests-remaining"] == "0"
    for kind in ("tokens", "input-tokens", "output-tokens"):
        assert h[f"anthropic-ratelimit-{kind}-limit"] == "1000"
        assert h[f"anthropic-ratelimit-{kind}-remaining"] == "20"
    reset = datetime.strptime(h["anthropic-ratelimit-tokens-reset"], "%Y-%m-%dT%H:%M:%SZ")
    left = reset.replace(tzinfo=UTC).timestamp() - datetime.now(UTC).timestamp()
    assert 28 < left <= 32  # RFC 3339, about 30 s from now


def test_a_concurrency_429_names_the_limit_in_both_shapes() -> None:
    deny = answers.limit_denial(Refused("key", "concurrency", 1.0, 1.0))
    assert deny.headers["x-ratelimit-limit-requests"] == "1"

    h = answers.denial_headers(replace(deny, api=Api.ANTHROPIC))
    assert h["anthropic-ratelimit-requests-limit"] == "1"
    assert h["anthropic-ratelimit-requests-remaining"] == "0"
