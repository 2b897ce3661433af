"""One request's response, observed chunk by chunk, turned into its facts.

Sans-I/O: the ext_proc handler feeds it response headers and body chunks; it answers with
the bytes to forward when it had to change them (to hide a usage chunk the gateway asked
for on the client's behalf), and at the end it says what the response was
(`facts()`, gateway/metering/facts.py): what is billed is decided from those, as for
Envoy's record (gateway/metering/billing.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.endpoints import ENDPOINTS, Reader, reader_of
from gateway.limits.types import Checkpoint
from gateway.metering import usage as usage_mod
from gateway.metering.billing import metered, progress
from gateway.metering.facts import ResponseFacts
from gateway.metering.inject import Injected
from gateway.metering.sse import SseDecoder, SseEvent
from gateway.metering.usage import ChoicesStream, MessagesStream
from gateway.token_weights import TokenWeights
from gateway.usage_event import Usage

__all__ = ["Injected", "Meter"]

MAX_JSON_BODY = 16 << 20  # a non-stream body larger than this is not parsed for usage


# The Responses API's events that stream generated text: the answer, and the reasoning
# (vLLM's reasoning_text, OpenAI's summary), as chat's content and reasoning_content.
RESPONSES_DELTAS = frozenset(("response.output_text.delta", "response.reasoning_text.delta",
                              "response.reasoning_summary_text.delta"))

# What engines move from the finish chunk onto the usage chunk they were asked for.
MOVED_TO_USAGE = ("system_fingerprint", "timings")


def _written(text: Any) -> int:
    """A content string's length as the Lua filter counts it (llm.stream:content_chars):
    the bytes of its JSON text, as engines write it (UTF-8, JSON's short escapes)."""
    if not isinstance(text, str) or not text:
        return 0
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return len(text)  # most tokens: nothing to escape, one byte a character
    return len(orjson.dumps(text)) - 2


def _finishes(obj: Any) -> bool:
    """A chat/completions chunk that finishes a choice (its finish_reason a string)."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    return isinstance(first, dict) and isinstance(first.get("finish_reason"), str)


def _restore_moved(held: bytes, held_obj: Any, hidden: Any) -> bytes:
    """The held finish chunk with the members the hidden usage chunk took from it, put
    before its closing brace (its own bytes otherwise untouched)."""
    if not isinstance(hidden, dict) or not isinstance(held_obj, dict):
        return held
    extra = [b'"' + k.encode() + b'":' + orjson.dumps(hidden[k]) for k in MOVED_TO_USAGE
             if k in hidden and k not in held_obj]
    close = held.rfind(b"}")
    if not extra or close < 0:
        return held
    return held[:close] + b"," + b",".join(extra) + held[close:]


@dataclass
class Meter:
    endpoint: str
    stream: bool
    injected: Injected = field(default_factory=Injected)
    prompt_estimate: int = 0
    weights: TokenWeights | None = None  # the model's token weights, as admitted
    started: float = field(default_factory=time.monotonic)
    status: int = 0
    sse: bool = False
    reported: Usage | None = None
    served_model: str = ""
    content_events: int = 0
    content_chars: int = 0
    first_token: float | None = None
    last_token: float | None = None
    saw_end: bool = False  # the engine's own end marker: [DONE], a terminal Responses event,
    # or Anthropic's message_stop
    engine_error: bool = False  # the engine reported a failure inside its stream
    _messages: MessagesStream = field(default_factory=MessagesStream)
    _choices: ChoicesStream = field(default_factory=ChoicesStream)
    _reader: Reader = field(init=False)  # how this endpoint's usage reads, looked up once
    _decoder: SseDecoder = field(default_factory=SseDecoder)
    _held: tuple[bytes, Any] | None = None  # a finish chunk waiting for the next event
    _body: list[bytes] = field(default_factory=list)
    _body_len: int = 0
    _whole_len: int = 0  # every byte of a whole answer, read or not

    def __post_init__(self) -> None:
        self._reader = reader_of(self.endpoint)

    @property
    def rewrites(self) -> bool:
        """Only a stream we injected into is ever changed; everything else passes untouched."""
        return self.sse and (self.injected.include_usage or self.injected.continuous)

    def response_headers(self, status: int, content_type: str) -> None:
        self.status = status
        self.sse = content_type.startswith("text/event-stream")

    def chunk(self, data: bytes, end: bool) -> bytes | None:
        """Observe a body chunk; return replacement bytes, or None to forward it unchanged."""
        if not self.sse:
            if self.first_token is None and data:
                self.first_token = time.monotonic()  # non-stream: the time to first byte
            self._whole_len += len(data)
            if self._body_len <= MAX_JSON_BODY:
                self._body.append(data)
                self._body_len += len(data)
            if end:  # read only whole: a body cut short has no usage (as for Envoy's record)
                self._parse_body()
            return None
        events = self._decoder.feed(data)
        if end:
            events += self._decoder.flush()
        if not self.rewrites:
            for ev in events:
                self._observe(ev)
            return None
        out = [self._rewrite(ev) for ev in events]
        if end and self._held is not None:
            out.append(self._held[0])
            self._held = None
        return b"".join(out)

    def _rewrite(self, ev: SseEvent) -> bytes:
        """An event as the client gets it. Asked for usage, engines move a member of the
        finish chunk onto the usage-only chunk (llama.cpp `timings`, vLLM
        `system_fingerprint`): when that chunk is ours to hide, the finish chunk waits for
        the next event and gets those members back (as the Lua filter does)."""
        obj = self._observe(ev)
        out = self._hide(ev, obj)
        prefix = b""
        if self._held is not None:
            held, held_obj = self._held
            self._held = None
            prefix = _restore_moved(held, held_obj, obj) if out == b"" else held
        if self.injected.include_usage and out and _finishes(obj):
            self._held = (out, obj)
            return prefix
        return prefix + out

    def _hide(self, ev: SseEvent, obj: Any) -> bytes:
        if not isinstance(obj, dict) or "usage" not in obj:
            return ev.raw
        if obj.get("choices") == []:  # the final usage-only chunk
            return b"" if self.injected.include_usage else ev.raw
        if self.injected.continuous or obj["usage"] is None:
            del obj["usage"]
            return b"data: " + orjson.dumps(obj) + b"\n\n"
        return ev.raw

    def _observe(self, ev: SseEvent) -> Any:
        if ev.done:
            self.saw_end = True
            return None
        if not ev.data:
            return None
        try:
            obj = orjson.loads(ev.data)
        except orjson.JSONDecodeError:  # a broken event: its content is not counted
            return None
        if not isinstance(obj, dict):
            return obj
        if not self.served_model:  # the first event names it: a cut stream keeps it too
            model = obj.get("model")
            if not isinstance(model, str):
                inner = obj.get("response")
                model = inner.get("model") if isinstance(inner, dict) else None
            if isinstance(model, str):
                self.served_model = model
        reader = self._reader
        if reader is Reader.MESSAGES:
            self._message_event(obj)
            return obj
        if reader is Reader.RESPONSES:
            kind = obj.get("type", "")
            if kind in RESPONSES_DELTAS:
                self._token(_written(obj.get("delta")))
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                self._usage(obj)
                self.saw_end = True
            elif kind == "error":  # the engine failed mid-stream
                self.engine_error = True
            return obj
        written = 0
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    more = delta.get("reasoning_content")
                    written += _written(delta.get("content")) + (_written(more) if more else 0)
                else:
                    written += _written(choice.get("text"))
        if written:
            self._token(written)
        if obj.get("usage") is not None:
            u, model = usage_mod.from_body(self.endpoint, obj)
            if u is not None:
                self.reported = self._choices.add(obj, u)
            if model:
                self.served_model = model
        return obj

    def _message_event(self, obj: dict[str, Any]) -> None:
        """One event of an Anthropic Messages stream."""
        kind = obj.get("type")
        if kind == "content_block_delta":
            d = obj.get("delta")
            if isinstance(d, dict):
                self._token(_written(d.get("text") or d.get("thinking") or d.get("partial_json")))
        elif kind == "message_start":
            message = obj.get("message")
            self._messages.start(message)
            if isinstance(message, dict) and isinstance(message.get("model"), str):
                self.served_model = message["model"]
        elif kind == "message_delta":
            self._messages.delta(obj.get("usage"))
            if (u := self._messages.usage()) is not None:
                self.reported = u
        elif kind == "message_stop":
            self.saw_end = True
        elif kind == "error":
            self.engine_error = True

    def _token(self, written: int) -> None:
        """One event that carried `written` bytes of content (none: not a content event)."""
        if written:
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
            self.content_events += 1
            self.content_chars += written

    def _usage(self, obj: Any) -> None:
        u, model = usage_mod.from_body(self.endpoint, obj)
        if u is not None:
            self.reported = u
        if model:
            self.served_model = model

    def _parse_body(self) -> None:
        if self._body_len > MAX_JSON_BODY and 200 <= self.status < 300 and (
                (e := ENDPOINTS.get(self.endpoint)) is not None and e.generates):
            # too large to read for its usage: its size stands for its completion (bytes/4,
            # an over-estimate), as the Envoy source's record does; never free
            self.content_chars = self._whole_len
        if self._body and self._body_len <= MAX_JSON_BODY and not self.saw_end:
            try:
                self._usage(orjson.loads(b"".join(self._body)))
                self.saw_end = True  # a whole JSON document arrived
            except orjson.JSONDecodeError:  # not JSON: the usage is estimated
                pass
            self._body = []

    def checkpoint(self) -> Checkpoint | None:
        """(prompt, completion) tokens used so far by a stream, for its lease's checkpoint
        (and the weighted count, for a model with token weights: billing.progress); None
        before its first byte, or for a whole-JSON answer (read only at its end)."""
        if not self.sse:
            return None
        u, _ = metered(self.facts(), self.prompt_estimate)
        return progress(u, self.weights)

    def facts(self, ended: bool = False, flags: frozenset[str] = frozenset()) -> ResponseFacts:
        """The response as observed so far. `ended`: its end reached the proxy
        (end_of_stream); `flags`: Envoy's word on who cut it, when it sent one."""
        usage, input_only = self.reported, False
        if usage is None:
            usage = self._messages.input_side()  # a cut Anthropic stream: its input is exact
            input_only = usage is not None
        first, last = self.first_token, self.last_token
        return ResponseFacts(
            status=self.status, flags=flags, ended=ended, end_seen=self.sse and self.saw_end,
            engine_error=self.engine_error, content_events=self.content_events,
            content_chars=self.content_chars, usage=usage, input_only=input_only,
            served_model=self.served_model,
            ttft_ms=(first - self.started) * 1000 if first else 0.0,
            generation_ms=(last - first) * 1000 if first and last else None)
