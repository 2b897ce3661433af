"""The prompt estimate used for reservations and for cut streams' usage."""

from typing import Any

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


# A tool definition as the Messages API and chat completions take it: the engine renders the
# whole schema into the prompt (names and keys included), and bills it as input.
TOOL = {"name": "get_weather", "description": "Get the current weather in a given location. " * 4,
        "input_schema": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location"]}}


def test_tools_are_prompt() -> None:
    """Tool definitions are input tokens (Anthropic bills them, and its tool-use system
    prompt; an OpenAI-compatible engine renders them into the chat template): the estimate
    counts them, at ~4 characters a token of their JSON, so a request whose prompt is mostly
    tools reserves them rather than 1 token."""
    import orjson
    bare = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    tools = [TOOL] * 20
    size = len(orjson.dumps(tools)) // 4
    messages = estimate_prompt_tokens({**bare, "tools": tools})
    assert size <= messages - estimate_prompt_tokens(bare) <= size + 3 * 20 + 2
    chat = [{"type": "function", "function": {"name": TOOL["name"],
             "description": TOOL["description"], "parameters": TOOL["input_schema"]}}] * 20
    assert estimate_prompt_tokens({**bare, "tools": chat}) - estimate_prompt_tokens(bare) >= (
        len(orjson.dumps(chat)) // 4)
    facts = parse_body(orjson.dumps({**bare, "tools": tools}), requires_max_tokens=True,
                       caps=("max_tokens",))
    assert facts.reserve(100, 1000) == messages + 5
    deep: Any = "x" * 40
    for _ in range(300):  # past orjson's depth for dumps: walked instead, never raised
        deep = [deep]
    assert estimate_prompt_tokens({"tools": [deep]}) >= 10
    assert estimate_prompt_tokens({"tools": ["\ud800" * 40]}) >= 10  # the stdlib reads these
