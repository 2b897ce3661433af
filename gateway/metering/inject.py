"""Ask the engine for usage on the client's behalf, by splicing bytes into the request.

The plan is made once, at the Check, from the body ext_authz already holds; it travels to
whoever applies it as metadata (the Lua filter in Envoy, or the ext_proc handler), so
neither searches the body again. A 400 KB prompt is never re-serialised: when the client
sent no `stream_options`, the object is inserted right after the body's opening brace.
Only a client that sent its own `stream_options` (without what we need) pays for a scan
to find that object, which is then replaced, merged, in place.
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
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]]')
_VALUE = re.compile(rb'\s*:\s*(?:([{\[])|("(?:[^"\\]|\\.)*"|[^\s,}\]]+))')


def _top_level_value(body: bytes, key: bytes) -> tuple[int, int] | None:
    """The byte span of the value of a top-level `key` in a JSON object (the body parsed
    already, so it is valid JSON), or None. A key of that name deeper down is not it."""
    quoted = b'"' + key + b'"'
    depth = 0
    opened = -1  # where the value (an object or array) began, once found
    for m in _TOKENS.finditer(body):
        tok = m.group()
        if tok[0] == 0x22:  # a string
            if depth == 1 and opened < 0 and tok == quoted:
                value = _VALUE.match(body, m.end())
                if value is None:
                    continue
                if value.group(2) is not None:  # a scalar: its span is the match
                    return value.start(2), value.end(2)
                opened = value.start(1)
            continue
        if tok in (b"{", b"["):
            depth += 1
        else:
            depth -= 1
            if depth == 1 and opened >= 0:
                return opened, m.end()
    return None
