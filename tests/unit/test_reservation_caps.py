"""The completion side of a reservation is the cap the endpoint's own API honours (DESIGN
§5): a body that also carries another API's cap field must not reserve by that one."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.authz.decision import Allow
from tests.unit.test_authz_engine import Gate, policy

PROMPT = [{"role": "user", "content": "hi"}]


async def reserved(path: str, body: dict[str, Any]) -> tuple[int, int]:
    """(completion tokens reserved, the prompt's estimate) for an allowed request."""
    gate = Gate(policy(key_limits="{tokens_per_day: 1000000}"))
    d = await gate.check({"model": "llama-3", **body}, path=path)
    assert isinstance(d, Allow), d
    return d.context.reserved - d.context.prompt_estimate, d.context.prompt_estimate


@pytest.mark.parametrize(("path", "body", "completion"), [
    # the engine generates up to max_tokens on /v1/completions, max_output_tokens on
    # /v1/responses and max_tokens on /v1/messages, whatever else the body says
    ("/v1/completions", {"prompt": "hi", "max_tokens": 500, "max_completion_tokens": 1}, 500),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 700, "max_tokens": 1}, 700),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 700,
                       "max_completion_tokens": 2}, 700),
    ("/v1/messages", {"messages": PROMPT, "max_tokens": 900, "max_completion_tokens": 3}, 900),
    # chat: max_completion_tokens first, as OpenAI (and vLLM) read it
    ("/v1/chat/completions", {"messages": PROMPT, "max_tokens": 800,
                              "max_completion_tokens": 40}, 40),
    ("/v1/chat/completions", {"messages": PROMPT, "max_tokens": 800,
                              "max_output_tokens": 4}, 800),
])
async def test_the_endpoints_own_cap_is_reserved(path: str, body: dict[str, Any],
                                                 completion: int) -> None:
    assert (await reserved(path, body))[0] == completion


async def test_another_apis_cap_is_not_a_messages_max_tokens() -> None:
    """Anthropic's Messages API requires max_tokens: another API's field does not stand in."""
    gate = Gate(policy())
    d = await gate.check({"model": "llama-3", "messages": PROMPT, "max_completion_tokens": 5},
                         path="/v1/messages")
    assert not isinstance(d, Allow) and d.status == 400 and "max_tokens" in d.message


async def test_embeddings_and_count_tokens_reserve_no_completion() -> None:
    assert (await reserved("/v1/embeddings", {"input": "hi", "max_tokens": 50}))[0] == 0
