"""Ask the engine for usage on the client's behalf, by splicing bytes into the request.

A 400 KB prompt is not re-serialised: when the client sent no `stream_options`, the
object is inserted right after the body's opening brace. Only a client that sent its own
`stream_options` (without what we need) pays for a parse and a dump.
"""

from __future__ import annotations

import orjson

STREAMING_USAGE_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions"})


def splice_stream_options(body: bytes, options: dict[str, bool], present: bool) -> bytes | None:
    """The body with `options` merged into `stream_options`; None if it cannot be done."""
    if not present:
        start = len(body) - len(body.lstrip())
        if body[start:start + 1] != b"{":
            return None
        rest = body[start + 1:]
        sep = b"" if rest.lstrip().startswith(b"}") else b","
        return body[:start + 1] + b'"stream_options":' + orjson.dumps(options) + sep + rest
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("stream_options"), dict):
        return None
    data["stream_options"].update(options)
    return orjson.dumps(data)
