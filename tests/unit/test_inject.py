"""The splice the Check plans so that a stream reports its usage (gateway/metering/inject.py)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.metering.inject import Injected, plan

CHAT = "/v1/chat/completions"


def planned(body: bytes, *, present: bool = False, include: bool = False,
            cont: bool = False, models: tuple[str, ...] = ()) -> bytes | None:
    s = plan(body, CHAT, "m", True, present, include, cont, models)
    return None if s is None else s.apply(body)


def test_no_stream_options_inserts_after_the_brace_byte_exact() -> None:
    body = b' {"model":"m","stream":true,"messages":[{"role":"user","content":"x\\u00e9"}]}'
    out = planned(body)
    assert out == body[:2] + b'"stream_options":{"include_usage":true},' + body[2:]
    assert planned(b"{}") == b'{"stream_options":{"include_usage":true}}'


def test_their_stream_options_are_merged_in_place() -> None:
    body = (b'{"model":"m","messages":[{"role":"user","content":"{\\"stream_options\\":{}}"}],'
            b'"tools":[{"stream_options":{"a":1}}],"stream_options" : {"include_usage":false,'
            b'"x":1},"stream":true}')
    out = planned(body, present=True, models=("m",))
    assert out is not None
    data = orjson.loads(out)
    assert data["stream_options"] == {"include_usage": True, "x": 1,
                                      "continuous_usage_stats": True}
    assert data["tools"] == [{"stream_options": {"a": 1}}]  # a nested key is not theirs
    assert out.startswith(body[:body.index(b'"stream_options" :')])  # the rest untouched


def test_nothing_to_do() -> None:
    assert plan(b"{}", CHAT, "m", False, False, False, False, ()) is None  # not a stream
    assert plan(b"{}", "/v1/embeddings", "m", True, False, False, False, ()) is None
    assert planned(b"{}", present=True, include=True) is None  # they asked already
    assert planned(b"[1]") is None  # not an object
    s = plan(b"{}", CHAT, "m", True, False, True, False, ("m*",))  # only continuous wanted
    assert s is not None and s.injected == Injected(include_usage=False, continuous=True)


@given(st.dictionaries(st.sampled_from(["model", "messages", "stream", "stream_options", "n"]),
                       st.one_of(st.booleans(), st.text(max_size=8), st.none(),
                                 st.dictionaries(st.sampled_from(["include_usage", "x"]),
                                                 st.booleans(), max_size=2)), max_size=5))
def test_a_planned_splice_always_yields_json_with_include_usage(doc: dict[str, object]) -> None:
    body = orjson.dumps(doc)
    present = isinstance(doc.get("stream_options"), dict)
    out = planned(body, present=present)
    if out is None:
        return
    got = orjson.loads(out)
    assert got["stream_options"]["include_usage"] is True
    assert {k: v for k, v in got.items() if k != "stream_options"} == \
        {k: v for k, v in doc.items() if k != "stream_options"}


@pytest.mark.parametrize("body", [b"", b"   ", b"null"])
def test_odd_bodies_are_left_alone(body: bytes) -> None:
    assert planned(body) is None


@given(st.sampled_from([b"", b" ", b"\t\r\n", b" \x0b\x0c "]),
       st.sampled_from([b"", b" ", b"\n  "]), st.booleans())
def test_whitespace_around_the_brace_is_skipped_as_json_allows(
        before: bytes, inside: bytes, empty: bool) -> None:
    """The splice goes right after the first brace, whatever whitespace precedes it or
    follows it, with a comma only when a member follows."""
    rest = b"}" if empty else b'"model":"m"}'
    body = before + b"{" + inside + rest
    out = planned(body)
    assert out == before + b'{"stream_options":{"include_usage":true}' + \
        (b"" if empty else b",") + inside + rest


@pytest.mark.parametrize("body", [
    b'{"model":"m","stream_opt\\u0069ons":{"include_usage":false}}',  # an escaped key
    b'{"model":"m","\\u0073tream_options":null}',
    b'{"stream_options":{"include_usage":false},"model":"m","stream_options":{"x":1}}',
    b'{"stream_options":{"a":[{"stream_options":1}]},"stream_optio\\u006es":"no"}',
])
def test_the_member_replaced_is_the_one_the_engine_reads(body: bytes) -> None:
    """JSON parsers decode escaped keys and keep the last duplicate: the splice must change
    that member, or the client's own `include_usage: false` wins at the engine."""
    out = planned(body, present=True)
    assert out is not None
    assert orjson.loads(out)["stream_options"]["include_usage"] is True
