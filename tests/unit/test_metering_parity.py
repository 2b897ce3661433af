"""Both metering sources, one corpus: the same answers give the same facts and the same bill.

Each answer is fed to ext_proc's side (Exchange → Meter, chunk by chunk) and to Envoy's: the
Lua filter (under LuaJIT, with tests/unit/test_lua_metering.py's fake of Envoy) for a
stream, json_to_metadata's rules (gateway/envoyconf/metering.py, applied here as Envoy
applies them) for a whole JSON answer, then the access-log record those make, read by
gateway/metering/record.py. The two `ResponseFacts` must be equal, and so must what
gateway/metering/billing.py settles from them. The timings are compared as present or
absent, except where both sources are given one clock (chunk i read 50 ms + i * 10 µs after
the request's start): then both time the first token alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson
import pytest
from test_lua_metering import run_response

from gateway.envoyconf.metering import MODEL_RULES, USAGE_RULES
from gateway.metering import billing, handoff, record
from gateway.metering import meter as meter_mod
from gateway.metering.exchange import Exchange
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.metering.inject import Injected

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES, EMBEDDINGS = "/v1/messages", "/v1/embeddings"
SSE, JSON = "text/event-stream", "application/json"
MODEL = "served-m"


# --- the corpus ----------------------------------------------------------------------------

def data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def named(kind: str, obj: Any) -> bytes:
    return b"event: " + kind.encode() + b"\n" + data(obj)


DONE = b"data: [DONE]\n\n"


def usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def chat(content: str | None = None, *, index: int = 0, finish: str | None = None,
         u: Any = None, reasoning: str | None = None, with_usage: bool = True) -> bytes:
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning_content"] = reasoning
    ev: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "created": 1,
                          "model": MODEL, "choices": [{"index": index, "delta": delta,
                                                       "finish_reason": finish}]}
    if with_usage:
        ev["usage"] = u
    return data(ev)


def usage_only(u: dict[str, Any]) -> bytes:
    return data({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                 "choices": [], "usage": u})


def completion(text: str, *, index: int = 0, finish: str | None = None,
               u: Any = None) -> bytes:
    ev: dict[str, Any] = {"id": "k1", "object": "text_completion", "model": MODEL,
                          "choices": [{"index": index, "text": text, "logprobs": None,
                                       "finish_reason": finish}]}
    if u is not None:
        ev["usage"] = u
    return data(ev)


TEXT = ["Hello", ", wörld", " ✓ \"quoted\"\n", "漢字 🙂", " end"]  # UTF-8 and escapes
WHOLE_CHAT = [chat("", u=None), *[chat(t, u=None) for t in TEXT], chat(finish="stop", u=None)]
CHAT_USAGE = usage(11, 5, cached=4, reasoning=1)


def responses_stream(deltas: list[str], end: str | None = "response.completed") -> list[bytes]:
    out = [named("response.created", {"type": "response.created", "response": {
        "id": "r1", "model": MODEL, "status": "in_progress", "usage": None}}),
        named("response.in_progress", {"type": "response.in_progress", "response": {
            "id": "r1", "model": MODEL, "usage": None}})]
    out += [named("response.output_text.delta", {"type": "response.output_text.delta",
                                                 "item_id": "m1", "output_index": 0,
                                                 "delta": d}) for d in deltas]
    if end is not None:
        out.append(named("response.output_text.done", {"type": "response.output_text.done",
                                                       "text": "".join(deltas)}))
        out.append(named(end, {"type": end, "response": {
            "id": "r1", "model": MODEL + "-2", "status": "completed",
            "output": [{"content": [{"type": "output_text", "text": "".join(deltas)}]}],
            "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 3},
                      "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 2},
                      "total_tokens": 15}}}))
    return out


def messages_stream(deltas: int, *, end: bool = True) -> list[bytes]:
    out = [named("message_start", {"type": "message_start", "message": {
        "id": "msg1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
        "usage": {"input_tokens": 5, "cache_creation_input_tokens": 3,
                  "cache_read_input_tokens": 2, "output_tokens": 1}}}),
        named("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}})]
    pieces = [{"type": "thinking_delta", "thinking": "hmm…"},
              {"type": "text_delta", "text": "Héllo"},
              {"type": "input_json_delta", "partial_json": '{"a": "b\\n"'},
              {"type": "text_delta", "text": " there"}]
    out += [named("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": pieces[i % len(pieces)]})
            for i in range(deltas)]
    if end:
        out += [named("content_block_stop", {"type": "content_block_stop", "index": 0}),
                named("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": "end_turn"},
                                        "usage": {"output_tokens": 12}}),
                named("message_stop", {"type": "message_stop"})]
    return out


ANTHROPIC_ERROR = named("error", {"type": "error", "error": {
    "type": "overloaded_error", "message": "Overloaded"}})


@dataclass(frozen=True)
class Case:
    name: str
    endpoint: str
    events: list[bytes]  # the body, event by event (one piece for a JSON answer)
    outcome: str  # what is expected, so a shared mistake cannot pass as parity
    source: str
    content_type: str = SSE
    status: int = 200
    hide: tuple[bool, bool] = (False, False)  # (hide_usage, hide_continuous) from the Check
    flags: str = ""  # Envoy's response flags of a stream that ended early
    cancelled: str = "generated"  # the team's rule for a stream its client cancels

    @property
    def cut(self) -> bool:
        return bool(self.flags)


CASES = [
    Case("chat, usage injected and hidden", CHAT,
         [*WHOLE_CHAT, usage_only(CHAT_USAGE), DONE], "completed", "reported",
         hide=(True, False)),
    Case("chat, the client asked for usage", CHAT,
         [*WHOLE_CHAT, usage_only(CHAT_USAGE), DONE], "completed", "reported"),
    Case("chat, the engine never reports usage", CHAT,
         [*[chat(t, with_usage=False) for t in TEXT], DONE], "completed", "estimated"),
    Case("chat, reasoning and content in one event", CHAT,
         [chat("a", reasoning="thinking…", u=None), chat("b", u=None), DONE],
         "completed", "estimated"),
    Case("chat, cut by the engine before its usage", CHAT, WHOLE_CHAT[:3],
         "upstream_error", "estimated", hide=(True, False), flags="UPE"),
    Case("chat, cut by the client, billed what was delivered", CHAT, WHOLE_CHAT[:4],
         "client_cancelled", "estimated", hide=(True, False), flags="DC",
         cancelled="delivered"),
    Case("chat, the client left after [DONE]", CHAT,
         [*WHOLE_CHAT, usage_only(CHAT_USAGE), DONE], "completed", "reported",
         hide=(True, False), flags="DC"),
    Case("chat, continuous usage, whole", CHAT,
         [*[chat(t, u=usage(11, i + 1)) for i, t in enumerate(TEXT)],
          chat(finish="stop", u=usage(11, 6)), usage_only(usage(11, 6)), DONE],
         "completed", "reported", hide=(True, True)),
    Case("chat, continuous usage, cut by the client", CHAT,
         [chat(t, u=usage(11, 3 * i + 3)) for i, t in enumerate(TEXT[:3])],
         "client_cancelled", "reported", hide=(True, True), flags="DC",
         cancelled="delivered"),
    Case("chat, n=2, one usage chunk for both (vLLM)", CHAT,
         [chat("a", index=0, u=None), chat("bb", index=1, u=None), chat("c", index=0, u=None),
          chat(finish="stop", index=0, u=None), chat(finish="stop", index=1, u=None),
          usage_only(usage(8, 4)), DONE], "completed", "reported", hide=(True, False)),
    Case("chat, n=2, one usage chunk per choice (llama.cpp)", CHAT,
         [chat("a", index=0, u=None), chat("b", index=1, u=None),
          usage_only(usage(7, 1, cached=6)), usage_only(usage(7, 1, cached=6)), DONE],
         "completed", "reported", hide=(True, False)),
    Case("chat, n=2, continuous usage per choice, cut by the engine", CHAT,
         [chat("x", index=0, u=usage(5, 1)), chat("y", index=1, u=usage(5, 1)),
          chat("z", index=0, u=usage(5, 2))], "upstream_error", "reported",
         hide=(False, True), flags="UPE"),
    Case("chat, an error object mid-stream (vLLM), then [DONE]", CHAT,
         [chat("a", u=None), data({"error": {"object": "error", "message": "boom",
                                             "type": "InternalServerError", "code": 500}}),
          DONE], "completed", "estimated"),
    Case("completions, usage injected and hidden", COMPLETIONS,
         [completion("Once"), completion(" upon"), completion("", finish="length"),
          usage_only(usage(4, 2)), DONE], "completed", "reported", hide=(True, False)),
    Case("completions, n=2, usage on each choice's finish event", COMPLETIONS,
         [completion("a", index=0), completion("b", index=1),
          completion("", index=1, finish="length", u=usage(4, 2)),
          completion("", index=0, finish="length", u=usage(2, 2)), DONE],
         "completed", "reported"),
    Case("responses, whole", RESPONSES, responses_stream(["Hi", " thére"]),
         "completed", "reported"),
    Case("responses, cut by the engine", RESPONSES, responses_stream(["Hi", " there"], None),
         "upstream_error", "estimated", flags="UPE"),
    Case("responses, cut by the client", RESPONSES, responses_stream(["Hi", " there"], None),
         "client_cancelled", "estimated", flags="DC", cancelled="none"),
    Case("responses, an error event mid-stream", RESPONSES,
         [*responses_stream(["Hi"], None), named("error", {
             "type": "error", "code": "server_error", "message": "boom"})],
         "upstream_error", "estimated"),
    Case("responses, failed", RESPONSES, responses_stream(["Hi"], "response.failed"),
         "completed", "reported"),
    Case("responses, a 'usage' property in the echoed schema and tools", RESPONSES,
         [*responses_stream(["Hi"], None), named("response.completed", {
             "type": "response.completed", "response": {
                 "id": "r1", "model": MODEL, "status": "completed",
                 "text": {"format": {"type": "json_schema", "name": "bill", "schema": {
                     "type": "object", "properties": {"usage": {
                         "type": "object", "properties": {"prompt_tokens": {
                             "type": "integer", "minimum": 0}}}}}}},
                 "tools": [{"type": "function", "name": "meter", "parameters": {
                     "type": "object", "properties": {"usage": {"type": "string"}}}}],
                 "usage": {"input_tokens": 9, "output_tokens": 6, "total_tokens": 15},
                 "metadata": {"usage": "a client's own"}}})],
         "completed", "reported"),
    Case("responses, reasoning, then cut by the engine", RESPONSES,
         [*responses_stream([], None),
          *(named(kind, {"type": kind, "item_id": "rs1", "output_index": 0, "delta": d})
            for kind, d in [("response.reasoning_text.delta", "Let me"),
                            ("response.reasoning_text.delta", " think"),
                            ("response.reasoning_summary_text.delta", "Thinking"),
                            ("response.output_text.delta", "Hi")])],
         "upstream_error", "estimated", flags="UPE"),
    Case("messages, whole", MESSAGES, messages_stream(4), "completed", "reported"),
    Case("messages, cut by the engine after message_start", MESSAGES,
         messages_stream(3, end=False), "upstream_error", "estimated", flags="UPE"),
    Case("messages, cut by the client, billed what was delivered", MESSAGES,
         messages_stream(5, end=False), "client_cancelled", "estimated", flags="DC",
         cancelled="delivered"),
    Case("messages, an error event mid-stream", MESSAGES,
         [*messages_stream(2, end=False), ANTHROPIC_ERROR], "upstream_error", "estimated"),
    Case("messages, message_delta's input side null", MESSAGES,
         [*messages_stream(2, end=False),
          named("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                  "usage": {"input_tokens": None,
                                            "cache_creation_input_tokens": None,
                                            "cache_read_input_tokens": None,
                                            "output_tokens": 12}}),
          named("message_stop", {"type": "message_stop"})], "completed", "reported"),
    Case("messages, message_delta's output null, then cut", MESSAGES,
         [*messages_stream(2, end=False),
          named("message_delta", {"type": "message_delta", "delta": {"stop_reason": None},
                                  "usage": {"output_tokens": None}})],
         "upstream_error", "estimated", flags="UPE"),
    Case("messages, today's API: server tools, nested cache counts, a cumulative delta",
         MESSAGES, [
             named("message_start", {"type": "message_start", "message": {
                 "id": "msg1", "type": "message", "role": "assistant", "model": MODEL,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": 5, "cache_creation_input_tokens": 3,
                           "cache_read_input_tokens": 2, "cache_creation": {
                               "ephemeral_5m_input_tokens": 3, "ephemeral_1h_input_tokens": 0},
                           "output_tokens": 1, "service_tier": "standard"}}}),
             named("content_block_start", {"type": "content_block_start", "index": 0,
                                           "content_block": {"type": "thinking",
                                                             "thinking": ""}}),
             named("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "thinking_delta",
                                                     "thinking": "Search it."}}),
             named("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "signature_delta",
                                                     "signature": "EqQBCgIYAhIM"}}),
             named("ping", {"type": "ping"}),
             named("content_block_start", {"type": "content_block_start", "index": 1,
                                           "content_block": {"type": "server_tool_use",
                                                             "id": "srvtoolu_1",
                                                             "name": "web_search",
                                                             "input": {}}}),
             named("content_block_delta", {"type": "content_block_delta", "index": 1,
                                           "delta": {"type": "input_json_delta",
                                                     "partial_json": '{"query": "usage"}'}}),
             named("content_block_start", {"type": "content_block_start", "index": 2,
                                           "content_block": {
                                               "type": "web_search_tool_result",
                                               "tool_use_id": "srvtoolu_1", "content": [{
                                                   "type": "web_search_result",
                                                   "title": "output_tokens: 999",
                                                   "url": "https://example.com"}]}}),
             named("content_block_delta", {"type": "content_block_delta", "index": 3,
                                           "delta": {"type": "citations_delta", "citation": {
                                               "type": "web_search_result_location",
                                               "cited_text": "input_tokens 5"}}}),
             named("content_block_delta", {"type": "content_block_delta", "index": 3,
                                           "delta": {"type": "text_delta", "text": "Done."}}),
             named("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": "end_turn"},
                                     "usage": {"input_tokens": 7,
                                               "cache_creation_input_tokens": 3,
                                               "cache_read_input_tokens": 2,
                                               "output_tokens": 40,
                                               "server_tool_use": {"web_search_requests": 1}}}),
             named("message_stop", {"type": "message_stop"})], "completed", "reported"),
    Case("chat, the engine reports zero tokens", CHAT,
         [*WHOLE_CHAT, usage_only(usage(0, 0)), DONE], "completed", "reported",
         hide=(True, False)),
    Case("chat, cut by the client before its first token", CHAT, WHOLE_CHAT[:1],
         "client_cancelled", "estimated", hide=(True, False), flags="DC"),
    Case("chat, a usage object without counts", CHAT,
         [chat("abcd", u=None), data({"id": "c1", "object": "chat.completion.chunk",
                                      "model": MODEL, "choices": [], "usage": {
                                          "prompt_tokens": None, "completion_tokens": None}}),
          DONE], "completed", "estimated", hide=(True, False)),
    Case("responses, whole JSON, an empty usage object", RESPONSES, [orjson.dumps({
        "id": "r1", "object": "response", "model": MODEL, "output": [], "usage": {}})],
         "completed", "estimated", content_type=JSON),
    Case("chat, whole JSON", CHAT, [orjson.dumps({
        "id": "c1", "object": "chat.completion", "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                     "finish_reason": "stop"}], "usage": usage(9, 2, cached=1, reasoning=1)})],
         "completed", "reported", content_type=JSON),
    Case("completions, whole JSON, n=2", COMPLETIONS, [orjson.dumps({
        "id": "k1", "object": "text_completion", "model": MODEL,
        "choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}})],
         "completed", "reported", content_type="application/json; charset=utf-8"),
    Case("responses, whole JSON", RESPONSES, [orjson.dumps({
        "id": "r1", "object": "response", "model": MODEL, "output": [],
        "usage": {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 3},
                  "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 2},
                  "total_tokens": 15}})], "completed", "reported", content_type=JSON),
    Case("messages, whole JSON with cache counts", MESSAGES, [orjson.dumps({
        "id": "msg1", "type": "message", "model": MODEL, "content": [],
        "usage": {"input_tokens": 4, "output_tokens": 7, "cache_read_input_tokens": 10,
                  "cache_creation_input_tokens": 2}})], "completed", "reported",
         content_type=JSON),
    Case("embeddings", EMBEDDINGS, [orjson.dumps({
        "object": "list", "model": MODEL, "data": [],
        "usage": {"prompt_tokens": 6, "total_tokens": 6}})], "completed", "reported",
         content_type=JSON),
    Case("chat, counts written as floats (12.0)", CHAT,
         [chat("a", u=None), data({"id": "c1", "object": "chat.completion.chunk",
                                   "model": MODEL, "choices": [], "usage": {
                                       "prompt_tokens": 12.0, "completion_tokens": 3.0,
                                       "total_tokens": 15.0,
                                       "prompt_tokens_details": {"cached_tokens": 4.0}}}),
          DONE], "completed", "reported", hide=(True, False)),
    Case("embeddings, counts written as floats", EMBEDDINGS, [orjson.dumps({
        "object": "list", "model": MODEL, "data": [],
        "usage": {"prompt_tokens": 6.0, "total_tokens": 6.0}})], "completed", "reported",
         content_type=JSON),
    Case("chat, a count past 64 bits", CHAT,
         [chat("a", u=None), data({"id": "c1", "object": "chat.completion.chunk",
                                   "model": MODEL, "choices": [], "usage": {
                                       "prompt_tokens": 10**19, "completion_tokens": 3,
                                       "total_tokens": 10**19 + 3}}),
          DONE], "completed", "reported", hide=(True, False)),
    Case("embeddings, a count past 64 bits", EMBEDDINGS, [orjson.dumps({
        "object": "list", "model": MODEL, "data": [],
        "usage": {"prompt_tokens": 10**19, "total_tokens": 10**19}})], "completed",
         "reported", content_type=JSON),
    Case("a 400 JSON error", CHAT, [orjson.dumps({
        "object": "error", "message": "bad", "type": "BadRequestError", "code": 400})],
         "completed", "reported", content_type=JSON, status=400),
    Case("a 429 JSON error", RESPONSES, [orjson.dumps({"error": {"message": "slow down"}})],
         "completed", "reported", content_type=JSON, status=429),
    Case("a 500 JSON error", CHAT, [orjson.dumps({"error": {"message": "boom"}})],
         "upstream_error", "reported", content_type=JSON, status=500),
    Case("a 529 Anthropic error", MESSAGES, [orjson.dumps({
        "type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})],
         "upstream_error", "reported", content_type=JSON, status=529),
    Case("chat, CRLF line ends and keepalive comments", CHAT,
         [b": ping\r\n\r\n", *(e.replace(b"\n", b"\r\n") + b": ping\r\n\r\n"
                                for e in [*WHOLE_CHAT, usage_only(CHAT_USAGE), DONE])],
         "completed", "reported", hide=(True, False)),
    Case("chat, [DONE] after a comment in its event, the client left just after", CHAT,
         [*WHOLE_CHAT, usage_only(CHAT_USAGE), b": ping\n" + DONE], "completed", "reported",
         hide=(True, False), flags="DC"),
    Case("chat, [DONE] after an event line, the client left just after", CHAT,
         [*WHOLE_CHAT, usage_only(CHAT_USAGE), b"event: end\r\n" + DONE], "completed",
         "reported", flags="DC"),
    # An SSE client discards a last event without its blank line: so do both sources.
    Case("chat, the last event without its blank line", CHAT,
         [*WHOLE_CHAT, usage_only(CHAT_USAGE)[:-2]], "completed", "estimated",
         hide=(True, False)),
    Case("a whole JSON answer the client left half-way", CHAT,
         [b'{"id":"c1","object":"chat.completion","model":"served-m","choi'],
         "client_cancelled", "estimated", content_type=JSON, flags="DC"),
]


# --- the two sources -----------------------------------------------------------------------

RID = "req-1"
PROMPT_ESTIMATE = 13


def authz(case: Case) -> dict[str, Any]:
    """The Check's metadata, as both sources receive it."""
    md: dict[str, Any] = {"request_id": RID, "key_id": "k", "team": "t", "model": "m",
                          "endpoint": case.endpoint, "stream": case.content_type == SSE,
                          "leased": True, "prompt_estimate": PROMPT_ESTIMATE,
                          "cancelled": case.cancelled}
    hide_usage, hide_continuous = case.hide
    if hide_usage:
        md["hide_usage"] = True
    if hide_continuous:
        md["hide_continuous"] = True
    return md


def pieces(case: Case, size: int | None) -> list[bytes]:
    """The body as chunks: event by event, or `size` bytes at a time (splitting events,
    UTF-8 characters and escapes anywhere)."""
    if size is None:
        return list(case.events)
    body = b"".join(case.events)
    return [body[i:i + size] for i in range(0, len(body), size)]


# The one clock of the timed comparison: chunk i (from 1) is read FIRST_BYTE_US + i * STEP_US
# after the request's start (the record's "start", ext_proc's Meter.started).
START, FIRST_BYTE_US, STEP_US = 1_800_000_000, 50_000, 10


class Clock:
    """ext_proc's time.monotonic, set chunk by chunk (seconds since the request's start)."""

    now = 0.0

    def monotonic(self) -> float:
        return self.now


def via_ext_proc(case: Case, chunks: list[bytes],
                 clock: Clock | None = None) -> tuple[RequestFacts, ResponseFacts]:
    """ext_proc: the Check's facts from the metadata, the status with the first body chunk
    (response headers are skipped), SSE recognised by its first bytes; a cut stream never
    gets end_of_stream, and learns who cut it from Envoy's record (finish_cut). `clock`:
    the meter's time (patched in by the caller), advanced as the fake Envoy's is."""
    x = Exchange()
    x.learn(handoff.read(authz(case), case.endpoint, RID))
    x.meter.injected = Injected(include_usage=case.hide[0], continuous=case.hide[1])
    if clock is not None:
        x.meter.started = 0.0
    for i, chunk in enumerate(chunks):
        if clock is not None:
            clock.now = (FIRST_BYTE_US + (i + 1) * STEP_US) / 1e6
        x.response_body(chunk, i == len(chunks) - 1 and not case.cut,
                        case.status if i == 0 else None)
    flags = frozenset(case.flags.split(",")) if case.flags else frozenset()
    assert x.facts is not None
    return x.facts, x.response(flags)


def json_to_metadata(body: bytes) -> dict[str, Any]:
    """Envoy's json_to_metadata with the gateway's rules: a whole JSON body only; each rule
    whose path is present writes its key (a later rule over an earlier one), numbers as
    doubles."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    out: dict[str, Any] = {}
    for key, path, kind in (*USAGE_RULES, *MODEL_RULES):
        v: Any = doc
        for step in path:
            v = v.get(step) if isinstance(v, dict) else None
        if v is None or isinstance(v, dict | list):
            continue
        out[key] = float(v) if kind.name == "NUMBER" else str(v)
    return out


def plain(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in meta.items()}


def via_envoy(case: Case, chunks: list[bytes]) -> tuple[RequestFacts, ResponseFacts]:
    """Envoy: the Lua filter reads a stream, json_to_metadata a whole JSON answer (never
    one cut short: it reads only at the body's end); the access log renders the record."""
    usage_md: dict[str, Any] = {}
    counted: dict[str, Any] = {}
    if case.content_type == SSE:
        resp = run_response(chunks, {k: v for k, v in authz(case).items()
                                     if k.startswith("hide_")}, content_type=SSE,
                            clock=(START * 1_000_000 + FIRST_BYTE_US, STEP_US))
        usage_md = plain(resp.meta.get("llm.usage", {}))
        counted = plain(resp.meta["llm.stream"])
    elif not case.cut:
        usage_md = json_to_metadata(b"".join(chunks))

    def rendered(md: dict[str, Any]) -> str:
        return orjson.dumps(md).decode() if md else "-"

    attrs = {"rid": RID, "type": "DownstreamEnd", "path": case.endpoint,
             "code": str(case.status), "flags": case.flags or "-", "details": "via_upstream",
             "start": f"{START}.000000", "duration_us": "-" if case.cut else "1000000",
             "total_ms": "1000", "ttft_us": str(FIRST_BYTE_US),
             "gen_us": "-" if case.cut else "900000",
             "authz": orjson.dumps(authz(case)).decode(), "usage": rendered(usage_md),
             "counted": rendered(counted)}
    rec = record.read(attrs)
    assert rec is not None
    return rec.facts, rec.response


def timeless(f: ResponseFacts) -> ResponseFacts:
    """Each source times with its own clocks: only whether a generation time exists is
    theirs to agree on (a stream with content has one)."""
    return replace(f, ttft_ms=0.0, generation_ms=None if f.generation_ms is None else 900.0)


@pytest.mark.parametrize("size", [None, 7, 3],
                         ids=["by-event", "7-byte-chunks", "3-byte-chunks"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_both_sources_give_the_same_facts_and_bill(case: Case, size: int | None) -> None:
    chunks = pieces(case, size)
    x_request, x_response = via_ext_proc(case, chunks)
    e_request, e_response = via_envoy(case, chunks)
    assert x_request == e_request
    assert timeless(x_response) == timeless(e_response)
    x_billed = billing.settle(x_request, timeless(x_response))
    e_billed = billing.settle(e_request, timeless(e_response))
    assert x_billed == e_billed
    assert (x_billed.outcome, x_billed.source) == (case.outcome, case.source)


STREAMS = [c for c in CASES if c.content_type == SSE]


@pytest.mark.parametrize("size", [None, 7, 3],
                         ids=["by-event", "7-byte-chunks", "3-byte-chunks"])
@pytest.mark.parametrize("case", STREAMS, ids=[c.name for c in STREAMS])
def test_both_sources_time_the_first_content_event(case: Case, size: int | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On one clock both sources give the same TTFT: the chunk that completes the first
    content event, not the engine's first byte (a Responses stream's response.created,
    Anthropic's message_start, a role-only chat chunk carry no token). The Envoy source
    once took the first byte (50 ms here) and its TPOT from there."""
    clock = Clock()
    monkeypatch.setattr(meter_mod, "time", clock)
    chunks = pieces(case, size)
    _, x_response = via_ext_proc(case, chunks, clock)
    _, e_response = via_envoy(case, chunks)
    if not x_response.content_events:  # no token: ext_proc has no TTFT, Envoy its first byte
        assert (x_response.ttft_ms, e_response.ttft_ms) == (0.0, FIRST_BYTE_US / 1000)
        return
    assert e_response.ttft_ms == pytest.approx(x_response.ttft_ms)
    first = next(i for i in range(1, len(chunks) + 1)
                 if via_envoy(case, chunks[:i])[1].content_events)
    assert e_response.ttft_ms == pytest.approx((FIRST_BYTE_US + first * STEP_US) / 1000)
    end_ms = 1000.0 if case.cut else 950.0  # the record's last byte (a cut: its end)
    assert e_response.generation_ms == pytest.approx(end_ms - e_response.ttft_ms)


@pytest.mark.parametrize("size", [2 << 20, 5 << 20], ids=["2MiB", "5MiB"])
@pytest.mark.parametrize("hide", [(False, False), (True, False)], ids=["counting", "hiding"])
def test_an_event_past_the_bound_is_passed_on_unread_by_both(hide: tuple[bool, bool],
                                                             size: int) -> None:
    """An event that outgrows 1 MiB without its end (the Lua filter's MAX_HELD) is passed on
    as it came and not counted by either source; ext_proc's rewriting once dropped what it
    had held of it (past its 4 MiB bound) and counted one between the two bounds."""
    big = chat("x" * size, u=None)
    case = Case("big", CHAT, [chat("a", u=None), big, usage_only(CHAT_USAGE), DONE],
                "completed", "reported", hide=hide)
    chunks = pieces(case, 16 << 10)  # Envoy's upstream reads
    _, x_response = via_ext_proc(case, chunks)
    _, e_response = via_envoy(case, chunks)
    assert timeless(x_response) == timeless(e_response)
    assert (x_response.content_events, x_response.usage) == (1, e_response.usage)
    x = Exchange()
    x.learn(handoff.read(authz(case), case.endpoint, RID))
    x.meter.injected = Injected(include_usage=hide[0], continuous=hide[1])
    sent = b"".join(x.response_body(c, i == len(chunks) - 1, 200 if i == 0 else None)
                    for i, c in enumerate(chunks))
    lua = run_response(chunks, {"hide_usage": True} if hide[0] else {}, content_type=SSE)
    assert sent == b"".join(lua.chunks)
    assert big in sent


def test_the_corpus_bills_what_the_engines_said() -> None:
    """A few bills worked out by hand: parity alone would pass two sources equally wrong."""
    by_name = {c.name: c for c in CASES}

    def bill(name: str) -> billing.Billed:
        case = by_name[name]
        request, response = via_envoy(case, pieces(case, None))
        return billing.settle(request, timeless(response))

    u = bill("chat, usage injected and hidden").usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens) == (
        11, 5, 4, 1)
    u = bill("chat, n=2, one usage chunk per choice (llama.cpp)").usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (14, 2, 12)
    u = bill("completions, n=2, usage on each choice's finish event").usage
    assert (u.prompt_tokens, u.completion_tokens) == (6, 4)
    u = bill("chat, n=2, continuous usage per choice, cut by the engine").usage
    assert (u.prompt_tokens, u.completion_tokens) == (10, 3)  # each choice's latest, summed
    b = bill("chat, continuous usage, cut by the client")
    assert b.cancellation.generated_completion_tokens == 9  # the engine's running count
    assert b.usage.completion_tokens == b.cancellation.delivered_completion_tokens < 9
    u = bill("messages, whole").usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_creation_tokens) \
        == (10, 12, 2, 3)
    u = bill("messages, cut by the engine after message_start").usage
    # the input exact; the output estimated: 28 bytes of content as written / 4 > 3 events
    assert (u.prompt_tokens, u.completion_tokens) == (10, 7)
    b = bill("responses, whole")
    assert (b.usage.prompt_tokens, b.usage.completion_tokens, b.usage.reasoning_tokens) == (
        9, 6, 2)
    assert b.served_model == MODEL + "-2"  # the model the usage event names
    assert b.tpot_ms == 900.0 / 5
    u = bill("messages, whole JSON with cache counts").usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (16, 7, 10)
    u = bill("responses, a 'usage' property in the echoed schema and tools").usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (9, 6, 15)
    # what streamed was generated: the reasoning (as chat's reasoning_content), then the
    # text; 22 bytes / 4 > 4 events
    u = bill("responses, reasoning, then cut by the engine").usage
    assert (u.prompt_tokens, u.completion_tokens) == (PROMPT_ESTIMATE, 6)
    assert bill("a whole JSON answer the client left half-way").usage.prompt_tokens == \
        PROMPT_ESTIMATE
    u = bill("messages, today's API: server tools, nested cache counts, a cumulative delta"
             ).usage  # message_delta's input side (after the search) replaces message_start's
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_creation_tokens) \
        == (12, 40, 2, 3)
    u = bill("messages, message_delta's input side null").usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.cache_creation_tokens) \
        == (10, 12, 2, 3)  # message_start's input side stands
    u = bill("chat, counts written as floats (12.0)").usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens) == (
        12, 3, 15, 4)
    assert bill("embeddings, counts written as floats").usage.prompt_tokens == 6
    # no engine's count, and past the event's int64 (its consumer would refuse the event)
    u = bill("chat, a count past 64 bits").usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (0, 3, 3)
    assert bill("embeddings, a count past 64 bits").usage.total_tokens == 0
    # An engine's explicit 0 (e.g. an answer from its own cache) is its count: the content
    # that streamed is not estimated over it (a peer's complaint: LiteLLM #37992).
    b = bill("chat, the engine reports zero tokens")
    assert (b.usage.prompt_tokens, b.usage.completion_tokens, b.usage.total_tokens) == (0, 0, 0)
    # A client gone before the first token: the prompt (the engine read it), no completion,
    # never the reservation's max_tokens (sub2api #4408 bills such a request in full).
    b = bill("chat, cut by the client before its first token")
    assert (b.usage.prompt_tokens, b.usage.completion_tokens) == (PROMPT_ESTIMATE, 0)
    assert b.cancellation.delivered_completion_tokens == 0
