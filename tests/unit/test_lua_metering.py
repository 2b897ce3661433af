"""gateway/envoyconf/lua/metering.lua under LuaJIT (lupa), against a small fake of Envoy's Lua API.

The fake keeps the parts of Envoy 1.40's behaviour the filter depends on, as measured through
the real Envoy (tests/integration/test_lua_through_envoy.py):
* a chunk is sent on when the script asks for the next one; its wrapper, and every
  streamInfo()/dynamicMetadata() wrapper taken meanwhile, then dies ("object used outside of
  proper scope");
* when the body ends with data (possibly an empty end_stream frame) the loop ends inside the
  same resume, so the last chunk is still live after it; when it ends with trailers it is not;
* headers can no longer be changed once body iteration has begun;
* getBytes(index, length) refuses a range past the end;
* timestampString(EnvoyTimestampResolution.MICROSECOND) is the time (epoch µs, a string) the
  current chunk is read at: here `base + step * its index` (1-based), the fake's clock.

Expected outputs come from a model of each generated event (what it is, what it looks like
without each injected member), not from a second parser.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.envoyconf import lua as envoy_lua

try:
    import lupa.luajit21 as lupa_rt  # the runtime Envoy uses
except ImportError:  # pragma: no cover - wheels without LuaJIT
    import lupa.lua51 as lupa_rt

AUTHZ = b"envoy.filters.http.ext_authz"
STREAM = b"llm.stream"

FAKE_ENVOY = rb"""
local DEAD = "object used outside of proper scope"

local function wrapper(state, obj)
  -- Every wrapper dies when the script yields for the next chunk, as in Envoy.
  obj._dead = false
  state.live[#state.live + 1] = obj
  return obj
end

local function check(self) if self._dead then error(DEAD) end end

local function kill_all(state)
  for i = 1, #state.live do state.live[i]._dead = true end
  state.live = {}
end

function fake_buffer(state, bytes)
  local b = { _bytes = bytes }
  function b:length() check(self); return #self._bytes end
  function b:getBytes(i, n)
    check(self)
    if i < 0 or n < 0 or i + n > #self._bytes then
      error("index/length must be >= 0 and (index + length) must be <= buffer size")
    end
    return string.sub(self._bytes, i + 1, i + n)
  end
  function b:setBytes(s) check(self); self._bytes = s; return #s end
  return wrapper(state, b)
end

local function fake_headers(state, map)
  local h = {}
  local function writable()
    if state.headers_sent then error("headers can no longer be modified") end
  end
  function h:get(k) return map[string.lower(k)] end
  function h:replace(k, v) writable(); map[string.lower(k)] = v end
  function h:add(k, v) writable(); map[string.lower(k)] = v end
  function h:remove(k) writable(); map[string.lower(k)] = nil end
  return h
end

local function fake_stream_info(state)
  local si = {}
  function si:dynamicMetadata()
    check(self)
    local m = {}
    function m:get(ns)
      check(self)
      local t = state.meta[ns]
      if t == nil then return nil end
      local copy = {}
      for k, v in pairs(t) do copy[k] = v end
      return copy
    end
    function m:set(ns, k, v)
      check(self)
      state.meta[ns] = state.meta[ns] or {}
      state.meta[ns][k] = v
    end
    return wrapper(state, m)
  end
  return wrapper(state, si)
end

local function snapshot(state)
  local s = state.meta["llm.stream"]
  if s == nil then return { false, false } end
  return { s.content_events or false, s.content_chars or false }
end

-- Envoy defines it for a running script (it is nil while the script's file loads).
EnvoyTimestampResolution = { MILLISECOND = 0, MICROSECOND = 1 }

-- A response: `chunks` arrive one by one; `trailers` ends the body with trailers. Chunk i
-- is read at clock_base + i * clock_step (epoch microseconds).
function fake_response(headers, chunks, meta, trailers, clock_base, clock_step)
  local state = { live = {}, meta = meta, out = {}, snaps = {}, chunks_called = false,
                  stamps = 0 }
  local handle = {}
  local i, current = 0, nil
  function handle:timestampString(resolution)
    if resolution ~= EnvoyTimestampResolution.MICROSECOND then
      error("the fake's clock answers in microseconds only")
    end
    state.stamps = state.stamps + 1
    return string.format("%.0f", clock_base + i * clock_step)
  end
  local function deliver()
    state.out[#state.out + 1] = current._bytes
    state.snaps[#state.snaps + 1] = snapshot(state)
  end
  function handle:headers() return fake_headers(state, headers) end
  function handle:streamInfo() return fake_stream_info(state) end
  function handle:bodyChunks()
    state.chunks_called = true
    state.headers_sent = true
    return function()
      if current ~= nil and (i < #chunks or trailers) then
        deliver()  -- the script yields: Envoy sends the chunk on, and its wrappers die
        kill_all(state)
        current = nil
      end
      i = i + 1
      if i > #chunks then return nil end
      current = fake_buffer(state, chunks[i])
      return current
    end
  end
  function state.finish()
    if not state.chunks_called then
      -- The script returned without iterating: Envoy forwards the body as it comes.
      for k = 1, #chunks do state.out[k] = chunks[k] end
    elseif current ~= nil then
      deliver()  -- the end_stream chunk leaves when the script ends
    end
    kill_all(state)
  end
  return handle, state
end

function run_response(headers, chunks, meta, trailers, clock_base, clock_step)
  local handle, state = fake_response(headers, chunks, meta, trailers, clock_base, clock_step)
  envoy_on_response(handle)
  state.finish()
  return state
end

function run_request(headers, body, meta)
  local state = { live = {}, meta = meta, body_called = false }
  local handle = {}
  local buf = body and fake_buffer(state, body) or nil
  function handle:headers() return fake_headers(state, headers) end
  function handle:streamInfo() return fake_stream_info(state) end
  function handle:body() state.body_called = true; return buf end
  envoy_on_request(handle)
  state.body = buf and buf._bytes or nil
  return state
end
"""


def new_runtime() -> Any:
    lua = lupa_rt.LuaRuntime(encoding=None, unpack_returned_tuples=True)
    lua.execute(envoy_lua.source().encode())
    lua.execute(FAKE_ENVOY)
    return lua


LUA = new_runtime()


def seq(table: Any) -> list[Any]:
    """A Lua array in order."""
    return [table[i] for i in range(1, len(table) + 1)]


def lua_table(value: Any) -> Any:
    """Python dict/list (str keys) as a Lua table (bytes keys), recursively."""
    if isinstance(value, dict):
        return LUA.table_from({k.encode(): lua_table(v) for k, v in value.items()})
    if isinstance(value, str):
        return value.encode()
    return value


# The fake's clock: chunk i is read at CLOCK_BASE + i * CLOCK_STEP epoch µs.
CLOCK_BASE, CLOCK_STEP = 1_800_000_000_050_000, 1_000


@dataclass
class Response:
    chunks: list[bytes]  # what the client receives, chunk by chunk
    counters: list[tuple[Any, Any]]  # (content_events, content_chars) as each chunk left
    headers: dict[str, bytes]
    meta: dict[str, Any]
    chunks_called: bool
    stamps: int  # times the script read the clock (timestampString)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def final(self) -> tuple[Any, Any]:
        stream = self.meta.get("llm.stream", {})
        return stream.get("content_events"), stream.get("content_chars")


def run_response(
    chunks: Sequence[bytes],
    facts: dict[str, Any] | None = None,
    content_type: str | None = "text/event-stream",
    trailers: bool = False,
    extra_headers: dict[str, str] | None = None,
    clock: tuple[int, int] = (CLOCK_BASE, CLOCK_STEP),
) -> Response:
    headers = {":status": "200", **(extra_headers or {})}
    if content_type is not None:
        headers["content-type"] = content_type
    meta = {"envoy.filters.http.ext_authz": facts} if facts is not None else {}
    lua_headers = lua_table(headers)
    state = LUA.globals().run_response(
        lua_headers, LUA.table_from(list(chunks)), lua_table(meta), trailers, *clock
    )
    counters = [
        (None if s[1] is False else s[1], None if s[2] is False else s[2])
        for s in seq(state.snaps)
    ]
    out_meta = {
        ns.decode(): {k.decode(): v for k, v in t.items()} for ns, t in state.meta.items()
    }
    return Response(
        chunks=seq(state.out),
        counters=counters,
        headers={k.decode(): v for k, v in lua_headers.items()},
        meta=out_meta,
        chunks_called=bool(state.chunks_called),
        stamps=int(state.stamps),
    )


def run_request(
    body: bytes | None, facts: dict[str, Any] | None, headers: dict[str, str] | None = None
) -> tuple[bytes | None, dict[str, bytes], bool]:
    lua_headers = lua_table({":method": "POST", **(headers or {})})
    meta = {"envoy.filters.http.ext_authz": facts} if facts is not None else {}
    state = LUA.globals().run_request(lua_headers, body, lua_table(meta))
    return (
        state.body,
        {k.decode(): v for k, v in lua_headers.items()},
        bool(state.body_called),
    )


# --- a model of the events an engine sends -------------------------------------------------

USAGE_OBJ = (
    '{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10,'
    '"prompt_tokens_details":{"cached_tokens":0}}'
)


@dataclass(frozen=True)
class Event:
    """One SSE event as the engine sends it, and what the filter must make of it."""

    raw: bytes
    without_null: bytes  # the event after hide_usage ("" when it is the usage-only chunk)
    without_obj: bytes  # after hide_continuous
    without_both: bytes  # after both
    chars: int  # content bytes counted (0: not a content event)

    def expected(self, hide_usage: bool, hide_continuous: bool) -> bytes:
        if hide_usage and hide_continuous:
            return self.without_both
        if hide_usage:
            return self.without_null
        if hide_continuous:
            return self.without_obj
        return self.raw


@dataclass(frozen=True)
class Layout:
    spaced: bool  # ", " and ": " between members, as Python's json.dumps writes
    crlf: bool  # \r\n line ends

    def obj(self, members: Sequence[tuple[str, str]]) -> str:
        sep, colon = (", ", ": ") if self.spaced else (",", ":")
        return "{" + sep.join(f'"{k}"{colon}{v}' for k, v in members) + "}"

    def event(self, *lines: str) -> bytes:
        eol = "\r\n" if self.crlf else "\n"
        return ("".join(line + eol for line in lines) + eol).encode()


def js(text: str | None) -> str:
    return "null" if text is None else json.dumps(text, ensure_ascii=False)


def js_len(text: str | None) -> int:
    return len(js(text).encode()) - 2 if text else 0


def with_usage(
    layout: Layout, members: list[tuple[str, str]], usage: str | None, first: bool, chars: int
) -> Event:
    """A choices-bearing event, with an optional "usage" member (null or an object)."""

    def render(keep: bool) -> bytes:
        ms = list(members)
        if usage is not None and keep:
            ms.insert(0, ("usage", usage)) if first else ms.append(("usage", usage))
        return layout.event("data: " + layout.obj(ms))

    raw, bare = render(True), render(False)
    is_null, is_obj = usage == "null", usage is not None and usage != "null"
    return Event(
        raw=raw,
        without_null=bare if is_null else raw,
        without_obj=bare if is_obj else raw,
        without_both=bare if usage is not None else raw,
        chars=chars,
    )


def unchanged(raw: bytes, chars: int = 0) -> Event:
    return Event(raw, raw, raw, raw, chars)


HEAD = [("id", '"chatcmpl-1"'), ("object", '"chat.completion.chunk"'), ("created", "1"),
        ("model", '"m"')]

# Texts chosen to trip naive matching: key names, quotes, escapes, blank lines, UTF-8.
tricky = st.sampled_from([
    '"usage":null', '"usage": {"a": 1}', '"choices":[]', "data: [DONE]\n\n", "\\", '"',
    "é", "漢字", "🙂", "\r\n\r\n", "}", "{", '"content":"x"',
])
texts = st.one_of(
    st.none(),
    st.just(""),
    st.text(min_size=1, max_size=12),
    st.lists(tricky, min_size=1, max_size=3).map("".join),
)
usages = st.sampled_from([None, "null", USAGE_OBJ])


@st.composite
def chat_events(draw: st.DrawFn, layout: Layout) -> Event:
    content, reasoning = draw(texts), draw(st.one_of(st.none(), texts))
    delta = [("content", js(content))]
    if reasoning is not None:
        delta.append(("reasoning_content", js(reasoning)))
    choice = layout.obj([("index", "0"), ("delta", layout.obj(delta)), ("finish_reason", "null")])
    members = [*HEAD, ("choices", f"[{choice}]")]
    chars = js_len(content) + js_len(reasoning)
    return with_usage(layout, members, draw(usages), draw(st.booleans()), chars)


@st.composite
def completion_events(draw: st.DrawFn, layout: Layout) -> Event:
    text = draw(texts)
    choice = layout.obj([("index", "0"), ("text", js(text)), ("logprobs", "null"),
                         ("finish_reason", "null")])
    members = [*HEAD, ("choices", f"[{choice}]")]
    return with_usage(layout, members, draw(usages), draw(st.booleans()), js_len(text))


@st.composite
def usage_only_events(draw: st.DrawFn, layout: Layout) -> Event:
    empty = draw(st.sampled_from(["[]", "[ ]"]))
    raw = layout.event("data: " + layout.obj([*HEAD, ("choices", empty), ("usage", USAGE_OBJ)]))
    return Event(raw, without_null=b"", without_obj=raw, without_both=b"", chars=0)


@st.composite
def responses_events(draw: st.DrawFn, layout: Layout) -> Event:
    kind = draw(st.sampled_from(["delta", "done", "completed"]))
    text = draw(texts.filter(lambda t: t is not None))
    if kind == "delta":
        body = layout.obj([("type", '"response.output_text.delta"'), ("item_id", '"i"'),
                           ("output_index", "0"), ("delta", js(text))])
        return unchanged(layout.event("event: response.output_text.delta", "data: " + body),
                         js_len(text))
    if kind == "done":  # repeats the whole text: must not count again
        body = layout.obj([("type", '"response.output_text.done"'), ("text", js(text))])
        return unchanged(layout.event("event: response.output_text.done", "data: " + body))
    part = layout.obj([("type", '"output_text"'), ("text", js(text))])
    resp = layout.obj([("id", '"r"'), ("output", f'[{layout.obj([("content", f"[{part}]")])}]'),
                       ("usage", '{"input_tokens":3,"output_tokens":1}')])
    body = layout.obj([("type", '"response.completed"'), ("response", resp)])
    return unchanged(layout.event("event: response.completed", "data: " + body))


@st.composite
def other_events(draw: st.DrawFn, layout: Layout) -> Event:
    line = draw(st.sampled_from([
        "data: [DONE]", ": keep-alive", 'data: {"error":{"message":"overloaded"}}',
        "event: ping",
    ]))
    return unchanged(layout.event(line))


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[Event], bytes]:
    """Events, and an unterminated tail (b"" or the start of one more event)."""
    layout = Layout(spaced=draw(st.booleans()), crlf=draw(st.booleans()))
    kinds = [chat_events, completion_events, usage_only_events, responses_events, other_events]
    event = st.one_of(*(k(layout) for k in kinds))
    events = draw(st.lists(event, max_size=8))
    tail = b""
    if draw(st.booleans()):
        last = draw(event).raw.rstrip(b"\r\n")
        tail = last[: draw(st.integers(1, len(last)))]
    return events, tail


@st.composite
def splits(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """`data` cut at arbitrary byte positions, with an empty end_stream frame sometimes."""
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=12)))
    cuts = [c for c in cuts if c < len(data)]
    edges = [0, *cuts, len(data)]
    chunks = [data[a:b] for a, b in itertools.pairwise(edges)]
    if draw(st.booleans()):
        chunks.append(b"")
    return chunks


flags = st.tuples(st.booleans(), st.booleans())


def facts_for(hide_usage: bool, hide_continuous: bool) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    if hide_usage:
        facts["hide_usage"] = True
    if hide_continuous:
        facts["hide_continuous"] = True
    return facts


def expected_counters(events: Sequence[Event]) -> tuple[int, int]:
    counted = [e.chars for e in events if e.chars > 0]
    return len(counted), sum(counted)


PROPERTY = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


# --- response: properties ------------------------------------------------------------------


@PROPERTY
@given(data=st.data(), stream=streams(), hide=flags)
def test_any_split_gives_the_models_bytes_and_counters(
    data: st.DataObject, stream: tuple[list[Event], bytes], hide: tuple[bool, bool]
) -> None:
    events, tail = stream
    raw = b"".join(e.raw for e in events) + tail
    chunks = data.draw(splits(raw))
    resp = run_response(chunks, facts_for(*hide))

    assert resp.body == b"".join(e.expected(*hide) for e in events) + tail
    assert resp.final == expected_counters(events)
    assert len(resp.chunks) == len(chunks)


@PROPERTY
@given(data=st.data(), stream=streams(), hide=flags)
def test_each_chunk_carries_exactly_the_events_completed_so_far(
    data: st.DataObject, stream: tuple[list[Event], bytes], hide: tuple[bool, bool]
) -> None:
    """Chunk by chunk: bytes sent so far and the published counters cover exactly the events
    whose blank line has arrived (a stream can be cut, and the log read, at any chunk)."""
    events, tail = stream
    raw = b"".join(e.raw for e in events) + tail
    chunks = data.draw(splits(raw))
    rewriting = any(hide)
    resp = run_response(chunks, facts_for(*hide))

    ends, pos = [], 0
    for e in events:
        pos += len(e.raw)
        ends.append(pos)
    received, sent = 0, b""
    for i, (chunk_in, chunk_out) in enumerate(zip(chunks, resp.chunks, strict=True)):
        received += len(chunk_in)
        done = [e for e, end in zip(events, ends, strict=True) if end <= received]
        sent += chunk_out
        if not rewriting:
            assert chunk_out == chunk_in  # counting alone never touches or holds a byte
        elif i < len(chunks) - 1:
            assert sent == b"".join(e.expected(*hide) for e in done)
        assert resp.counters[i] == expected_counters(done)


@PROPERTY
@given(data=st.data(), stream=streams(), hide=flags)
def test_split_does_not_matter(
    data: st.DataObject, stream: tuple[list[Event], bytes], hide: tuple[bool, bool]
) -> None:
    """The same stream in one piece and in arbitrary pieces: identical bytes and counters."""
    events, tail = stream
    raw = b"".join(e.raw for e in events) + tail
    whole = run_response([raw], facts_for(*hide))
    split = run_response(data.draw(splits(raw)), facts_for(*hide))
    assert split.body == whole.body
    assert split.final == whole.final


@settings(max_examples=100, deadline=None)
@given(data=st.data(), payload=st.binary(max_size=300), hide=flags)
def test_arbitrary_bytes_never_break_the_stream(
    data: st.DataObject, payload: bytes, hide: tuple[bool, bool]
) -> None:
    """Not SSE at all (binary, lone \\r, invalid UTF-8): no error, and split-independent."""
    whole = run_response([payload], facts_for(*hide))
    split = run_response(data.draw(splits(payload)), facts_for(*hide))
    assert split.body == whole.body
    if not any(hide):
        assert whole.body == payload


# --- response: examples --------------------------------------------------------------------

CHAT = [
    b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],'
    b'"usage":null}\n\n',
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hel"}}],"usage":null}\n\n',
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"lo \\u00e9"}}],'
    b'"usage":null}\n\n',
    b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]


def test_hide_usage_drops_the_usage_chunk_and_usage_null() -> None:
    resp = run_response(CHAT, {"hide_usage": True})
    assert resp.body == (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"lo \\u00e9"}}]}\n\n'
        b"data: [DONE]\n\n"
    )
    assert resp.final == (2, 3 + 9)  # escapes count as written
    assert resp.chunks[3] == b""


def test_no_flag_changes_no_byte_but_counts() -> None:
    resp = run_response(CHAT, {})
    assert resp.chunks == CHAT
    assert resp.final == (2, 12)
    assert resp.counters == [(0, 0), (1, 3), (2, 12), (2, 12), (2, 12)]


def test_no_authz_metadata_at_all_counts_only() -> None:
    resp = run_response(CHAT, None)
    assert resp.chunks == CHAT
    assert resp.final == (2, 12)


def test_hide_continuous_strips_usage_objects_from_events_with_choices() -> None:
    chunks = [
        b'data: {"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":5,'
        b'"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}\r\n\r\n',
        b'data: {"usage": {"prompt_tokens": 5}, "choices": [{"delta": {"content": "b"}}]}'
        b"\r\n\r\n",
        b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\r\n\r\n',
    ]
    resp = run_response(chunks, {"hide_continuous": True})
    assert resp.body == (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n'
        b'data: {"choices": [{"delta": {"content": "b"}}]}\r\n\r\n'
        + chunks[2]  # the client asked for include_usage itself: its chunk stays
    )
    both = run_response(chunks, {"hide_continuous": True, "hide_usage": True})
    assert both.body == resp.body[: -len(chunks[2])]


def test_responses_api_usage_is_never_touched() -> None:
    completed = (
        b'event: response.completed\ndata: {"type":"response.completed","response":'
        b'{"output":[{"content":[{"type":"output_text","text":"hi"}]}],'
        b'"usage":{"input_tokens":3,"output_tokens":1}}}\n\n'
    )
    delta = (
        b'event: response.output_text.delta\n'
        b'data: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    )
    resp = run_response([delta, completed], {"hide_usage": True, "hide_continuous": True})
    assert resp.body == delta + completed
    assert resp.final == (1, 2)


@pytest.mark.parametrize(
    "content_type", ["application/json", "text/plain", None, "text/html; x=text/event-stream"]
)
@pytest.mark.parametrize("hide", [(True, True), (False, False)])
def test_other_responses_pass_untouched_and_unheld(
    content_type: str | None, hide: tuple[bool, bool]
) -> None:
    """A JSON error must not lose or wait for a byte: the script never iterates its body."""
    body = [b'{"error": {"message": "no', b' such model"}, "usage": null}']
    resp = run_response(body, facts_for(*hide), content_type=content_type,
                        extra_headers={"content-length": "52"})
    assert resp.chunks == body
    assert not resp.chunks_called
    # a whole 2xx JSON answer: only its size (the record's fallback when its usage is unread)
    assert resp.meta.get("llm.stream", {}) == (
        {"content_chars": 52} if content_type == "application/json" else {})
    assert resp.headers["content-length"] == b"52"


@pytest.mark.parametrize(("status", "ctype", "length"), [
    ("400", "application/json", "52"), ("500", "application/json", "52"),
    ("200", "application/json", None), ("200", "application/json", "x"),
    ("200", "text/plain", "52"), ("200", "application/jsonx", "52")])
def test_only_a_sized_2xx_json_answer_publishes_its_size(status: str, ctype: str,
                                                         length: str | None) -> None:
    body = [b'{"error": {"message": "no such model"}}']
    extra = {":status": status} if length is None else {":status": status,
                                                         "content-length": length}
    resp = run_response(body, None, content_type=ctype, extra_headers=extra)
    assert resp.chunks == body and not resp.chunks_called
    if ctype == "application/jsonx" and status == "200":  # a prefix match, as json_to_metadata
        assert resp.meta["llm.stream"] == {"content_chars": 52}
        return
    assert "llm.stream" not in resp.meta


@pytest.mark.parametrize(
    "content_type", ["text/event-stream; charset=utf-8", "Text/Event-Stream"]
)
def test_event_stream_content_type_variants(content_type: str) -> None:
    resp = run_response(CHAT, {"hide_usage": True}, content_type=content_type)
    assert b'"usage"' not in resp.body
    assert resp.final == (2, 12)


def test_rewriting_drops_content_length_counting_keeps_it() -> None:
    raw = b"".join(CHAT)
    cl = {"content-length": str(len(raw))}
    assert "content-length" not in run_response([raw], {"hide_usage": True},
                                                extra_headers=cl).headers
    assert run_response([raw], {}, extra_headers=cl).headers["content-length"] == b"%d" % len(raw)


def test_tail_is_held_then_flushed_on_the_last_chunk() -> None:
    chunks = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"cho', b"ices", b""]
    resp = run_response(chunks, {"hide_usage": True})
    assert resp.chunks == [
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b"", b'data: {"choices'
    ]
    assert resp.final == (1, 1)


def test_trailers_end_loses_only_the_unterminated_tail() -> None:
    """Ending with trailers, the last data chunk is gone before the loop ends: the held
    tail cannot be flushed (measured in Envoy 1.40 too); the script must not fail."""
    chunks = [b"data: [DONE]\n\ndata: {", b"}"]
    resp = run_response(chunks, {"hide_usage": True}, trailers=True)
    assert resp.body == b"data: [DONE]\n\n"
    counting = run_response(chunks, {}, trailers=True)
    assert counting.body == b"".join(chunks)


def test_crlf_split_inside_the_blank_line() -> None:
    event = b'data: {"choices":[{"delta":{"content":"xy"}}],"usage":null}\r\n\r\n'
    for cut in range(len(event) - 4, len(event)):
        resp = run_response([event[:cut], event[cut:]], {"hide_usage": True})
        assert resp.chunks == [b"", event.replace(b',"usage":null', b"")]
        assert resp.counters == [(0, 0), (1, 2)]


def test_oversized_event_passes_through_instead_of_being_held_forever() -> None:
    big = b'data: {"choices":[{"delta":{"content":"' + b"x" * (1024 * 1024) + b'"}}]}'
    chunks = [big[i: i + 65536] for i in range(0, len(big), 65536)]
    chunks += [b"\n\n", b'data: {"choices":[{"delta":{"content":"ab"}}],"usage":null}\n\n']
    resp = run_response(chunks, {"hide_usage": True})
    assert resp.body == big + b'\n\ndata: {"choices":[{"delta":{"content":"ab"}}]}\n\n'
    assert max(len(c) for c in resp.chunks) <= 1024 * 1024 + 65536  # released, not hoarded
    assert resp.final == (1, 2)  # the oversized event is not counted


# --- request: splice ------------------------------------------------------------------------

BODY = b'{"model":"m","messages":[{"role":"user","content":"h\xc3\xa9"}],"stream":true}'
INJECT = b',"stream_options":{"include_usage":true}'


def test_splice_inserts_at_the_offset_and_sets_content_length() -> None:
    at = len(BODY) - 1
    body, headers, _ = run_request(BODY, {"splice": INJECT, "splice_at": at, "splice_cut": 0},
                                   {"content-length": str(len(BODY))})
    assert body == BODY[:at] + INJECT + BODY[at:]
    assert headers["content-length"] == str(len(body)).encode()


def test_splice_replaces_the_cut_bytes() -> None:
    old = b'"stream_options":{"include_usage":false}'
    src = b'{"stream":true,' + old + b',"model":"m"}'
    new = b'"stream_options":{"include_usage":true}'
    body, headers, _ = run_request(src, {"splice": new, "splice_at": src.index(old),
                                         "splice_cut": len(old)})
    assert body == src.replace(old, new)
    assert headers["content-length"] == str(len(body)).encode()


@pytest.mark.parametrize(
    "facts",
    [
        {"splice": INJECT, "splice_at": len(BODY) + 1},
        {"splice": INJECT, "splice_at": len(BODY) - 2, "splice_cut": 3},
        {"splice": INJECT, "splice_at": -1},
        {"splice": INJECT, "splice_at": float("nan")},
        {"splice": INJECT},
        {"splice": INJECT, "splice_at": 1, "splice_cut": "x"},
    ],
)
def test_splice_that_does_not_fit_leaves_the_body_alone(facts: dict[str, Any]) -> None:
    body, headers, _ = run_request(BODY, facts, {"content-length": str(len(BODY))})
    assert body == BODY
    assert headers["content-length"] == str(len(BODY)).encode()


@pytest.mark.parametrize("facts", [None, {}, {"hide_usage": True}, {"splice": 5}])
def test_no_splice_never_buffers_the_body(facts: dict[str, Any] | None) -> None:
    body, _, body_called = run_request(BODY, facts)
    assert body == BODY
    assert not body_called


def test_splice_on_an_empty_request_is_a_no_op() -> None:
    body, headers, _ = run_request(None, {"splice": INJECT, "splice_at": 0})
    assert body is None
    assert "content-length" not in headers


def test_splice_offsets_may_arrive_as_doubles() -> None:
    body, _, _ = run_request(b"[]", {"splice": b"1", "splice_at": 1.0, "splice_cut": 0.0})
    assert body == b"[1]"


@settings(max_examples=300, deadline=None)
@given(src=st.binary(max_size=200), splice=st.binary(max_size=50), data=st.data())
def test_splice_is_byte_exact(src: bytes, splice: bytes, data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(src) + 2))
    cut = data.draw(st.integers(0, 5))
    facts: dict[str, Any] = {"splice": splice, "splice_at": at}
    if cut or data.draw(st.booleans()):
        facts["splice_cut"] = cut
    body, headers, _ = run_request(src, facts)
    if at + cut <= len(src):
        assert body == src[:at] + splice + src[at + cut:]
        assert headers["content-length"] == str(len(body or b"")).encode()
    else:
        assert body == src


# --- hygiene -------------------------------------------------------------------------------


def test_script_defines_no_other_globals() -> None:
    """Envoy shares one Lua state per worker: a stray global leaks between requests."""
    lua = lupa_rt.LuaRuntime(encoding=None)
    before = set(lua.globals().keys())
    lua.execute(envoy_lua.source().encode())
    assert set(lua.globals().keys()) - before == {b"envoy_on_request", b"envoy_on_response"}
    lua.execute(FAKE_ENVOY)
    loaded = set(lua.globals().keys())
    g = lua.globals()
    g.run_response(lua.table_from({b"content-type": b"text/event-stream"}),
                   lua.table_from([b"data: {\"text\":\"a\"}\n\nda", b"ta: x"]),
                   lua.table_from({AUTHZ: lua.table_from({b"hide_usage": True})}), False,
                   CLOCK_BASE, CLOCK_STEP)
    g.run_request(lua.table_from({}), b"{}",
                  lua.table_from({AUTHZ: lua.table_from({b"splice": b"1", b"splice_at": 1})}))
    assert set(lua.globals().keys()) == loaded


def test_runs_on_the_same_lua_dialect_as_envoy() -> None:
    assert LUA.eval(b"_VERSION") == b"Lua 5.1"


def test_source_helper_reads_the_packaged_file() -> None:
    assert envoy_lua.source().startswith("-- metering.lua")
    assert envoy_lua.source("metering.lua") == envoy_lua.source()


def test_the_engines_end_marker_is_published_as_done() -> None:
    """A client that hangs up right after `[DONE]` got everything: the record says so."""
    resp = run_response(CHAT[:-1], {})
    assert "done" not in resp.meta["llm.stream"]
    resp = run_response(CHAT, {"hide_usage": True})
    assert resp.meta["llm.stream"]["done"] is True
    for kind in (b"response.completed", b"response.incomplete", b"response.failed"):
        ev = b'data: {"type":"' + kind + b'","response":{"usage":null}}\n\n'
        assert run_response([ev], {}).meta["llm.stream"].get("done") is True
    for kind in (b"response.created", b"response.in_progress", b"response.output_text.done"):
        ev = b'data: {"type":"' + kind + b'","response":{}}\n\n'
        assert "done" not in run_response([ev], {}).meta["llm.stream"], kind
    assert "done" not in run_response([b'data: {"content":"[DONE]"}\n\n'], {}).meta["llm.stream"]


ANTHROPIC = [
    b'event: message_start\ndata: {"type":"message_start","message":{"model":"m","content":[],'
    b'"usage":{"input_tokens":5,"output_tokens":1}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"text","text":""}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hello"}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
    b'"delta":{"type":"thinking_delta","thinking":"hmm"}}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":2,'
    b'"delta":{"type":"input_json_delta","partial_json":"{\\"a\\":"}}\n\n',
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
    b'"usage":{"output_tokens":3}}\n\n',
]
MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
ERROR = (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
         b'"message":"Overloaded"}}\n\n')


def test_anthropic_streams_count_their_deltas_end_at_message_stop_and_fail_on_error() -> None:
    cut = run_response(ANTHROPIC, {})
    stream = cut.meta["llm.stream"]
    assert (stream["content_events"], stream["content_chars"]) == (3, 5 + 3 + 7)
    assert "done" not in stream and "failed" not in stream
    assert cut.body == b"".join(ANTHROPIC)  # never rewritten, nothing held back
    assert run_response([*ANTHROPIC, MESSAGE_STOP], {}).meta["llm.stream"]["done"] is True
    failed = run_response([*ANTHROPIC[:3], ERROR], {}).meta["llm.stream"]
    assert failed["failed"] is True and "done" not in failed
    # the nested error object's own "type" is not the event's
    ok = b'data: {"type":"x","error":{"type":"overloaded_error"}}\n\n'
    assert "failed" not in run_response([ok], {}).meta["llm.stream"]


# --- usage and the served model, read from the stream (llm.usage) ---------------------------

CHAT_USAGE = (b'data: {"id":"c","model":"served-\\/m","choices":[],"usage":{"prompt_tokens":7,'
              b'"completion_tokens":3,"total_tokens":10,"prompt_tokens_details":'
              b'{"cached_tokens":2},"completion_tokens_details":{"reasoning_tokens":1}}}\n\n')


def usage_of(resp: Response) -> dict[str, Any]:
    """llm.usage with Lua strings (bytes under lupa) decoded."""
    return {k: v.decode() if isinstance(v, bytes) else v
            for k, v in resp.meta.get("llm.usage", {}).items()}


def test_usage_and_the_served_model_are_read_from_the_stream() -> None:
    first = b'data: {"id":"c","model":"served-\\/m","choices":[{"delta":{"content":"a"}}]}\n\n'
    usage = usage_of(run_response([first, CHAT_USAGE, b"data: [DONE]\n\n"], {}))
    assert usage == {"model": "served-/m", "prompt_tokens": 7, "completion_tokens": 3,
                     "total_tokens": 10, "cached_tokens": 2, "reasoning_tokens": 1}
    # `"usage": null` chunks and streams that never report carry no numbers
    assert usage_of(run_response(CHAT[:3], {})).keys() <= {"model"}


def test_continuous_usage_leaves_the_latest_numbers() -> None:
    chunks = [b'data: {"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":4,'
              b'"completion_tokens":%d,"total_tokens":%d}}\n\n' % (i, 4 + i) for i in (1, 2, 3)]
    usage = usage_of(run_response(chunks, {}))
    assert (usage["completion_tokens"], usage["total_tokens"]) == (3, 7)


def test_responses_api_and_anthropic_usage() -> None:
    done = (b'event: response.completed\ndata: {"type":"response.completed","response":{'
            b'"model":"r","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":4},'
            b'"output_tokens":5,"output_tokens_details":{"reasoning_tokens":2},'
            b'"total_tokens":14}}}\n\n')
    assert usage_of(run_response([done], {})) == {
        "model": "r", "prompt_tokens": 9, "cached_tokens": 4, "completion_tokens": 5,
        "reasoning_tokens": 2, "total_tokens": 14}
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"model":"a",'
             b'"usage":{"input_tokens":5,"cache_creation_input_tokens":3,'
             b'"cache_read_input_tokens":2,"output_tokens":1}}}\n\n')
    delta = (b'event: message_delta\ndata: {"type":"message_delta","delta":{},'
             b'"usage":{"output_tokens":12}}\n\n')
    cut = usage_of(run_response([start], {}))
    assert "completion_tokens" not in cut  # message_start's output count is not the answer's
    assert cut["prompt_tokens"] == 5 and cut["cache_read_input_tokens"] == 2
    whole = usage_of(run_response([start, delta, MESSAGE_STOP], {}))
    assert whole == {"model": "a", "prompt_tokens": 5, "cache_creation_input_tokens": 3,
                     "cache_read_input_tokens": 2, "completion_tokens": 12}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_split_reads_the_same_usage(data: st.DataObject) -> None:
    body = (b'data: {"model":"m","choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
            + CHAT_USAGE + b"data: [DONE]\n\n")
    whole = usage_of(run_response([body], {"hide_usage": True}))
    parts = data.draw(splits(body))
    assert usage_of(run_response(parts, {"hide_usage": True})) == whole


def test_the_http_doors_string_metadata_reads_as_the_grpc_checks() -> None:
    """ext_authz's HTTP door hands every value over as a string (Envoy's
    dynamic_metadata_from_headers): "true" and "12" act as true and 12."""
    typed = {"hide_usage": True, "hide_continuous": False}
    as_strings = {k: "true" if v else "false" for k, v in typed.items()}
    assert run_response(CHAT, as_strings).body == run_response(CHAT, typed).body
    at = BODY.index(b"{") + 1
    spliced = {"splice": INJECT, "splice_at": at, "splice_cut": 0}
    assert run_request(BODY, {k: str(v) if k != "splice" else v
                              for k, v in spliced.items()})[0] \
        == run_request(BODY, spliced)[0] != BODY


def _usage_only(completion: int, prompt: int = 14) -> bytes:
    return (b'data: {"id":"c","choices":[],"usage":{"completion_tokens":%d,"prompt_tokens":%d,'
            b'"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":13}}}\n\n'
            % (completion, prompt, prompt + completion))


def test_one_usage_chunk_per_choice_is_summed_and_each_hidden() -> None:
    """llama.cpp's server, `n: 2` with include_usage: one usage-only event per choice; the
    client got both choices' tokens, so both are billed (as the ext_proc source does)."""
    tokens = [b'data: {"id":"c","choices":[{"index":%d,"delta":{"content":"a"}}]}\n\n' % i
              for i in (0, 1)]
    resp = run_response([*tokens, _usage_only(8), _usage_only(8), b"data: [DONE]\n\n"],
                        {"hide_usage": True})
    assert usage_of(resp) == {"prompt_tokens": 28, "completion_tokens": 16,
                              "total_tokens": 44, "cached_tokens": 26}
    assert resp.body == b"".join(tokens) + b"data: [DONE]\n\n"


def test_completions_usage_on_each_choices_finish_event_is_summed() -> None:
    finish = (b'data: {"choices":[{"text":"","index":%d,"finish_reason":"length"}],'
              b'"usage":{"completion_tokens":2,"prompt_tokens":%d,"total_tokens":%d}}\n\n')
    usage = usage_of(run_response([finish % (1, 4, 6), finish % (0, 2, 4)], {}))
    assert usage == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}


def test_continuous_usage_per_choice_then_the_total_chunk_stands() -> None:
    running = (b'data: {"choices":[{"index":%d,"delta":{"content":"x"}}],"usage":'
               b'{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":%d}}\n\n')
    chunks = [running % (0, 1, 6), running % (1, 1, 6), running % (0, 2, 7)]
    assert usage_of(run_response(chunks, {}))["completion_tokens"] == 3  # a cut: summed
    whole = usage_of(run_response([*chunks, _usage_only(4, prompt=5)], {}))
    assert (whole["prompt_tokens"], whole["completion_tokens"]) == (5, 4)


def test_usage_without_choices_stands_as_it_is() -> None:
    bare = (b'data: {"usage":{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":%d}}'
            b'\n\n')
    assert usage_of(run_response([bare % (2, 7), bare % (3, 8)], {}))["completion_tokens"] == 3


FINISH = (b'data: {"id":"c","choices":[{"finish_reason":"length","index":0,"delta":{}}],'
          b'"model":"m","object":"chat.completion.chunk"}\n\n')
MOVED_USAGE = (b'data: {"id":"c","choices":[],"model":"m","usage":{"completion_tokens":3,'
               b'"prompt_tokens":4,"total_tokens":7},"system_fingerprint":"fp-1",'
               b'"timings":{"cache_n":0,"predicted_n":3}}\n\n')
WITH_MOVED = (b'data: {"id":"c","choices":[{"finish_reason":"length","index":0,"delta":{}}],'
              b'"model":"m","object":"chat.completion.chunk","system_fingerprint":"fp-1",'
              b'"timings":{"cache_n":0,"predicted_n":3}}\n\n')


@pytest.mark.parametrize("cut", [None, len(FINISH), len(FINISH) + 5])
def test_what_the_engine_moved_onto_the_hidden_usage_chunk_goes_back(cut: int | None) -> None:
    """Asked for usage, llama.cpp moves its `timings` and vLLM its `system_fingerprint` from
    the finish chunk onto the usage chunk. Hiding that chunk, the gateway puts them back on
    the finish chunk, which it held until the next event: the client gets what the engine
    sends a client that did not ask."""
    body = FINISH + MOVED_USAGE + b"data: [DONE]\n\n"
    chunks = [body] if cut is None else [body[:cut], body[cut:]]
    resp = run_response(chunks, {"hide_usage": True})
    assert resp.body == WITH_MOVED + b"data: [DONE]\n\n"
    assert usage_of(resp)["completion_tokens"] == 3
    asked = run_response(chunks, {})  # the client asked for usage itself: nothing moves
    assert asked.body == body


def test_a_held_finish_chunk_goes_out_as_it_was_without_a_usage_chunk() -> None:
    other = b'data: {"id":"c","choices":[{"index":1,"delta":{"content":"x"}}]}\n\n'
    body = FINISH + other + FINISH
    held = run_response([FINISH + other, FINISH], {"hide_usage": True})
    assert held.chunks == [FINISH + other, FINISH] and held.body == body


# --- the first content event's time (llm.stream:first_content_us) ---------------------------

RESPONSES_OPENING = [
    b'event: response.created\ndata: {"type":"response.created","response":{"id":"r",'
    b'"model":"m","usage":null}}\n\n',
    b'event: response.in_progress\ndata: {"type":"response.in_progress","response":{}}\n\n',
]
RESPONSES_DELTA = (b'event: response.output_text.delta\ndata: {"type":'
                   b'"response.output_text.delta","delta":"Hi"}\n\n')


def first_content_us(resp: Response) -> int | None:
    v = resp.meta["llm.stream"].get("first_content_us")
    return None if v is None else int(v.decode())


@pytest.mark.parametrize(("chunks", "at"), [
    ([*RESPONSES_OPENING, RESPONSES_DELTA, RESPONSES_DELTA], 3),  # not response.created's
    ([*ANTHROPIC, MESSAGE_STOP], 3),  # message_start, content_block_start carry no token
    ([b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
      b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"delta":'
      b'{"content":"b"}}]}\n\n', b"data: [DONE]\n\n"], 2),  # a role-only chunk first
    ([RESPONSES_OPENING[0] + RESPONSES_DELTA[:30], RESPONSES_DELTA[30:]], 2),  # split
])
def test_the_first_content_event_is_stamped_once(chunks: list[bytes], at: int) -> None:
    """The chunk that completes the first content event is stamped, once (not the engine's
    first byte), in microseconds, whether the stream is rewritten or not."""
    for facts in ({}, {"hide_usage": True}):
        resp = run_response(chunks, facts)
        assert resp.stamps == 1
        assert first_content_us(resp) == CLOCK_BASE + at * CLOCK_STEP


def test_a_stream_without_content_is_not_stamped() -> None:
    resp = run_response([*RESPONSES_OPENING, b"data: [DONE]\n\n"], {})
    assert resp.stamps == 0 and first_content_us(resp) is None
    assert run_response([b'{"usage":{}}'], {}, content_type="application/json").stamps == 0
