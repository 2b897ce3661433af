"""The prompt estimate used for reservations and for cut streams' usage."""

from gateway.authz.request import estimate_prompt_tokens, parse_body


def test_counts_text_not_json_overhead() -> None:
    text = "word " * 80  # 400 characters
    chat = {"model": "m", "max_tokens": 5, "temperature": 0.2,
            "messages": [{"role": "user", "content": text}]}
    est = estimate_prompt_tokens(chat)
    assert 100 <= est <= 110
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    assert abs(estimate_prompt_tokens(parts) - est) <= 5
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4]}) >= 4  # token ids
    assert estimate_prompt_tokens({"input": ["a" * 40, "b" * 40]}) >= 20
    assert estimate_prompt_tokens({"model": "m"}) == 1


def test_body_facts_carry_it() -> None:
    facts = parse_body(b'{"model":"m","messages":[{"role":"user","content":"hello there"}]}')
    assert 3 <= facts.prompt_tokens <= 10
