-- metering.lua: the gateway's Lua HTTP filter (Envoy 1.40 runs LuaJIT: Lua 5.1 syntax only).
-- CONTRACT with the sidecar (change both sides together; the names are gateway/envoy_contract.py's,
-- see AUTHZ_NS below). For an allowed request ext_authz writes dynamic metadata in namespace
-- AUTHZ_NS (absent = false/none):
--   splice (string), splice_at (number, 0-based byte offset), splice_cut (number, default 0)
--     REQUEST: body bytes [splice_at, splice_at+splice_cut) are replaced by `splice` and
--     content-length is set to the new length. Byte-exact, no JSON parsing. A body shorter
--     than splice_at+splice_cut is left untouched.
--   hide_usage (bool), RESPONSE: the gateway injected stream_options.include_usage: drop the
--     usage-only event ("choices":[] and a "usage" key), remove "usage":null from the others;
--     a finish event is held until the next one, and gets back what the engine moved from it
--     onto the hidden usage event (MOVED_TO_USAGE).
--   hide_continuous (bool), RESPONSE: the gateway injected continuous_usage_stats: remove the
--     "usage":{...} member from every event that still has (non-empty) choices.
--   From ext_authz's HTTP door every value is a string: flags "true", numbers "12".
-- Responses are only ever touched when content-type starts with text/event-stream; with no
-- hide flag their bytes never change and nothing is held back. When rewriting, the filter
-- holds an unterminated event until its end arrives, flushes it at end of stream, and drops
-- the response content-length.
-- COUNTING, every text/event-stream response: completed events carrying a non-empty
-- "content" / "reasoning_content" / "text" string (chat, completions), or Responses-API
-- "type":"response.output_text.delta" (or reasoning_text / reasoning_summary_text) events with
-- a non-empty "delta", published as
-- llm.stream:content_events and llm.stream:content_chars (bytes of those strings as written,
-- escapes included: an estimate for streams cut before their usage arrives). Set to 0 when
-- the stream starts and after every chunk that changed them, so the access log has them
-- however the stream ends. llm.stream:done becomes true once the engine's own end marker has
-- passed (`data: [DONE]`, a Responses-API response.completed / failed / incomplete, or an
-- Anthropic message_stop); llm.stream:failed once the engine reported a failure inside the
-- stream (an event with a "type":"error" member: Anthropic's and the Responses API's).
-- llm.stream:first_content_us, set once, with the chunk that completes the first content
-- event: Envoy's clock then (handle:timestampString, epoch microseconds, a string). The
-- sidecar takes TTFT from it (less the record's start), as ext_proc times its first content
-- event: a Responses/Anthropic stream's response.created / message_start come before any
-- token, so the engine's first byte is not its first token.
-- USAGE, every text/event-stream response: the numbers of an event's "usage" object are
-- published in llm.usage (what the engine reported; later events replace earlier values key
-- by key, except a chat/completions stream's per-choice usage, which is summed: stream_usage): prompt_tokens (or input_tokens), completion_tokens (or output_tokens; not from
-- Anthropic's message_start, whose count is only the first token's), total_tokens,
-- cached_tokens, reasoning_tokens (wherever they sit inside it), cache_read_input_tokens,
-- cache_creation_input_tokens; and llm.usage:model, the first "model" string a stream names,
-- replaced by the one an event that carries usage names.
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

-- The names shared with the sidecar (namespaces, metadata keys): gateway/envoy_contract.py,
-- written here as locals when gateway/envoyconf/lua renders this file.
--@CONTRACT@

-- An SSE event that grows past this without its blank line is not held any longer: it is sent
-- on unchanged and uncounted up to its end. It bounds the memory a broken or hostile upstream
-- can pin (the filter's copy lives in Lua, outside Envoy's buffer limits). LLM events are a
-- few hundred bytes; splitting invariance only holds below this size.
local MAX_HELD = 1024 * 1024

-- SPEED: this runs for every chunk of every stream, so the per-chunk path uses plain finds
-- and byte tests only. LuaJIT compiles those; a Lua pattern is matched by an interpreted C
-- loop a character at a time and stops the JIT from compiling the loop around it (hiding
-- "usage": null from a chat chunk took ~14 µs with patterns, ~4 µs without, measured by
-- benchmarks/lua_per_chunk.py). Patterns remain only where an event is rare (a usage object
-- outside the usual layout, an end marker, an error) or a plain find already found the key
-- (whitespace-tolerant fallbacks).

-- Patterns over one event's text. Keys are matched with their quotes and colon, so a key name
-- inside a JSON string (where its quotes are escaped as \") never matches.
local EMPTY_CHOICES = '"choices"%s*:%s*%[%s*%]'
-- A member is removed with the comma (and spaces) that joined it to its neighbour, so the
-- event stays valid JSON laid out as the engine would have written it without the member.
local USAGE_NULL_AFTER = ',%s*"usage"%s*:%s*null'    -- {"a":1,"usage":null}
local USAGE_NULL_BEFORE = '"usage"%s*:%s*null%s*,%s*' -- {"usage":null,"a":1}
local USAGE_OBJ_AFTER = ',%s*"usage"%s*:%s*%b{}'     -- usage objects hold numbers and objects
local USAGE_OBJ_BEFORE = '"usage"%s*:%s*%b{}%s*,%s*'  -- only, so %b{} balances them correctly
-- The keys whose string values are content (each with its quotes, so none matches another).
local TEXT_KEYS = {
  '"content"',
  '"reasoning_content"',
  '"text"', -- completions, and Anthropic's text_delta
  '"thinking"', -- Anthropic's thinking_delta
  '"partial_json"', -- Anthropic's input_json_delta (tool use)
}
local DELTA_KEY = { '"delta"' }
-- The Responses-API event types (with both quotes) whose "delta" is generated text: the
-- answer's, and the reasoning's (vLLM's reasoning_text, OpenAI's summary).
local RESPONSES_DELTAS = {
  '"response.output_text.delta"', '"response.reasoning_text.delta"',
  '"response.reasoning_summary_text.delta"',
}
-- The engine's own end marker: a client that hangs up right after it still got everything
-- (the sidecar then records `completed`, not `client_cancelled`).
-- It is a line of its own: the event may open with a comment (": ping") or an "event:" line.
local DONE = "^%s*data:%s*%[DONE%]"
local DONE_LINE = "\ndata:%s*%[DONE%]"
-- "type" values (with their quotes) that end a stream: the Responses API's and Anthropic's.
local END_TYPES = {
  '"response.completed"', '"response.failed"', '"response.incomplete"', '"message_stop"',
}

-- ext_authz's facts as a Lua table, or nil when it wrote none. Envoy converts the Struct:
-- numbers arrive as Lua numbers (doubles), booleans as booleans, a missing namespace as nil.
local function authz_facts(handle)
  local facts = handle:streamInfo():dynamicMetadata():get(AUTHZ_NS)
  if type(facts) == "table" then
    return facts
  end
  return nil
end

-- A flag from metadata: true from the gRPC Check, "true" from the HTTP door (strings only).
local function truthy(v)
  return v == true or v == "true"
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
  if facts == nil or type(facts[SPLICE]) ~= "string" then
    return  -- the common case: body() is not called, so nothing is buffered by this filter
  end
  local at, cut = offset(facts[SPLICE_AT]), offset(facts[SPLICE_CUT] or 0)
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
  local new = head .. facts[SPLICE] .. rest
  body:setBytes(new)
  -- Envoy 1.40's setBytes on a buffered body already rewrites content-length (and a chunked
  -- request leaves as a sized one); saying it here keeps the filter right if that changes.
  handle:headers():replace("content-length", tostring(#new))
end

---------------------------------------------------------------------------------------------
-- Response: count content events; rewrite events when a hide flag is set.
---------------------------------------------------------------------------------------------

-- The first index at or after `i` that is not JSON whitespace.
local function skip_ws(s, i)
  local b = byte(s, i)
  while b == 32 or b == 10 or b == 13 or b == 9 do
    i = i + 1
    b = byte(s, i)
  end
  return i
end

-- Where the value of the member whose key's closing quote is at `e` starts, or nil when no
-- colon follows (then the quoted text was a value, not a key).
local function value_at(s, e)
  local i = skip_ws(s, e + 1)
  if byte(s, i) ~= 58 then -- ':'
    return nil
  end
  return skip_ws(s, i + 1)
end

-- The first event boundary (an empty line: "\n\n" or "\n\r\n") at or after `init`: the
-- indexes of its first and last byte, or nil. The leftmost one, as the pattern "\n\r?\n"
-- would find it, so boundaries found chunk by chunk are those of one pass over the stream.
local function boundary(s, init)
  while true do
    local j = find(s, "\n", init, true)
    if j == nil then
      return nil
    end
    local b = byte(s, j + 1)
    if b == 10 then
      return j, j + 1
    end
    if b == 13 and byte(s, j + 2) == 10 then
      return j, j + 2
    end
    init = j + 1
  end
end

-- Index of the closing quote of the JSON string whose opening quote is at `open`, or nil when
-- the string does not end inside `s`. A backslash escapes the byte after it (\" \\ \n
-- \uXXXX all start that way); content strings are short, so the bytes up to each quote are
-- looked at one by one.
local function string_end(s, open)
  local i = open + 1
  while true do
    local q = find(s, '"', i, true)
    if q == nil then
      return nil
    end
    local k = i
    while k < q and byte(s, k) ~= 92 do -- '\\'
      k = k + 1
    end
    if k == q then
      return q
    end
    i = k + 2
  end
end

-- Total length of the non-empty strings under any of `keys` in `ev` (0 when none).
local function string_bytes(ev, keys)
  local total = 0
  for k = 1, #keys do
    local key = keys[k]
    local pos = find(ev, key, 1, true)
    while pos ~= nil do
      local from = pos + #key
      local v = value_at(ev, from - 1)
      if v ~= nil and byte(ev, v) == 34 then -- a string value
        local close = string_end(ev, v)
        if close == nil then
          break
        end
        total = total + (close - v - 1)
        from = close + 1
      end
      pos = find(ev, key, from, true)
    end
  end
  return total
end

-- Whether a "type" member of `ev` has a string value starting with `quoted` (the value's
-- opening quote, then its text; with the closing quote too for an exact match).
local function has_type(ev, quoted)
  local pos = find(ev, '"type"', 1, true)
  while pos ~= nil do
    local v = value_at(ev, pos + 5)
    if v ~= nil and sub(ev, v, v + #quoted - 1) == quoted then
      return true
    end
    pos = find(ev, '"type"', pos + 6, true)
  end
  return false
end

-- Whether one complete event is the engine's end marker.
local function is_end(ev)
  if find(ev, "[DONE]", 1, true) then
    return find(ev, DONE) ~= nil or find(ev, DONE_LINE) ~= nil
  end
  if find(ev, '"type"', 1, true) == nil then
    return false
  end
  for i = 1, #END_TYPES do
    if find(ev, END_TYPES[i], 1, true) and has_type(ev, END_TYPES[i]) then
      return true
    end
  end
  return false
end

-- The usage numbers an event's "usage" object carries: { metadata key, pattern } in order;
-- a later pattern for the same key (the Responses/Anthropic spelling) wins when both match.
-- Keys are matched with both quotes, so "input_tokens" never matches inside
-- "cache_read_input_tokens" or "input_tokens_details".
local USAGE_KEYS = {
  { PROMPT_TOKENS, '"prompt_tokens"' },
  { PROMPT_TOKENS, '"input_tokens"' },
  { COMPLETION_TOKENS, '"completion_tokens"' },
  { COMPLETION_TOKENS, '"output_tokens"' },
  { TOTAL_TOKENS, '"total_tokens"' },
  { CACHED_TOKENS, '"cached_tokens"' },
  { REASONING_TOKENS, '"reasoning_tokens"' },
  { CACHE_READ_INPUT_TOKENS, '"cache_read_input_tokens"' },
  { CACHE_CREATION_INPUT_TOKENS, '"cache_creation_input_tokens"' },
}

-- The index of the '}' closing the object that opens at `i`, as the pattern %b{} finds it
-- (usage objects hold numbers and objects only, so no brace hides in a string), or nil.
local function object_end(s, i)
  if byte(s, i) ~= 123 then
    return nil -- not an object ("usage": null): scanning on would end at some later '}'
  end
  local depth = 0
  for k = i, #s do
    local b = byte(s, k)
    if b == 123 then
      depth = depth + 1
    elseif b == 125 then
      depth = depth - 1
      if depth == 0 then
        return k
      end
    end
  end
  return nil
end

-- The first whole number that is the value of a `quoted` key in `obj`, or nil.
local function number_of(obj, quoted)
  local pos = find(obj, quoted, 1, true)
  while pos ~= nil do
    local v = value_at(obj, pos + #quoted - 1)
    local b = v ~= nil and byte(obj, v) or nil
    if b ~= nil and b >= 48 and b <= 57 then
      local n = 0
      repeat
        n = n * 10 + b - 48
        v = v + 1
        b = byte(obj, v)
      until b == nil or b < 48 or b > 57
      return n
    end
    pos = find(obj, quoted, pos + #quoted, true)
  end
  return nil
end

-- { key = number }: the counts the usage object `obj` carries, or nil when it carries none.
local function counts_of(obj, starting)
  local out, any = {}, false
  for i = 1, #USAGE_KEYS do
    local key = USAGE_KEYS[i][1]
    if not (starting and key == COMPLETION_TOKENS) then
      local n = number_of(obj, USAGE_KEYS[i][2])
      if n ~= nil then
        out[key] = n
        any = true
      end
    end
  end
  if any then
    return out
  end
  return nil
end

-- { key = number } from the event's usage object, or nil when it has none ("usage": null).
-- The first "usage" object that carries a count: a Responses-API event echoes the request's
-- structured-output schema and tools before its own usage, and a property named "usage" in
-- them is an object too (its keys' values are objects, never counts). Each later "usage" key
-- is looked at in turn (rare: most events have one, or none).
local function usage_of(ev)
  local s = find(ev, '"usage"', 1, true)
  local starting
  while s ~= nil do
    local v = value_at(ev, s + 6)
    if v ~= nil and byte(ev, v) == 123 then
      local e = object_end(ev, v)
      if e ~= nil then
        if starting == nil then
          starting = find(ev, '"message_start"', 1, true) ~= nil and
            has_type(ev, '"message_start"')
        end
        local out = counts_of(sub(ev, v, e), starting)
        if out ~= nil then
          return out
        end
      end
    end
    s = find(ev, '"usage"', s + 7, true) -- "usage": null, the usual case: nothing after it
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
  return find(ev, '"error"', 1, true) ~= nil and has_type(ev, '"error"')
end

-- Content bytes one complete event carries (0: not a content event).
local function content_bytes(ev)
  if find(ev, '"response.', 1, true) and has_type(ev, '"response.') then
    -- Responses API: only text deltas count (the answer's and the reasoning's); the *.done
    -- and response.completed events repeat the whole text under "text" and must not count it
    -- again.
    for i = 1, #RESPONSES_DELTAS do
      if has_type(ev, RESPONSES_DELTAS[i]) then
        return string_bytes(ev, DELTA_KEY)
      end
    end
    return 0
  end
  return string_bytes(ev, TEXT_KEYS)
end

-- The bytes to send for one complete event when a hide flag is set.
-- Remove the `"usage": <value>` member with its comma; `value_end(ev, v)` is the index of the
-- last byte of a value starting at `v`, or nil when it is not the kind to remove. JSON laid
-- out as engines write it is cut by position with byte tests; anything else falls back to the
-- whitespace-tolerant patterns.
local function drop_usage(ev, value_end, after_pat, before_pat)
  local s = find(ev, '"usage"', 1, true)
  if s ~= nil then
    local v = value_at(ev, s + 6)
    local ve = v ~= nil and value_end(ev, v) or nil
    if ve ~= nil then
      if byte(ev, s - 1) == 44 then -- ',"usage":...'
        return sub(ev, 1, s - 2) .. sub(ev, ve + 1)
      end
      if byte(ev, ve + 1) == 44 then -- '"usage":..., ' (its spaces go too)
        return sub(ev, 1, s - 1) .. sub(ev, skip_ws(ev, ve + 2))
      end
    end
  end
  local out, n = gsub(ev, after_pat, "", 1)
  if n == 0 then
    out = gsub(ev, before_pat, "", 1)
  end
  return out
end

local function null_end(ev, v)
  if sub(ev, v, v + 3) == "null" then
    return v + 3
  end
  return nil
end

local function empty_choices(ev)
  local _, e = find(ev, '"choices"', 1, true)
  if e == nil then
    return false, false
  end
  local v = value_at(ev, e)
  if v ~= nil and byte(ev, v) == 91 and byte(ev, skip_ws(ev, v + 1)) == 93 then -- '[' ']'
    return true, true
  end
  if find(ev, '"choices"', e + 1, true) == nil then
    return false, true
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
    ev = drop_usage(ev, null_end, USAGE_NULL_AFTER, USAGE_NULL_BEFORE)
  end
  if hide_continuous and has_choices and not empty then
    ev = drop_usage(ev, object_end, USAGE_OBJ_AFTER, USAGE_OBJ_BEFORE)
  end
  return ev
end

-- Asked for usage, engines move a member from the finish chunk onto the usage-only chunk
-- (llama.cpp its "timings", vLLM its "system_fingerprint"). When that chunk is hidden, the
-- finish chunk was held back until the next event, and gets the member back here: a client
-- that did not ask for usage gets the finish chunk the engine would have sent it.
local MOVED_TO_USAGE = { '"system_fingerprint"', '"timings"' }

-- Does this chat/completions event finish a choice ("finish_reason" a string, not null)?
local function finishes(ev)
  local _, e = find(ev, '"finish_reason"', 1, true)
  if e == nil then
    return false
  end
  local v = value_at(ev, e)
  return v ~= nil and byte(ev, v) == 34
end

-- The finish event `fin` with the members MOVED_TO_USAGE that the hidden usage event `ev`
-- carries and `fin` lacks, put before its closing brace.
local function restore_moved(fin, ev)
  local extra = {}
  for i = 1, #MOVED_TO_USAGE do
    local key = MOVED_TO_USAGE[i]
    local s = find(ev, key, 1, true)
    if s ~= nil and find(fin, key, 1, true) == nil then
      local v = value_at(ev, s + #key - 1)
      local e
      if v ~= nil and byte(ev, v) == 123 then
        e = object_end(ev, v)
      elseif v ~= nil and byte(ev, v) == 34 then
        e = string_end(ev, v)
      end
      if e ~= nil then
        extra[#extra + 1] = sub(ev, s, e)
      end
    end
  end
  if #extra == 0 then
    return fin
  end
  for k = #fin, 1, -1 do
    if byte(fin, k) == 125 then
      return sub(fin, 1, k - 1) .. "," .. concat(extra, ",") .. sub(fin, k)
    end
  end
  return fin
end

-- The dynamicMetadata() wrapper is fetched again each time: Envoy 1.40 kills the wrappers a
-- script holds once it suspends between chunks ("object used outside of proper scope"). A
-- script error mid-stream lets the rest of the body through untouched, but whatever this
-- filter was holding back at that moment is lost to the client.
-- `first`: this chunk completed the stream's first content event, so its time is stamped
-- (once a stream; ~0.2 µs). EnvoyTimestampResolution is looked up here, not kept in a local
-- at load: Envoy 1.40 defines it only once a script runs (nil while the file loads).
local function publish(handle, events, chars, done, failed, first)
  local meta = handle:streamInfo():dynamicMetadata()
  meta:set(STREAM_NS, CONTENT_EVENTS, events)
  meta:set(STREAM_NS, CONTENT_CHARS, chars)
  if first then
    meta:set(STREAM_NS, FIRST_CONTENT_US,
      handle:timestampString(EnvoyTimestampResolution.MICROSECOND))
  end
  if done then
    meta:set(STREAM_NS, STREAM_DONE, true)
  end
  if failed then
    meta:set(STREAM_NS, STREAM_FAILED, true)
  end
end

local function publish_usage(handle, usage)
  local meta = handle:streamInfo():dynamicMetadata()
  for key, n in pairs(usage) do
    meta:set(USAGE_NS, key, n)
  end
end

-- a + b, key by key (a key only one side has keeps its value).
local function add_usage(a, b)
  local out = {}
  for key, n in pairs(a) do
    out[key] = n
  end
  for key, n in pairs(b) do
    out[key] = (out[key] or 0) + n
  end
  return out
end

-- The usage a chat/completions stream has reported so far, however the engine splits it.
-- With n > 1 or a prompt list llama.cpp's server sends one usage-only event ("choices": [])
-- per choice, and puts a completions choice's usage on its finish event; vLLM sends one
-- usage-only event for all, and with continuous usage each choice's running count on its
-- events. So: the usage-only events summed when there are any, else each choice's latest
-- (by the first "index" of the event) summed. Events without "choices" (Anthropic,
-- Responses) replace key by key. `acc` holds { only = sum or nil, by = { index = usage } }.
local function stream_usage(acc, ev, usage)
  local empty, has_choices = empty_choices(ev)
  if not has_choices then
    return usage
  end
  if empty then
    acc.only = acc.only and add_usage(acc.only, usage) or usage
    return acc.only
  end
  if acc.only then
    return nil -- a choice's running count after the total: the total stands
  end
  acc.by[number_of(ev, '"index"') or 0] = usage
  local total = {}
  for _, u in pairs(acc.by) do
    total = add_usage(total, u)
  end
  return total
end

local function starts_with_sse(content_type)
  return content_type ~= nil and find(lower(content_type), "text/event-stream", 1, true) == 1
end

-- A whole (non-stream) 2xx JSON answer: its size, as llm.stream:content_chars. Its usage
-- comes from json_to_metadata, which skips an answer past the buffer limit; without this
-- such an answer (asked for on purpose: n, logprobs) would bill no completion at all. The
-- record uses it only when no usage arrived, for an endpoint that generates
-- (gateway/metering/record.py): an over-estimate, never free. Headers only: no body read.
local function whole_answer(headers, handle)
  local status = headers:get(":status")
  local ctype = headers:get("content-type")
  if status == nil or byte(status, 1) ~= 50 or ctype == nil -- "2xx"
      or find(lower(ctype), "application/json", 1, true) ~= 1 then
    return
  end
  local size = tonumber(headers:get("content-length"))
  if size ~= nil and size > 0 then
    handle:streamInfo():dynamicMetadata():set(STREAM_NS, CONTENT_CHARS, size)
  end
end

function envoy_on_response(handle)
  local headers = handle:headers()
  if not starts_with_sse(headers:get("content-type")) then
    -- Not a stream: return before bodyChunks(), so Envoy never resumes this script for the
    -- body and no byte is held back (holding a JSON error's tail hung it until timeout).
    whole_answer(headers, handle)
    return
  end
  local facts = authz_facts(handle)
  local hide_usage = facts ~= nil and truthy(facts[HIDE_USAGE])
  local hide_continuous = facts ~= nil and truthy(facts[HIDE_CONTINUOUS])
  local rewriting = hide_usage or hide_continuous
  if rewriting then
    -- The rewritten body is shorter than any length the engine announced; a stale
    -- content-length leaves the client waiting for bytes that never come. Headers are still
    -- ours to change here: bodyChunks() has not been called yet.
    handle:headers():remove("content-length")
  end

  local events, chars, done, failed = 0, 0, false, false
  local named = false -- llm.usage:model published
  local acc = { only = nil, by = {} } -- the usage reported so far (stream_usage)
  local fin -- a finish event held back (hide_usage): restore_moved
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
    local _, e = boundary(probe, 1)
    if e == nil then
      -- No event completes in this chunk: hold it whole (or let an oversized one through).
      tail2 = sub(probe, -2)
      if not oversized then
        held[#held + 1] = data
        held_len = held_len + len
        out = ""
        if held_len > MAX_HELD then
          out = (fin or "") .. concat(held) -- a held finish event first: the order stays
          fin = nil
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
        local _, stop = boundary(buf, pos)
        if stop == nil then
          break
        end
        local ev = sub(buf, pos, stop)
        local usage = usage_of(ev) -- one plain find for events without usage
        -- The served model: the first event's, and then the model an event that reports
        -- usage names (as the sidecar's Meter reads it).
        if (usage ~= nil or not named) and find(ev, '"model"', 1, true) then
          local model = model_of(ev)
          if model ~= nil then
            handle:streamInfo():dynamicMetadata():set(USAGE_NS, SERVED_MODEL, model)
            named = true
          end
        end
        if usage ~= nil then
          usage = stream_usage(acc, ev, usage)
          if usage ~= nil then
            publish_usage(handle, usage)
          end
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
          local r = rewrite(ev, hide_usage, hide_continuous)
          if fin ~= nil then -- a held finish event goes out before this one
            parts[#parts + 1] = r == "" and restore_moved(fin, ev) or fin
            fin = nil
          end
          if hide_usage and r ~= "" and finishes(r) then
            fin = r -- held until the next event: is it the usage event to hide?
          else
            parts[#parts + 1] = r
          end
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
        -- once the first content event has passed, `before == 0` is the only added test
        publish(handle, events, chars, done, failed, before == 0 and events > 0)
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
  if rewriting and last ~= nil and (held_len > 0 or fin ~= nil) then
    pcall(last.setBytes, last, last_out .. (fin or "") .. concat(held))
  end
end
