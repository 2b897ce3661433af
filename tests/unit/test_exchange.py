"""One request's ext_proc phases, without gRPC (gateway/metering/exchange.py): the splice,
how the response is recognised, and the outcome its event gets."""

from __future__ import annotations

import pytest

from gateway.metering.exchange import Exchange
from gateway.metering.handoff import RequestFacts
from gateway.metering.inject import Injected, Splice

SPLICE = Splice(1, 0, b'"stream_options":{"include_usage":true},', Injected(True, False))


def exchange(**facts: object) -> Exchange:
    x = Exchange()
    x.learn(RequestFacts(**{"request_id": "r", "key_id": "k", "model": "m",  # type: ignore[arg-type]
                            "endpoint": "/v1/chat/completions", "stream": True, **facts}))
    return x


def test_the_planned_splice_is_applied_and_remembered() -> None:
    x = exchange(splice=SPLICE)
    spliced = b'{"stream_options":{"include_usage":true},"model":"m"}'
    assert x.request_body(b'{"model":"m"}') == spliced
    assert x.meter.injected == SPLICE.injected


def test_no_splice_or_a_body_shorter_than_planned_passes_unchanged() -> None:
    assert exchange().request_body(b'{"model":"m"}') is None
    x = exchange(splice=Splice(40, 3, b"x", Injected(True, False)))
    assert x.request_body(b'{"model":"m"}') is None and x.meter.injected == Injected()


def test_a_stream_is_recognised_by_its_first_bytes_and_hides_what_was_injected() -> None:
    x = exchange(splice=SPLICE)
    x.request_body(b'{"model":"m"}')
    assert x.response_body(b"", False, 200) == b"" and not x.sniffed  # says nothing yet
    x.response_body(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', False)
    assert x.sniffed and x.meter.sse and x.meter.status == 200
    out = x.response_body(b'data: {"choices":[],"usage":{"prompt_tokens":3,'
                          b'"completion_tokens":1,"total_tokens":4}}\n\ndata: [DONE]\n\n', True)
    assert b"usage" not in out  # the usage-only chunk we asked for is not the client's
    assert x.meter.reported is not None and x.meter.reported.total_tokens == 4
    assert x.outcome() == "completed"


def test_a_first_chunk_too_short_to_tell_waits_for_the_next() -> None:
    """Envoy splits an upstream read anywhere: "dat" is neither JSON nor yet SSE."""
    x = exchange()
    body = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
            b"data: [DONE]\n\n")
    out = [x.response_body(body[:3], False, 200), x.response_body(body[3:4], False)]
    assert out == [b"", b""] and not x.sniffed
    out.append(x.response_body(body[4:], True))
    assert b"".join(out) == body  # the held bytes reach the client, in order
    assert x.meter.sse and x.meter.status == 200 and x.meter.content_events == 1
    assert x.meter.reported is not None and x.meter.reported.total_tokens == 4
    assert x.outcome() == "completed"


@pytest.mark.parametrize(("facts", "status", "ended", "outcome"), [
    ({"denied_status": 429}, 0, True, "denied"),
    ({"key_id": ""}, 413, True, "denied"),  # Envoy answered itself: nobody was admitted
    ({}, 503, True, "upstream_error"),
    ({}, 200, True, "completed"),
    ({}, 200, False, "client_cancelled"),
])
def test_outcome(facts: dict[str, object], status: int, ended: bool, outcome: str) -> None:
    x = exchange(**facts)
    x.response_headers(status, "text/event-stream", ended)
    assert x.outcome() == outcome


def test_a_stream_with_no_facts_is_denied() -> None:
    assert Exchange().outcome() == "denied"


def test_trailers_end_the_response() -> None:
    x = exchange()
    x.response_body(b'data: {"choices":[]}\n\n', False, 200)
    assert x.outcome() == "client_cancelled"
    x.response_trailers()
    assert x.outcome() == "completed"
