"""Token usage as engines report it, per endpoint; None = not reported (distinct from 0)."""

from __future__ import annotations

from typing import Any

from gateway.endpoints import Reader, reader_of
from gateway.usage_event import Usage


def plus(a: Usage, b: Usage) -> Usage:
    return Usage(*(x + y for x, y in zip(_fields(a), _fields(b), strict=True)))


def _fields(u: Usage) -> tuple[int, ...]:
    return (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens,
            u.reasoning_tokens, u.cache_creation_tokens)


# The largest count believed. The event's counts are int64 (a consumer's proto parser
# refuses the whole event past that, and stops there), and Envoy's filters carry numbers as
# doubles, exact to 2**53: a count above is no engine's and reads as 0 in both sources.
MAX_COUNT = 2**53


def count(v: Any) -> int:
    """A count as JSON writes it: a non-negative number, `12.0` too (JSON has one number
    type; Envoy's filters read it so: json_to_metadata as a double, the Lua filter by its
    digits), its fraction dropped; anything else, or past MAX_COUNT, 0."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v if 0 <= v <= MAX_COUNT else 0
    return int(v) if isinstance(v, float) and 0 <= v <= MAX_COUNT else 0


def _given(v: Any) -> bool:
    """A count is there: a non-negative number (null, a string or -1 is not; as the Lua filter
    reads an event, which publishes only a count written with digits)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and v >= 0


def _detail(obj: Any, section: str, field: str) -> int:
    d = obj.get(section) if isinstance(obj, dict) else None
    return count(d.get(field)) if isinstance(d, dict) else 0


def _usage(u: Any, prompt: str, completion: str, prompt_details: str,
           completion_details: str) -> Usage | None:
    if not isinstance(u, dict) or not (_given(u.get(prompt)) or _given(u.get(completion))):
        return None  # no count at all ({}, nulls): not reported, as for Envoy's record
    p, c = count(u.get(prompt)), count(u.get(completion))
    return Usage(
        prompt_tokens=p,
        completion_tokens=c,
        total_tokens=count(u.get("total_tokens")) or p + c,
        cached_tokens=_detail(u, prompt_details, "cached_tokens"),
        reasoning_tokens=_detail(u, completion_details, "reasoning_tokens"),
    )


def from_openai(u: Any) -> Usage | None:
    """Chat/completions/embeddings `usage` object (also vLLM's continuous usage)."""
    return _usage(u, "prompt_tokens", "completion_tokens", "prompt_tokens_details",
                  "completion_tokens_details")


def from_responses(u: Any) -> Usage | None:
    """Responses API `usage`: input/output tokens."""
    return _usage(u, "input_tokens", "output_tokens", "input_tokens_details",
                  "output_tokens_details")


# Anthropic's usage fields. Its input_tokens leaves out the tokens read from or written to
# the prompt cache; the gateway's prompt_tokens counts every input token, as OpenAI's does.
MESSAGES_INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
MESSAGES_FIELDS = (*MESSAGES_INPUT, "output_tokens")


def from_messages(u: Any) -> Usage | None:
    """Anthropic Messages API `usage` (a whole answer's, or a stream's merged pieces)."""
    if not isinstance(u, dict) or not (_given(u.get("input_tokens"))
                                       or _given(u.get("output_tokens"))):
        return None
    return anthropic(count(u.get("input_tokens")), count(u.get("output_tokens")),
                     count(u.get("cache_read_input_tokens")),
                     count(u.get("cache_creation_input_tokens")))


def anthropic(input_tokens: int, output_tokens: int, cache_read: int,
              cache_creation: int) -> Usage:
    """Anthropic's counts, normalised: every input token in prompt_tokens (the one place;
    Envoy's record carries the same four numbers under the Lua filter's names)."""
    p = input_tokens + cache_read + cache_creation
    return Usage(p, output_tokens, p + output_tokens, cached_tokens=cache_read,
                 cache_creation_tokens=cache_creation)


class MessagesStream:
    """An Anthropic stream's usage, which comes in pieces: `message_start` carries the input
    side (its output_tokens is only the count so far), each `message_delta` the cumulative
    output_tokens and, from newer engines, the input side again. A field a later event
    carries replaces the earlier value; a field it leaves out, or sends as null, keeps it
    (merging the message_delta over message_start wholesale loses the cache counts: a
    peer's bug)."""

    __slots__ = ("fields", "final")

    def __init__(self) -> None:
        self.fields: dict[str, int] = {}
        self.final = False  # a message_delta came: the output count is the engine's

    def start(self, message: Any) -> None:
        u = message.get("usage") if isinstance(message, dict) else None
        self._merge(u, MESSAGES_INPUT)

    def delta(self, u: Any) -> None:
        if isinstance(u, dict):
            self._merge(u, MESSAGES_FIELDS)
            self.final = self.final or _given(u.get("output_tokens"))

    def _merge(self, u: Any, names: tuple[str, ...]) -> None:
        if isinstance(u, dict):
            for name in names:  # a null (the API's "not given") keeps what came before
                if _given(u.get(name)):
                    self.fields[name] = count(u[name])

    def usage(self) -> Usage | None:
        """The whole usage once the output count is the engine's; None before."""
        return from_messages(self.fields) if self.final else None

    def input_side(self) -> Usage | None:
        """What message_start said of the input (exact, the cache counts included), for a
        stream cut before its message_delta: its output is estimated from what streamed.
        None if message_start never came."""
        if "input_tokens" not in self.fields:
            return None
        return from_messages({n: self.fields.get(n, 0) for n in MESSAGES_INPUT})


class ChoicesStream:
    """A chat or completions stream's usage, however the engine splits it. With `n` > 1 or a
    prompt list, llama.cpp's server sends one usage-only chunk (`"choices": []`) per choice
    and puts a completions choice's usage on its own finish chunk; vLLM sends one usage-only
    chunk for all choices, and with continuous usage each choice's running count on its
    chunks. So: the usage-only chunks, summed, when there are any; else each choice's
    latest usage, summed over the choices (one choice: simply the latest)."""

    __slots__ = ("by_choice", "only")

    def __init__(self) -> None:
        self.only: Usage | None = None  # the sum of the usage-only chunks so far
        self.by_choice: dict[int, Usage] = {}

    def add(self, obj: dict[str, Any], u: Usage) -> Usage:
        """Take one event's usage; the usage that stands now. An event without `choices`
        (not a chat or completions chunk) stands as it is, as in the Lua filter."""
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return u
        if choices:
            first = choices[0]
            index = first.get("index") if isinstance(first, dict) else None
            self.by_choice[count(index)] = u
        else:
            self.only = u if self.only is None else plus(self.only, u)
        if self.only is not None:
            return self.only
        total = Usage()
        for each in self.by_choice.values():
            total = plus(total, each)
        return total


def from_body(endpoint: str, obj: Any) -> tuple[Usage | None, str]:
    """(usage, served model) of a complete non-stream JSON response, or of one SSE event."""
    if not isinstance(obj, dict):
        return None, ""
    reader = reader_of(endpoint)
    if reader is Reader.NONE:
        return None, ""
    if reader is Reader.MESSAGES:
        model = obj.get("model")
        return from_messages(obj.get("usage")), model if isinstance(model, str) else ""
    if reader is Reader.RESPONSES:
        inner = obj.get("response") if "response" in obj else obj
        if isinstance(inner, dict):
            model = inner.get("model")
            return from_responses(inner.get("usage")), model if isinstance(model, str) else ""
        return None, ""
    model = obj.get("model")
    return from_openai(obj.get("usage")), model if isinstance(model, str) else ""
