"""The meter on recorded bodies: usage per endpoint, hidden injections, end markers."""

from __future__ import annotations

import itertools

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.metering.billing import Billed, settle
from gateway.metering.handoff import RequestFacts
from gateway.metering.meter import Injected, Meter

CHUNK = (b'data: {"id":"c","object":"chat.completion.chunk","model":"m",'
         b'"choices":[{"index":0,"delta":{"content":"%s"}}]%s}\n\n')
USAGE = (b'"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,'
         b'"prompt_tokens_details":{"cached_tokens":2},'
         b'"completion_tokens_details":{"reasoning_tokens":1}}')
FINAL = b'data: {"id":"c","object":"chat.completion.chunk","model":"m-served","choices":[],'


def result(m: Meter) -> Billed:
    """What the meter's facts bill, its response taken as ended (no cancellation rule)."""
    request = RequestFacts(key_id="k", endpoint=m.endpoint, prompt_estimate=m.prompt_estimate)
    return settle(request, m.facts(ended=True))



def chat_stream(continuous: bool = False, final_usage: bool = True) -> bytes:
    body = b""
    for i, tok in enumerate((b"a", b" b", b" c")):
        extra = b"," + USAGE.replace(b'"completion_tokens":3', b'"completion_tokens":%d' % (
            i + 1)) if continuous else b""
        body += CHUNK % (tok, extra)
    if final_usage:
        body += FINAL + USAGE + b"}\n\n"
    return body + b"data: [DONE]\n\n"


def run(body: bytes, injected: Injected | None = None, cuts: list[int] | None = None,
        endpoint: str = "/v1/chat/completions") -> tuple[Meter, bytes]:
    m = Meter(endpoint, True, injected or Injected())
    m.response_headers(200, "text/event-stream")
    bounds = [0, *sorted(set(cuts or [])), len(body)]
    out = b""
    for a, b in itertools.pairwise(bounds):
        piece = m.chunk(body[a:b], b == len(body))
        out += body[a:b] if piece is None else piece
    return m, out


def test_reported_usage_with_details() -> None:
    m, out = run(chat_stream())
    r = result(m)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (7, 3, 10)
    assert (r.usage.cached_tokens, r.usage.reasoning_tokens) == (2, 1)
    assert r.source == "reported" and r.served_model == "m-served"
    assert out == chat_stream() and m.saw_end


@given(st.lists(st.integers(min_value=1, max_value=len(chat_stream()) - 1), max_size=12))
def test_any_split_gives_the_same_usage_and_bytes(cuts: list[int]) -> None:
    m, out = run(chat_stream(), Injected(include_usage=True), cuts)
    assert result(m).usage.total_tokens == 10
    assert out == chat_stream(final_usage=False)  # the injected usage chunk is gone


def test_continuous_usage_is_hidden_and_exact_at_a_cut() -> None:
    body = chat_stream(continuous=True, final_usage=False)
    cut = body.index(b"data:", body.index(b" b"))  # the stream dies after two tokens
    m, out = run(body[:cut], Injected(continuous=True))
    assert b"usage" not in out
    assert result(m).usage.completion_tokens == 2 and result(m).source == "reported"
    assert not m.saw_end


def test_estimated_when_the_engine_never_reports() -> None:
    body = chat_stream(final_usage=False)
    m, _ = run(body[: body.index(b"[DONE]") - 6])
    r = result(m)
    assert r.source == "estimated" and r.usage.completion_tokens == 3


def test_responses_api_stream() -> None:
    events = [
        (b"response.created", {"type": "response.created", "response": {"model": "m"}}),
        (b"response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"}),
        (b"response.completed", {"type": "response.completed", "response": {
            "model": "m2", "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6,
                                     "input_tokens_details": {"cached_tokens": 1}}}}),
    ]
    body = b"".join(b"event: " + k + b"\ndata: " + orjson.dumps(v) + b"\n\n" for k, v in events)
    m, out = run(body, endpoint="/v1/responses")
    r = result(m)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.cached_tokens) == (5, 1, 1)
    assert r.served_model == "m2" and m.saw_end and out == body


def test_non_stream_json_and_embeddings() -> None:
    m = Meter("/v1/embeddings", False)
    m.response_headers(200, "application/json")
    body = b'{"object":"list","model":"e","data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}'
    assert m.chunk(body[:10], False) is None and m.chunk(body[10:], True) is None
    assert m.saw_end and result(m).usage.total_tokens == 4


def _usage_only(completion: int, prompt: int = 14) -> bytes:
    return (b'data: {"id":"c","model":"m","choices":[],"usage":{"completion_tokens":%d,'
            b'"prompt_tokens":%d,"total_tokens":%d,"prompt_tokens_details":'
            b'{"cached_tokens":13}}}\n\n' % (completion, prompt, prompt + completion))


def test_one_usage_chunk_per_choice_is_billed_their_sum() -> None:
    """llama.cpp's server, `n: 2` with include_usage: each choice ends with its own
    usage-only chunk; the client got both choices' tokens, so both are billed."""
    body = (CHUNK % (b"a", b"") + CHUNK.replace(b'"index":0', b'"index":1') % (b"b", b"")
            + _usage_only(8) + _usage_only(8) + b"data: [DONE]\n\n")
    m, out = run(body, Injected(include_usage=True))
    u = result(m).usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens) == (
        28, 16, 44, 26)
    assert b"usage" not in out  # both injected usage chunks are hidden


def test_completions_usage_on_each_choices_finish_chunk_is_summed() -> None:
    """llama.cpp's completions stream with a prompt list: each prompt's finish chunk
    carries that prompt's usage, and no usage-only chunk follows."""
    finish = (b'data: {"choices":[{"text":"","index":%d,"finish_reason":"length"}],'
              b'"usage":{"completion_tokens":2,"prompt_tokens":%d,"total_tokens":%d}}\n\n')
    body = finish % (1, 4, 6) + finish % (0, 2, 4) + b"data: [DONE]\n\n"
    m, _ = run(body, endpoint="/v1/completions")
    u = result(m).usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (6, 4, 10)


def test_continuous_usage_per_choice_then_one_total_chunk() -> None:
    """vLLM, `n: 2` with continuous usage: each choice's running count on its chunks, then
    one usage-only chunk for all: that total is what is billed, not added to the rest."""
    running = (b'data: {"choices":[{"index":%d,"delta":{"content":"x"}}],"usage":'
               b'{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":%d}}\n\n')
    body = running % (0, 1, 6) + running % (1, 1, 6) + running % (0, 2, 7)
    cut, _ = run(body, Injected(continuous=True))
    assert result(cut).usage.completion_tokens == 3  # a cut: each choice's latest, summed
    whole, _ = run(body + _usage_only(4, prompt=5) + b"data: [DONE]\n\n",
                   Injected(continuous=True))
    u = result(whole).usage
    assert (u.prompt_tokens, u.completion_tokens) == (5, 4)


def test_usage_without_choices_stands_as_it_is() -> None:
    """An event with usage but no `choices` member replaces, never adds (as the Lua filter:
    only chat and completions chunks split their usage by choice)."""
    bare = (b'data: {"usage":{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":%d}}'
            b'\n\n')
    m, _ = run(bare % (2, 7) + bare % (3, 8))
    assert result(m).usage.completion_tokens == 3


FINISH = (b'data: {"id":"c","choices":[{"finish_reason":"length","index":0,"delta":{}}],'
          b'"model":"m","object":"chat.completion.chunk"}\n\n')
MOVED_USAGE = (b'data: {"id":"c","choices":[],"model":"m","usage":{"completion_tokens":3,'
               b'"prompt_tokens":4,"total_tokens":7},"system_fingerprint":"fp-1",'
               b'"timings":{"cache_n":0,"predicted_n":3}}\n\n')
WITH_MOVED = (b'data: {"id":"c","choices":[{"finish_reason":"length","index":0,"delta":{}}],'
              b'"model":"m","object":"chat.completion.chunk","system_fingerprint":"fp-1",'
              b'"timings":{"cache_n":0,"predicted_n":3}}\n\n')


@given(st.lists(st.integers(min_value=1, max_value=len(FINISH + MOVED_USAGE) + 13),
                max_size=4))
def test_what_the_engine_moved_onto_the_hidden_usage_chunk_goes_back(cuts: list[int]) -> None:
    """Asked for usage, llama.cpp moves `timings` and vLLM `system_fingerprint` from the
    finish chunk onto the usage chunk; hiding it, the gateway puts them back (any split)."""
    body = FINISH + MOVED_USAGE + b"data: [DONE]\n\n"
    m, out = run(body, Injected(include_usage=True), cuts)
    assert out == WITH_MOVED + b"data: [DONE]\n\n"
    assert result(m).usage.completion_tokens == 3
    _, asked = run(body, cuts=cuts)  # the client asked itself: nothing moves
    assert asked == body


def test_a_held_finish_chunk_goes_out_as_it_was_without_a_usage_chunk() -> None:
    other = b'data: {"id":"c","choices":[{"index":1,"delta":{"content":"x"}}]}\n\n'
    body = FINISH + other + FINISH
    m = Meter("/v1/chat/completions", True, Injected(include_usage=True))
    m.response_headers(200, "text/event-stream")
    first = m.chunk(FINISH + other, False)
    assert first == FINISH + other and m.chunk(FINISH, False) == b""  # held
    assert m.chunk(b"", True) == FINISH and body == first + FINISH


def test_a_whole_answer_too_large_to_read_bills_its_size() -> None:
    """Past MAX_JSON_BODY its usage is not read: a generating endpoint's completion is then
    estimated from its size (never free); an embeddings answer generates none."""
    from gateway.metering.meter import MAX_JSON_BODY
    part = b"x" * (1 << 20)
    parts = MAX_JSON_BODY // len(part) + 2
    for endpoint, status, want in [("/v1/chat/completions", 200, parts * len(part)),
                                   ("/v1/embeddings", 200, 0),
                                   ("/v1/chat/completions", 500, 0)]:
        m = Meter(endpoint, False)
        m.response_headers(status, "application/json")
        for i in range(parts):
            m.chunk(part, i == parts - 1)
        assert m.facts(ended=True).content_chars == want, endpoint
