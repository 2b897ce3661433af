"""`max_tokens`, `n`, `best_of` read as vLLM and SGLang read them: pydantic v2's lax `int`
(gateway/authz/request.py: lax_int), held to pydantic's own TypeAdapter(int). Read strictly,
`"max_tokens": 5000.0` reserved the default completion and Messages answered it 400, while
the engine generates up to 5,000 tokens."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from gateway.authz.request import lax_int, parse_body
from gateway.endpoints import ENDPOINTS

PYDANTIC = TypeAdapter(int)


def pydantic_reads(v: Any) -> int | None:
    try:
        return PYDANTIC.validate_python(v)
    except ValidationError:
        return None


CORPUS = [0, 3, -4, 10.0, 10.5, -0.0, 1e300, float("inf"), float("nan"), True, False, None,
          [], {}, "10", " 10 ", "\t7\n", "10.0", "10.00", "10.", ".5", "1e3", "+5", "-3",
          "-0", "0x10", "1_000", "1__0", "_1", "1_", "", " ", "١٢", "\u00a010", "10\u2003",
          "0010", "12345678901234567890", "1.5", "\x1c5", "5\x85", "0__0", "0__1", "0_",
          "00_7", "-0_0.0"]


@pytest.mark.parametrize("v", CORPUS, ids=repr)
def test_lax_int_is_pydantics_int(v: Any) -> None:
    assert lax_int(v) == pydantic_reads(v)


@given(st.one_of(st.integers(), st.floats(), st.booleans(),
                 st.from_regex(r"\A\s{0,2}[+-]?[0-9_]{1,8}(\.[0-9]{0,3})?\s{0,2}\Z"),
                 st.text(max_size=12)))
def test_lax_int_agrees_with_pydantic_anywhere(v: Any) -> None:
    expected = pydantic_reads(v)
    if expected is not None and isinstance(v, float) and abs(v) >= 2**63:
        return  # past int64: pydantic's own bound, which the gateway reads as no value
    assert lax_int(v) == expected, v


def test_a_lax_max_tokens_and_n_are_reserved_as_the_engine_generates() -> None:
    chat = ENDPOINTS["/v1/chat/completions"]
    facts = parse_body(orjson.dumps({"model": "m", "messages": [], "max_tokens": 500.0,
                                     "n": "3"}), caps=chat.caps, fanout=chat.fanout)
    assert (facts.max_tokens, facts.sequences) == (500, 3)
    messages = ENDPOINTS["/v1/messages"]
    facts = parse_body(orjson.dumps({"model": "m", "messages": [], "max_tokens": "64"}),
                       requires_max_tokens=True, caps=messages.caps)
    assert facts.max_tokens == 64
