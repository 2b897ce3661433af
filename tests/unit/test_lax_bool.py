"""`stream` (and the stream_options flags) read as vLLM and SGLang read them: pydantic v2's
lax `bool` (gateway/authz/request.py: lax_bool). Held to pydantic's own TypeAdapter(bool),
so a divergence either way fails here, not in a bill."""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from gateway.authz.request import lax_bool, parse_body
from gateway.metering.inject import plan

PYDANTIC = TypeAdapter(bool)
WORDS = ("1", "on", "t", "true", "y", "yes", "0", "off", "f", "false", "n", "no")


def pydantic_reads(v: Any) -> bool | None:
    """What an engine that validates `stream: bool` in lax mode makes of v (None: a 400)."""
    try:
        return PYDANTIC.validate_python(v)
    except ValidationError:
        return None


def every_case(word: str) -> list[str]:
    # in a fixed order (a set's varies by process): xdist's workers must collect alike
    cases = (dict.fromkeys((c.lower(), c.upper())) for c in word)
    return ["".join(cs) for cs in itertools.product(*cases)]


CORPUS: list[Any] = [
    True, False, None, [], {}, [True], {"a": 1}, [1], ["true"],
    0, 1, -1, 2, 10, 2**63, 2**64 + 1, 10**30,
    0.0, -0.0, 1.0, 0.5, 1.5, 2.0, -1.0, 1e-300, 1.0000000000000002, 0.9999999999999999,
    float("nan"), float("inf"), float("-inf"),
    *(c for w in WORDS for c in every_case(w)),
    "", " ", "true ", " true", "\ttrue", "true\n", "tru", "truee", "yess", "nope", "maybe",
    "1.0", "0.0", "01", "10", "+1", "-0", "1e0", "0x1", "null", "none", "True\x00", "\x00",
    "\uff12", "\uff11", "\uff10", "\uff54\uff52\uff55\uff45", "\uff34\uff32\uff35\uff25",
    "\uff59\uff45\uff53", "tr\u00fce", "\u0130", "\u212a",
    "\u017f", "y\u0307", "o\u0274", "\u1d1b", "\u0442rue", "ye\u0455", "TRUE\u0130",
    "true\u200b", "\ufefftrue", "yes!", "on\u00a0", "\uff39", "\uff4e",
]


@pytest.mark.parametrize("v", CORPUS, ids=repr)
def test_lax_bool_is_pydantics_bool(v: Any) -> None:
    assert lax_bool(v) == pydantic_reads(v)
    assert type(lax_bool(v)) is type(pydantic_reads(v))


@pytest.mark.parametrize("text", [
    "true", "false", "null", "0", "1", "2", "-0", "1.0", "0.0", "-0.0", "1e0", "1E0", "10e-1",
    "0e5", "100e-2", "1.00000000000000000001", "0.1e1", '"true"', '"TRUE"', '"1"', '" 1"',
    '"\\u0074rue"', '"\\u0131"', '"ye\\u0073"', "[]", "{}", "[true]", "18446744073709551616",
])
def test_read_from_json_as_the_engine_reads_the_body(text: str) -> None:
    """The engine parses the body (json.loads, under FastAPI) and validates the value; the
    gateway parses it with orjson. Both roads land on the same answer."""
    engine = pydantic_reads(json.loads(text))
    try:
        ours = lax_bool(orjson.loads(text))
    except orjson.JSONDecodeError:  # orjson refuses what it cannot hold (a 65-bit int)
        ours = None
    assert ours == engine


@given(st.one_of(
    st.text(alphabet=st.sampled_from("tTrRuUeEfFaAlLsSyYoOnN01 \t\u0130\u212a\u017f"),
            max_size=6),
    st.text(max_size=6),
    st.integers(min_value=-3, max_value=3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none()))
def test_lax_bool_agrees_with_pydantic_anywhere(v: Any) -> None:
    assert lax_bool(v) == pydantic_reads(v)


def body(**fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": [], **fields})


@pytest.mark.parametrize("value", [True, 1, 1.0, "true", "True", "1", "yes", "on", "t", "Y"])
def test_a_lax_true_stream_is_a_stream(value: Any) -> None:
    assert parse_body(body(stream=value)).stream is True


@pytest.mark.parametrize("value", [False, 0, 0.0, "false", "0", "no", "off", "f", "N", None,
                                   "maybe", "", " true", 2, [], {}, [True]])
def test_anything_else_is_not(value: Any) -> None:
    """A false one; and one the engine refuses: the body goes on as it is, not a stream,
    and the engine's 400 is the answer (nothing streams, nothing is injected)."""
    assert parse_body(body(stream=value)).stream is False


def test_the_stream_options_flags_are_read_the_same_way() -> None:
    f = parse_body(body(stream="true", stream_options={"include_usage": "yes",
                                                       "continuous_usage_stats": 1}))
    assert (f.stream, f.include_usage, f.continuous_usage) == (True, True, True)
    f = parse_body(body(stream=1, stream_options={"include_usage": "0",
                                                  "continuous_usage_stats": "maybe"}))
    assert (f.stream, f.include_usage, f.continuous_usage) == (True, False, False)


def test_a_lax_stream_is_injected_and_its_stream_value_left_as_the_client_wrote_it() -> None:
    raw = b'{"model":"m","stream":"TRUE","messages":[],"x_unknown":{"stream":1}}'
    f = parse_body(raw)
    s = plan(raw, "/v1/chat/completions", "m", f.stream, f.stream_options, f.include_usage,
             f.continuous_usage, ())
    assert s is not None and s.injected.include_usage
    out = s.apply(raw)
    assert out == b'{"stream_options":{"include_usage":true},' + raw[1:]
