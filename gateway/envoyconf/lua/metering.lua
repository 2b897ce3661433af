-- metering.lua: the gateway's Lua HTTP filter (Envoy 1.40 runs LuaJIT: Lua 5.1 syntax only).
-- CONTRACT with the sidecar (change both sides together). For an allowed request ext_authz
-- writes dynamic metadata in namespace "envoy.filters.http.ext_authz" (absent = false/none):
--   splice (string), splice_at (number, 0-based byte offset), splice_cut (number, default 0)
--     REQUEST: body bytes [splice_at, splice_at+splice_cut) are replaced by `splice` and
--     content-length is set to the new length. Byte-exact, no JSON parsing. A body shorter
--     than splice_at+splice_cut is left untouched.
--   hide_usage (bool), RESPONSE: the gateway injected stream_options.include_usage: drop the
--     usage-only event ("choices":[] and a "usage" key), remove "usage":null from the others.
--   hide_continuous (bool), RESPONSE: the gateway injected continuous_usage_stats: remove the
--     "usage":{...} member from every event that still has (non-empty) choices.
-- Responses are only ever touched when content-type starts with text/event-stream; with no
-- hide flag their bytes never change and nothing is held back. When rewriting, the filter
-- holds an unterminated event until its end arrives, flushes it at end of stream, and drops
-- the response content-length.
-- COUNTING, every text/event-stream response: completed events carrying a non-empty
-- "content" / "reasoning_content" / "text" string (chat, completions), or Responses-API
-- "type":"response.output_text.delta" events with a non-empty "delta", published as
-- llm.stream:content_events and llm.stream:content_chars (bytes of those strings as written,
-- escapes included: an estimate for streams cut before their usage arrives). Set to 0 when
-- the stream starts and after every chunk that changed them, so the access log has them
-- however the stream ends. llm.stream:done becomes true once the engine's own end marker has
-- passed (`data: [DONE]`, a Responses-API response.completed / failed / incomplete, or an
-- Anthropic message_stop); llm.stream:failed once the engine reported a failure inside the
-- stream (an event with a "type":"error" member: Anthropic's and the Responses API's).
-- USAGE, every text/event-stream response: the numbers of an event's "usage" object are
-- published in llm.usage (what the engine reported; later events replace earlier values key
-- by key): prompt_tokens (or input_tokens), completion_tokens (or output_tokens; not from
-- Anthropic's message_start, whose count is only the first token's), total_tokens,
-- cached_tokens, reasoning_tokens (wherever they sit inside it), cache_read_input_tokens,
-- cache_creation_input_tokens; and llm.usage:model, the first "model" string a stream names.
-- (Envoy's sse_to_metadata could read these, but it JSON-parses every event: ~8 µs a chunk
-- where this looks only at events that carry a "usage" object.)
-- Events end at a blank line ("\n\n" or "\n\r\n", so "\r\n\r\n" too; lone-"\r" line ends are
-- not recognised). Upstream reads split anywhere: inside an event, a CRLF, a UTF-8 character.

-- Everything below is local: Envoy keeps one Lua state per worker thread, so a global would
-- leak between requests. All per-request state lives in the coroutine's locals.
local find, sub, gsub, byte, lower = string.find, string.sub, string.gsub, string.byte, string.lower
local concat = table.concat
local floor, huge = math.floor, math.huge
local tonumber, tostring, type, pcall = tonumber, tostring, type, pcall

local AUTHZ_NS = "envoy.filters.http.ext_authz"
local STREAM_NS = "llm.stream"
local USAGE_NS = "llm.usage"

-- An SSE event that grows past this without its blank line is not held any longer: it is sent
-- on unchanged and uncounted up to its end. It bounds the memory a broken or hostile upstream
-- can pin (the filter's copy lives in Lua, outside Envoy's buffer limits). LLM events are a
-- few hundred bytes; splitting invariance only holds below this size.
local MAX_HELD = 1024 * 1024

-- An event ends at an empty line. Lua's find takes the leftmost match and "\r?" is greedy, so
-- the boundaries found chunk by chunk are the ones a single pass over the whole stream finds.
local BOUNDARY = "\n\r?\n"

-- Patterns over one event's text. Keys are matched with their quotes and colon, so a key name
-- inside a JSON string (where its quotes are escaped as \") never matches.
local EMPTY_CHOICES = '"choices"%s*:%s*%[%s*%]'
-- A member is removed with the comma (and spaces) that joined it to its neighbour, so the
-- event stays valid JSON laid out as the engine would have written it without the member.
local USAGE_NULL_AFTER = ',%s*"usage"%s*:%s*null'    -- {"a":1,"usage":null}
local USAGE_NULL_BEFORE = '"usage"%s*:%s*null%s*,%s*' -- {"usage":null,"a":1}
local USAGE_OBJ_AFTER = ',%s*"usage"%s*:%s*%b{}'     -- usage objects hold numbers and objects
local USAGE_OBJ_BEFORE = '"usage"%s*:%s*%b{}%s*,%s*'  -- only, so %b{} balances them correctly
local RESPONSES_EVENT = '"type"%s*:%s*"response%.'
local OUTPUT_TEXT_DELTA = '"type"%s*:%s*"response%.output_text%.delta"'
-- Each pattern with the plain key it needs: a plain find rules most events out before the
-- pattern runs (patterns cost a scan per quote; this runs for every event of every stream).
local TEXT_KEYS = {
  { '"content"', '"content"%s*:%s*"' },
  { '"reasoning_content"', '"reasoning_content"%s*:%s*"' },
  { '"text"', '"text"%s*:%s*"' }, -- completions, and Anthropic's text_delta
  { '"thinking"', '"thinking"%s*:%s*"' }, -- Anthropic's thinking_delta
  { '"partial_json"', '"partial_json"%s*:%s*"' }, -- Anthropic's input_json_delta (tool use)
}
local DELTA_KEY = { { '"delta"', '"delta"%s*:%s*"' } }
-- The engine's own end marker: a client that hangs up right after it still got everything
-- (the sidecar then records `completed`, not `client_cancelled`).
local DONE = "^%s*data:%s*%[DONE%]"
local RESPONSES_END = '"type"%s*:%s*"response%.[cfi][oan][mic][a-z]*"' -- completed/failed/incomplete
local MESSAGE_STOP = '"type"%s*:%s*"message_stop"' -- Anthropic Messages API
local ERROR_EVENT = '"type"%s*:%s*"error"'

-- ext_authz's facts as a Lua table, or nil when it wrote none. Envoy converts the Struct:
-- numbers arrive as Lua numbers (doubles), booleans as booleans, a missing namespace as nil.
local function authz_facts(handle)
  local facts = handle:streamInfo():dynamicMetadata():get(AUTHZ_NS)
  if type(facts) == "table" then
    return facts
  end
  return nil
end

-- A non-negative whole number from metadata (Struct numbers are doubles; accept "12" too).
local function offset(v)
  v = tonumber(v)
  if v == nil or v ~= v or v < 0 or v == huge then
    return nil
  end
  return floor(v)
end

---------------------------------------------------------------------------------------------
-- Request: splice the gateway's bytes into the body.
---------------------------------------------------------------------------------------------

function envoy_on_request(handle)
  local facts = authz_facts(handle)
  if facts == nil or type(facts.splice) ~= "string" then
    return  -- the common case: body() is not called, so nothing is buffered by this filter
  end
  local at, cut = offset(facts.splice_at), offset(facts.splice_cut or 0)
  if at == nil or cut == nil then
    return
  end
  -- ext_authz already buffered the whole body (with_request_body), so this does not wait.
  local body = handle:body()
  if body == nil then
    return
  end
  local n = body:length()
  if at + cut > n then
    return  -- the facts do not describe this body: forward it as the client sent it
  end
  -- getBytes copies only what is asked; zero-length copies are skipped.
  local head = at > 0 and body:getBytes(0, at) or ""
  local rest_len = n - at - cut
  local rest = rest_len > 0 and body:getBytes(at + cut, rest_len) or ""
  local new = head .. facts.splice .. rest
  body:setBytes(new)
  -- Envoy 1.40's setBytes on a buffered body already rewrites content-length (and a chunked
  -- request leaves as a sized one); saying it here keeps the filter right if that changes.
  handle:headers():replace("content-length", tostring(#new))
end

---------------------------------------------------------------------------------------------
-- Response: count content events; rewrite events when a hide flag is set.
---------------------------------------------------------------------------------------------

-- Index of the closing quote of the JSON string whose opening quote is at `open`, or nil when
-- the string does not end inside `s`. Jumps from one quote or backslash to the next.
local function string_end(s, open)
  local i = open + 1
  while true do
    local j = find(s, '["\\]', i)
    if j == nil then
      return nil
    end
    if byte(s, j) == 34 then -- '"'
      return j
    end
    i = j + 2 -- a backslash escapes the byte after it (\" \\ \n \uXXXX all start that way)
  end
end

-- Total length of the non-empty strings under any of `keys` in `ev` (0 when none).
local function string_bytes(ev, keys)
  local total = 0
  for k = 1, #keys do
    local plain, pattern = keys[k][1], keys[k][2]
    local pos = find(ev, plain, 1, true)
    while pos ~= nil do
      local _, e = find(ev, pattern, pos)
      if e == nil then
        break
      end
      local close = string_end(ev, e)
      if close == nil then
        break
      end
      total = total + (close - e - 1)
      pos = find(ev, plain, close + 1, true)
    end
  end
  return total
end

-- Whether one complete event is the engine's end marker.
local function is_end(ev)
  if find(ev, "[DONE]", 1, true) then
    return find(ev, DONE) ~= nil
  end
  return find(ev, '"type"', 1, true) ~= nil and
    (find(ev, RESPONSES_END) ~= nil or find(ev, MESSAGE_STOP) ~= nil)
end

-- The usage numbers an event's "usage" object carries: { metadata key, pattern } in order;
-- a later pattern for the same key (the Responses/Anthropic spelling) wins when both match.
-- Keys are matched with both quotes, so "input_tokens" never matches inside
-- "cache_read_input_tokens" or "input_tokens_details".
local USAGE_KEYS = {
  { "prompt_tokens", '"prompt_tokens"%s*:%s*(%d+)' },
  { "prompt_tokens", '"input_tokens"%s*:%s*(%d+)' },
  { "completion_tokens", '"completion_tokens"%s*:%s*(%d+)' },
  { "completion_tokens", '"output_tokens"%s*:%s*(%d+)' },
  { "total_tokens", '"total_tokens"%s*:%s*(%d+)' },
  { "cached_tokens", '"cached_tokens"%s*:%s*(%d+)' },
  { "reasoning_tokens", '"reasoning_tokens"%s*:%s*(%d+)' },
  { "cache_read_input_tokens", '"cache_read_input_tokens"%s*:%s*(%d+)' },
  { "cache_creation_input_tokens", '"cache_creation_input_tokens"%s*:%s*(%d+)' },
}
local MESSAGE_START = '"type"%s*:%s*"message_start"'

-- { key = number } from the event's usage object, or nil when it has none ("usage": null).
local function usage_of(ev)
  local s = find(ev, '"usage"', 1, true)
  if s == nil then
    return nil
  end
  local _, _, obj = find(ev, "^%s*:%s*(%b{})", s + 7)
  if obj == nil then
    _, _, obj = find(ev, '"usage"%s*:%s*(%b{})', s + 7) -- a later one (rare)
    if obj == nil then
      return nil
    end
  end
  local starting = find(ev, '"message_start"', 1, true) ~= nil and find(ev, MESSAGE_START) ~= nil
  local out, any = {}, false
  for i = 1, #USAGE_KEYS do
    local key = USAGE_KEYS[i][1]
    if not (starting and key == "completion_tokens") then
      local _, _, n = find(obj, USAGE_KEYS[i][2])
      if n ~= nil then
        out[key] = tonumber(n)
        any = true
      end
    end
  end
  if any then
    return out
  end
  return nil
end

-- The served model named by an event ("model": "..."), or nil.
local function model_of(ev)
  local _, e = find(ev, '"model"%s*:%s*"')
  if e == nil then
    return nil
  end
  local close = string_end(ev, e)
  if close == nil then
    return nil
  end
  local name = sub(ev, e + 1, close - 1)
  if find(name, "\\", 1, true) then
    name = gsub(name, "\\(.)", "%1") -- \" \\ \/ (a \u escape keeps its letters)
  end
  return name
end

-- Whether one complete event is the engine reporting a failure mid-stream.
local function is_error(ev)
  return find(ev, '"error"', 1, true) ~= nil and find(ev, ERROR_EVENT) ~= nil
end

-- Content bytes one complete event carries (0: not a content event).
local function content_bytes(ev)
  if find(ev, '"type"', 1, true) and find(ev, RESPONSES_EVENT) then
    -- Responses API: only text deltas count; the *.done and response.completed events repeat
    -- the whole text under "text" and must not count it again.
    if find(ev, OUTPUT_TEXT_DELTA) then
      return string_bytes(ev, DELTA_KEY)
    end
    return 0
  end
  return string_bytes(ev, TEXT_KEYS)
end

-- The bytes to send for one complete event when a hide flag is set.
-- Remove the `"usage": <value>` member (value: an anchored pattern) with its comma. Compact
-- JSON, as engines write it, is cut by position: one plain find and two anchored matches,
-- no scan. Anything else falls back to the whitespace-tolerant patterns.
local function drop_usage(ev, value, after_pat, before_pat)
  local s, e = find(ev, '"usage"', 1, true)
  if s ~= nil then
    local _, ve = find(ev, value, e + 1)
    if ve ~= nil then
      if byte(ev, s - 1) == 44 then -- ',"usage":...'
        return sub(ev, 1, s - 2) .. sub(ev, ve + 1)
      end
      local _, ce = find(ev, "^,%s*", ve + 1) -- '"usage":..., ' (its spaces go too)
      if ce ~= nil then
        return sub(ev, 1, s - 1) .. sub(ev, ce + 1)
      end
    end
  end
  local out, n = gsub(ev, after_pat, "", 1)
  if n == 0 then
    out = gsub(ev, before_pat, "", 1)
  end
  return out
end

local function empty_choices(ev)
  local _, e = find(ev, '"choices"', 1, true)
  if e == nil then
    return false, false
  end
  if find(ev, "^%s*:%s*%[%s*%]", e + 1) then
    return true, true
  end
  return find(ev, EMPTY_CHOICES) ~= nil, true -- a second "choices" (rare): look properly
end

local function rewrite(ev, hide_usage, hide_continuous)
  if not find(ev, '"usage"', 1, true) then
    return ev -- nearly every event of a stream without continuous usage: no pattern work
  end
  local empty, has_choices = empty_choices(ev)
  if hide_usage and empty then
    return "" -- the usage-only chunk include_usage added: the client did not ask for it
  end
  if hide_usage then
    ev = drop_usage(ev, "^%s*:%s*null", USAGE_NULL_AFTER, USAGE_NULL_BEFORE)
  end
  if hide_continuous and has_choices and not empty then
    ev = drop_usage(ev, "^%s*:%s*%b{}", USAGE_OBJ_AFTER, USAGE_OBJ_BEFORE)
  end
  return ev
end

-- The dynamicMetadata() wrapper is fetched again each time: Envoy 1.40 kills the wrappers a
-- script holds once it suspends between chunks ("object used outside of proper scope"). A
-- script error mid-stream lets the rest of the body through untouched, but whatever this
-- filter was holding back at that moment is lost to the client.
local function publish(handle, events, chars, done, failed)
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set(STREAM_NS, "content_events", events)
  meta:set(STREAM_NS, "content_chars", chars)
  if done then
    meta:set(STREAM_NS, "done", true)
  end
  if failed then
    meta:set(STREAM_NS, "failed", true)
  end
end

local function publish_usage(handle, usage)
  local meta = handle:streamInfo():dynamicMetadata()
  for key, n in pairs(usage) do
    meta:set(USAGE_NS, key, n)
  end
end

local function starts_with_sse(content_type)
  return content_type ~= nil and find(lower(content_type), "text/event-stream", 1, true) == 1
end

function envoy_on_response(handle)
  if not starts_with_sse(handle:headers():get("content-type")) then
    -- Not a stream: return before bodyChunks(), so Envoy never resumes this script for the
    -- body and no byte is held back (holding a JSON error's tail hung it until timeout).
    return
  end
  local facts = authz_facts(handle)
  local hide_usage = facts ~= nil and facts.hide_usage == true
  local hide_continuous = facts ~= nil and facts.hide_continuous == true
  local rewriting = hide_usage or hide_continuous
  if rewriting then
    -- The rewritten body is shorter than any length the engine announced; a stale
    -- content-length leaves the client waiting for bytes that never come. Headers are still
    -- ours to change here: bodyChunks() has not been called yet.
    handle:headers():remove("content-length")
  end

  local events, chars, done, failed = 0, 0, false, false
  local named = false -- llm.usage:model published
  publish(handle, 0, 0, false, false)

  -- The unterminated tail: pieces in a table, joined only once an event completes, so a big
  -- event arriving in many reads is copied once, not once per read. `tail2` is its last two
  -- bytes, enough to see a boundary that straddles the old tail and the new chunk.
  local held, held_len, tail2 = {}, 0, ""
  -- True while passing through the rest of an event that outgrew MAX_HELD.
  local oversized = false
  local last, last_out -- the latest chunk wrapper and the bytes it now carries

  for chunk in handle:bodyChunks() do
    local len = chunk:length()
    local data = len > 0 and chunk:getBytes(0, len) or ""
    local out = data
    local probe = tail2 .. data
    local _, e = find(probe, BOUNDARY)
    if e == nil then
      -- No event completes in this chunk: hold it whole (or let an oversized one through).
      tail2 = sub(probe, -2)
      if not oversized then
        held[#held + 1] = data
        held_len = held_len + len
        out = ""
        if held_len > MAX_HELD then
          out = concat(held)
          held, held_len, oversized = {}, 0, true
        end
      end
    else
      local buf
      local parts = {}
      if oversized then
        -- The oversized event ends inside this chunk: its rest goes out untouched, uncounted.
        local stop = e - #tail2
        parts[1] = sub(data, 1, stop)
        buf = sub(data, stop + 1)
        oversized = false
      else
        held[#held + 1] = data
        buf = concat(held)
      end
      local pos, before, was_done, was_failed = 1, events, done, failed
      while true do
        local _, stop = find(buf, BOUNDARY, pos)
        if stop == nil then
          break
        end
        local ev = sub(buf, pos, stop)
        if not named and find(ev, '"model"', 1, true) then
          local model = model_of(ev)
          if model ~= nil then
            handle:streamInfo():dynamicMetadata():set(USAGE_NS, "model", model)
            named = true
          end
        end
        local usage = usage_of(ev) -- one plain find for events without usage
        if usage ~= nil then
          publish_usage(handle, usage)
        end
        local c = content_bytes(ev)
        if c > 0 then
          events = events + 1
          chars = chars + c
        elseif not done and is_end(ev) then
          done = true
        elseif not failed and is_error(ev) then
          failed = true
        end
        if rewriting then
          parts[#parts + 1] = rewrite(ev, hide_usage, hide_continuous)
        end
        pos = stop + 1
      end
      local rest = sub(buf, pos)
      held = { rest }
      held_len = #rest
      tail2 = sub(rest, -2)
      if rewriting then
        out = concat(parts)
      end
      if events ~= before or done ~= was_done or failed ~= was_failed then
        publish(handle, events, chars, done, failed)
      end
    end
    if rewriting then
      if out ~= data then
        -- Lua strings are interned: equal bytes compare as one pointer. Most chunks carry
        -- events with nothing to hide, and leaving their buffer alone saves a copy.
        chunk:setBytes(out)
      end
    else
      out = data -- counting only: the chunk is never touched, nothing is held back
    end
    last, last_out = chunk, out
  end

  -- End of stream. An unterminated last event is sent as it came (an SSE client discards it
  -- anyway) and not counted. Envoy 1.40 ends the loop inside the same resume that delivered
  -- the end_stream data frame (possibly empty), so `last` is still live and appending to it
  -- reaches the client. When the stream ends with trailers instead, the last data chunk was
  -- already sent and its wrapper is dead: setBytes raises, pcall keeps the script alive, and
  -- the held tail is lost (SSE over HTTP/1.1 from vLLM never carries trailers).
  if rewriting and last ~= nil and held_len > 0 then
    pcall(last.setBytes, last, last_out .. concat(held))
  end
end
