"""The mock engine's accounting: deterministic tokens, OpenAI and Anthropic wire shapes, its ledger.

A "token" is a whitespace-separated word, so a test can compute the expected usage of any
request by hand and check that the gateway metered exactly what the engine reported.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from devspoke.errors import RequestError

EMBEDDING_DIM = 8
FINGERPRINT = "fp_mock"
HEADER_HISTORY = 50


# vLLM's and SGLang's request flags (`stream: bool | None = False`, stream_options'), which
# pydantic validates in lax mode: 1, 1.0, "true", "yes", "on", "t", "y" (any case) are true.
_FLAG = TypeAdapter(bool | None)


def flag(fields: Mapping[str, Any], name: str) -> bool:
    """A request flag as vLLM reads it (null or absent: false); a value pydantic refuses
    ("maybe", 2, []) is the engine's 400. Pydantic itself, not the gateway's lax_bool, so
    the end-to-end tests hold the gateway to what such an engine does."""
    try:
        return bool(_FLAG.validate_python(fields.get(name)))
    except ValidationError:
        raise RequestError(f"{name}: Input should be a valid boolean") from None


def words(text: str) -> int:
    return len(text.split())


def _content_words(content: Any) -> int:
    """Count a message content: a string, or a list of parts carrying `text`."""
    if isinstance(content, str):
        return words(content)
    if isinstance(content, list):
        return sum(
            words(part["text"])
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


def _items_words(items: Iterable[Any]) -> int:
    """Count a list of messages/items, each a dict with `content` or a bare string."""
    total = 0
    for item in items:
        if isinstance(item, str):
            total += words(item)
        elif isinstance(item, dict):
            total += _content_words(item.get("content"))
    return total


def chat_prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages", [])
    if not isinstance(messages, list):
        raise RequestError("'messages' must be an array")
    return max(1, _items_words(messages))


def messages_prompt_tokens(body: dict[str, Any]) -> int:
    """Anthropic Messages: `system` (text or text blocks) plus the messages, counted as chat is."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RequestError("messages: Field required (an array of messages)")
    return max(1, _items_words(messages) + _content_words(body.get("system")))


def completion_prompt_tokens(body: dict[str, Any]) -> int:
    """`prompt` may be text, a list of texts, or token ids (each id counts as one token)."""
    return max(1, sum(_input_words(x) for x in _as_list(body.get("prompt", ""))))


def responses_prompt_tokens(body: dict[str, Any]) -> int:
    """Responses input plus `instructions`: both are prompt the model has to read."""
    raw = body.get("input", "")
    counted = _items_words(_as_list(raw))
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        counted += words(instructions)
    return max(1, counted)


def embedding_inputs(body: dict[str, Any]) -> list[Any]:
    raw = body.get("input")
    if raw is None or raw == "" or raw == []:
        raise RequestError("'input' is required")
    if isinstance(raw, list) and raw and isinstance(raw[0], int):
        return [raw]  # a single pre-tokenised input
    return _as_list(raw)


def _as_list(raw: Any) -> list[Any]:
    return raw if isinstance(raw, list) else [raw]


def _input_words(item: Any) -> int:
    if isinstance(item, str):
        return words(item)
    if isinstance(item, list):
        return len(item)  # token ids
    if isinstance(item, int):
        return 1
    raise RequestError("input items must be strings or token arrays")


def input_tokens(item: Any) -> int:
    return max(1, _input_words(item))


def completion_budget(body: dict[str, Any], default: int) -> tuple[int, bool]:
    """How many tokens to generate, and whether the client's own limit is what stopped us."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RequestError(f"'{key}' must be a non-negative integer")
        return value, True
    return default, False


def messages_budget(body: dict[str, Any]) -> int:
    """Anthropic requires `max_tokens`, at least 1; it is the length asked for, as in chat."""
    value = body.get("max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError("max_tokens: Field required (an integer >= 1)")
    return value


def token_text(i: int) -> str:
    """The i-th generated piece; joined pieces read "tok0 tok1 ..." (one word per token)."""
    return f"tok{i}" if i == 0 else f" tok{i}"


def generated_text(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


def embedding(item: Any, encoding_format: str) -> list[float] | str:
    """A stable unit vector derived from the input, so equal inputs embed equally."""
    digest = hashlib.sha256(repr(item).encode()).digest()
    raw = [b / 127.5 - 1.0 for b in digest[:EMBEDDING_DIM]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    vector = [round(x / norm, 6) for x in raw]
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{EMBEDDING_DIM}f", *vector)).decode()
    return vector


def chat_usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def running_usage(prompt: int, completion: int) -> dict[str, Any]:
    """vLLM's continuous_usage_stats shape: plain counts, no details."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def responses_usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def prompt_split(prompt: int, cache_read: int, cache_creation: int) -> dict[str, int]:
    """Anthropic's prompt usage: `input_tokens` is what neither came from nor went into the
    cache, so the three fields add up to the prompt."""
    read = min(cache_read, prompt)
    made = min(cache_creation, prompt - read)
    return {
        "input_tokens": prompt - read - made,
        "cache_creation_input_tokens": made,
        "cache_read_input_tokens": read,
    }


OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


# Anthropic's documented error.type per HTTP status (its API reference, "Errors"): the mock's
# own copy, not the gateway's, so a wrong entry there is caught by the tests, not repeated.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The error an Anthropic-style engine answers; a status the table lacks is `api_error`
    from 500 up, `invalid_request_error` below."""
    kind = ANTHROPIC_ERROR_TYPES.get(
        status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def message_object(job: Job, text: str | None, usage: dict[str, int]) -> dict[str, Any]:
    """An Anthropic `message`: empty and unfinished while `text` is still unknown."""
    return {
        "id": job.id,
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": [] if text is None else [{"type": "text", "text": text}],
        "stop_reason": None if text is None else STOP_REASONS[job.finish],
        "stop_sequence": None,
        "usage": usage,
    }


@dataclass(frozen=True)
class Pace:
    ttft_s: float
    gap_s: float
    die_after: int | None  # tokens sent before the engine "dies"
    reset: bool  # die with a TCP reset (cut) rather than a plain close (fail)


@dataclass(frozen=True)
class Job:
    """One generation: what was asked, how many tokens it yields, and at what pace."""

    id: str
    model: str
    created: int
    prompt: int
    n: int
    finish: str
    pace: Pace


@dataclass(frozen=True)
class StreamOpts:
    include_usage: bool
    continuous: bool

    @classmethod
    def of(cls, body: dict[str, Any]) -> StreamOpts:
        """vLLM honours continuous_usage_stats only alongside include_usage; so do we."""
        raw = body.get("stream_options") or {}
        include = flag(raw, "include_usage")
        return cls(include, include and flag(raw, "continuous_usage_stats"))

    def usage_field(self, prompt: int, completion: int) -> dict[str, Any]:
        """OpenAI puts `usage: null` on every chunk once usage is asked for; vLLM's
        continuous_usage_stats puts the running counts there instead."""
        if self.continuous:
            return {"usage": running_usage(prompt, completion)}
        return {"usage": None} if self.include_usage else {}


def envelope(job: Job, obj: str) -> dict[str, Any]:
    return {
        "id": job.id,
        "object": obj,
        "created": job.created,
        "model": job.model,
        "system_fingerprint": FINGERPRINT,
    }


def chat_choice(text: str | None, finish: str | None) -> dict[str, Any]:
    delta = {} if text is None else {"content": text}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


CHAT_OPENING = {
    "index": 0,
    "delta": {"role": "assistant", "content": ""},
    "logprobs": None,
    "finish_reason": None,
}


def text_choice(text: str | None, finish: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


def item_id(job: Job) -> str:
    return "msg_" + job.id.removeprefix("resp_")


def message_item(job: Job, text: str | None = None) -> dict[str, Any]:
    """The Responses output message: in progress while `text` is still unknown."""
    return {
        "type": "message",
        "id": item_id(job),
        "status": "in_progress" if text is None else "completed",
        "role": "assistant",
        "content": [] if text is None else [text_part(text)],
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_object(job: Job, output: list[Any], usage: Any) -> dict[str, Any]:
    """A Responses `response`: completed once it carries usage, in progress before."""
    return {
        "id": job.id,
        "object": "response",
        "created_at": job.created,
        "status": "in_progress" if usage is None else "completed",
        "error": None,
        "incomplete_details": None,
        "model": job.model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
    }


def _history() -> deque[dict[str, str]]:
    return deque(maxlen=HEADER_HISTORY)


MESSAGES_USAGE = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


def _messages_ledger() -> dict[str, int]:
    return dict.fromkeys(MESSAGES_USAGE, 0)


@dataclass
class MockStats:
    """Engine-side observations, so tests can assert what actually reached the engine."""

    in_flight: int = 0
    max_in_flight: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    last_headers: deque[dict[str, str]] = field(default_factory=_history)
    models: set[str] = field(default_factory=set)
    messages_usage: dict[str, int] = field(default_factory=_messages_ledger)

    def enter(self, headers: Mapping[str, str]) -> None:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        seen: dict[str, str] = {}
        for name, value in headers.items():
            key = name.lower()
            seen[key] = f"{seen[key]},{value}" if key in seen else value
        self.last_headers.append(seen)

    def leave(self, usage: Mapping[str, Any] | None) -> None:
        """Tally the usage the client was told; an Anthropic prompt is its three parts."""
        self.in_flight -= 1
        if not usage:
            return
        self.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
        self.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0))
        if "cache_read_input_tokens" in usage:  # a Messages API usage
            self.prompt_tokens += usage["cache_read_input_tokens"]
            self.prompt_tokens += usage.get("cache_creation_input_tokens", 0)
            for key in MESSAGES_USAGE:
                self.messages_usage[key] += usage.get(key, 0)

    def reset(self) -> None:
        """Zero the counters; in_flight is a live gauge, so it only seeds the high-water mark."""
        self.requests = self.prompt_tokens = self.completion_tokens = 0
        self.max_in_flight = self.in_flight
        self.last_headers.clear()
        self.messages_usage = _messages_ledger()

    def snapshot(self) -> dict[str, Any]:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        return {
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "requests": self.requests,
            "usage_reported": usage,  # OpenAI's sense: prompt_tokens includes cached tokens
            "messages_usage_reported": dict(self.messages_usage),  # Anthropic fields, summed
            "last_headers": list(self.last_headers),
        }
