"""Ask the engine for usage on the client's behalf, by splicing bytes into the request.

The plan is made once, at the Check, from the body ext_authz already holds; it travels to
whoever applies it as metadata (the Lua filter in Envoy, or the ext_proc handler), so
neither searches the body again. A 400 KB prompt is never re-serialised: when the client
sent no `stream_options`, the object is inserted right after the body's opening brace.
Only a client that sent its own `stream_options` (without what we need) pays for a scan
to find that object, which is then replaced, merged, in place.

The member replaced is the one the engine reads: JSON parsers (the stdlib's, orjson,
pydantic's) keep the *last* of duplicate keys and decode escapes in keys, so the scan
decodes escaped key names and takes the last top-level `stream_options`. Otherwise a
client could hide its own `"include_usage": false` from the splice
(`"stream_opt\\u0069ons"`, or the member twice), the engine would report no usage and
the request would be billed on an estimate (tests/e2e/test_usage_splice_keys.py).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import orjson

from gateway.endpoints import ENDPOINTS

STREAMING_USAGE_ENDPOINTS = frozenset(e.path for e in ENDPOINTS.values() if e.injects_usage)


@dataclass(frozen=True, slots=True)
class Injected:
    """What the gateway added to the request, and so must hide from the response."""

    include_usage: bool = False
    continuous: bool = False


@dataclass(frozen=True, slots=True)
class Splice:
    """Replace `cut` bytes at offset `at` of the request body with `insert`."""

    at: int
    cut: int
    insert: bytes
    injected: Injected

    def apply(self, body: bytes) -> bytes:
        return body[:self.at] + self.insert + body[self.at + self.cut:]


def plan(body: bytes, endpoint: str, model: str, stream: bool, stream_options: bool,
         include_usage: bool, continuous_usage: bool,
         continuous_models: tuple[str, ...]) -> Splice | None:
    """The splice that makes a stream report its usage (and, for models served by vLLM or
    SGLang, continuous usage), or None when the client asked already or it cannot be done."""
    if not stream or endpoint not in STREAMING_USAGE_ENDPOINTS:
        return None
    want = Injected(
        include_usage=not include_usage,
        continuous=not continuous_usage and any(
            fnmatch.fnmatchcase(model, p) for p in continuous_models))
    if not (want.include_usage or want.continuous):
        return None
    options = {"include_usage": True}
    if want.continuous:
        options["continuous_usage_stats"] = True
    # `stream_options`: the client sent the member, however spelled (BodyFacts.options_member)
    span = _top_level_value(body, b"stream_options") if (
        stream_options or b'"stream_options"' in body) else None
    if span is None:  # insert ours right after the opening brace
        # (found by matching the whitespace, not by lstrip(): a copy of a 400 KB prompt
        # each, to read one byte)
        start = _skip_space(body, 0)
        if body[start:start + 1] != b"{":
            return None
        after = _skip_space(body, start + 1)
        sep = b"" if body[after:after + 1] == b"}" else b","
        return Splice(start + 1, 0, b'"stream_options":' + orjson.dumps(options) + sep, want)
    start, end = span
    try:
        theirs = orjson.loads(body[start:end])
    except orjson.JSONDecodeError:
        return None
    # Theirs merged with ours; a `null` (or any non-object, which the engine would refuse
    # anyway) is replaced, never left to win as a duplicate key after ours.
    merged = {**theirs, **options} if isinstance(theirs, dict) else options
    return Splice(start, end - start, orjson.dumps(merged), want)


_SPACE = re.compile(rb"\s*")  # what bytes.lstrip() strips


def _skip_space(body: bytes, at: int) -> int:
    """Where the first byte at or after `at` that is not whitespace is."""
    m = _SPACE.match(body, at)
    return m.end() if m else at


# JSON strings (with escapes) and the structural characters; everything else is skipped.
# (Unrolled, possessive: a string is skipped at C speed, ~10 ns a byte even where escapes are
# dense; the plain alternation `"(?:[^"\\]|\\.)*"` backtracked a step a character, ~190 ns,
# so a client's 8 MB body held the event loop for over a second.)
_TOKENS = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[{}\[\]]')
_VALUE = re.compile(rb'\s*:\s*(?:([{\[])|("[^"\\]*+(?:\\.[^"\\]*+)*+"|[^\s,}\]]+))')


def _top_level_value(body: bytes, key: bytes) -> tuple[int, int] | None:
    """The byte span of the value of a top-level `key` in a JSON object (the body parsed
    already, so it is valid JSON), or None. A key of that name deeper down is not it; one
    spelled with escapes (`"k\\u0065y"`) is; of several, the last (the one a JSON parser
    keeps)."""
    quoted = b'"' + key + b'"'
    depth = 0
    opened = -1  # where the value (an object or array) began, once found
    found: tuple[int, int] | None = None
    for m in _TOKENS.finditer(body):
        tok = m.group()
        if tok[0] == 0x22:  # a string
            if depth == 1 and opened < 0 and (tok == quoted or (
                    0x5C in tok and _decoded(tok) == key)):
                value = _VALUE.match(body, m.end())
                if value is None:  # a string value, not a key
                    continue
                if value.group(2) is not None:  # a scalar: its span is the match
                    found = value.start(2), value.end(2)
                else:
                    opened = value.start(1)
            continue
        if tok in (b"{", b"["):
            depth += 1
        else:
            depth -= 1
            if depth == 1 and opened >= 0:
                found = opened, m.end()
                opened = -1
    return found


def _decoded(tok: bytes) -> bytes | None:
    """A JSON string token's value as UTF-8 (None if it is not valid)."""
    try:
        s = orjson.loads(tok)
    except orjson.JSONDecodeError:
        return None
    try:
        return s.encode() if isinstance(s, str) else None
    except UnicodeEncodeError:  # a lone surrogate
        return None
