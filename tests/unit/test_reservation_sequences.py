"""The completion side of a reservation covers every sequence the engine generates (DESIGN
§5): chat's `n`, the completions API's `n` and `best_of` (best_of candidates are generated
and billed), times the prompts of a list `prompt`. Each read leniently, bounded by what the
API accepts, and the whole completion side capped by GATEWAY_RESERVE_CAP_TOKENS."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.authz.decision import Allow
from gateway.authz.request import parse_body
from tests.unit.test_authz_engine import Gate, policy

PROMPT = [{"role": "user", "content": "hi"}]
CAP = 32768  # AdmissionSettings().reserve_cap, the documented default


async def completion(path: str, body: dict[str, Any]) -> int:
    """Completion tokens reserved for an allowed request (its reservation less the prompt
    estimate)."""
    gate = Gate(policy(key_limits="{tokens_per_day: 100000000}"))
    d = await gate.check({"model": "llama-3", **body}, path=path)
    assert isinstance(d, Allow), d
    return d.context.reserved - d.context.prompt_estimate


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(("path", "body", "expected"), [
    # chat: n completions, each up to max_tokens (or max_completion_tokens)
    (CHAT, {"messages": PROMPT, "max_tokens": 2000, "n": 4}, 8000),
    (CHAT, {"messages": PROMPT, "max_completion_tokens": 300, "n": 3}, 900),
    # completions: n per prompt
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 100, "n": 5}, 500),
    # best_of candidates are generated and billed, n of them returned (best_of >= n)
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 100, "best_of": 6}, 600),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 100, "n": 2, "best_of": 5}, 500),
    # a list of prompts: each gets its n (or best_of) completions
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "max_tokens": 100}, 300),
    (COMPLETIONS, {"prompt": ["a", "b", "c"], "max_tokens": 100, "n": 2}, 600),
    (COMPLETIONS, {"prompt": [[1, 2], [3], [4, 5, 6], [7]], "max_tokens": 10,
                   "best_of": 3}, 120),
    # a flat token array is one prompt, not one per token
    (COMPLETIONS, {"prompt": [1, 2, 3, 4, 5], "max_tokens": 100, "n": 2}, 200),
    # no max_tokens: the default completion (AdmissionSettings: 1024) per sequence
    (CHAT, {"messages": PROMPT, "n": 2}, 2048),
    # max_tokens 0 generates nothing, however many sequences
    (CHAT, {"messages": PROMPT, "max_tokens": 0, "n": 8}, 0),
])
async def test_every_sequence_is_reserved(path: str, body: dict[str, Any],
                                          expected: int) -> None:
    assert await completion(path, body) == expected


@pytest.mark.parametrize("value", [0, -3, 2.5, "4.5", "four", True, None, [4], {"n": 4}])
async def test_a_value_that_is_not_a_positive_int_counts_as_one(value: Any) -> None:
    assert await completion(CHAT, {"messages": PROMPT, "max_tokens": 100, "n": value}) == 100
    assert await completion(COMPLETIONS, {"prompt": "hi", "max_tokens": 100,
                                          "best_of": value}) == 100


@pytest.mark.parametrize("value", ["4", 4.0, " 4 "])
async def test_a_value_the_engine_reads_as_an_int_counts_as_that_int(value: Any) -> None:
    """vLLM's pydantic reads "4" and 4.0 as 4 (lax mode): four sequences are generated."""
    assert await completion(CHAT, {"messages": PROMPT, "max_tokens": 100, "n": value}) == 400


async def test_no_more_sequences_than_the_api_accepts() -> None:
    """n is at most 128 and best_of at most 20 (OpenAI's bounds): a huge value claims no
    more (the cap set high here so that the count itself is what is read)."""
    big = 10 ** 6
    assert parse_body(b'{"model":"m","n":%d}' % big, fanout=(("n", 128),)).sequences == 128
    assert parse_body(b'{"model":"m","best_of":%d}' % big,
                      fanout=(("n", 128), ("best_of", 20))).sequences == 20
    assert await completion(CHAT, {"messages": PROMPT, "max_tokens": 10, "n": 1000}) == 1280


@pytest.mark.parametrize(("path", "body"), [
    # the other APIs generate one sequence: their n / best_of / list prompt mean nothing
    ("/v1/responses", {"input": "hi", "max_output_tokens": 100, "n": 4}),
    ("/v1/messages", {"messages": PROMPT, "max_tokens": 100, "n": 4}),
    # chat has no best_of (vLLM's V1 refuses it, OpenAI's chat never had it) and no prompt
    (CHAT, {"messages": PROMPT, "max_tokens": 100, "best_of": 4}),
    (CHAT, {"messages": PROMPT, "prompt": ["a", "b", "c"], "max_tokens": 100}),
])
async def test_other_apis_reserve_one_sequence(path: str, body: dict[str, Any]) -> None:
    assert await completion(path, body) == 100


async def test_embeddings_reserve_no_completion_whatever_n_says() -> None:
    assert await completion("/v1/embeddings", {"input": ["a", "b"], "n": 4}) == 0


async def test_the_cap_bounds_the_whole_completion_side() -> None:
    """GATEWAY_RESERVE_CAP_TOKENS caps the completion side of one reservation, as
    documented (README, docs/contracts.md): not each sequence."""
    assert await completion(CHAT, {"messages": PROMPT, "max_tokens": 20000, "n": 4}) == CAP
    assert await completion(COMPLETIONS, {"prompt": ["a"] * 50, "max_tokens": 1000}) == CAP


async def test_a_pass_through_reads_every_api_s_multipliers() -> None:
    """A pass-through body that names a model reserves by any API's cap (the first given),
    so by any API's sequence count too."""
    from gateway.authz.request import named_model
    facts = named_model(b'{"model":"m","prompt":["a","b"],"best_of":3,"max_tokens":10}')
    assert facts is not None and facts.sequences == 6
    assert facts.reserve(1024, CAP) == facts.prompt_tokens + 60
