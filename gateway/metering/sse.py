"""Incremental, sans-I/O decoder of Server-Sent Events (the WHATWG event-stream format).

Chunks from Envoy do not follow event boundaries: `feed` keeps the unfinished tail and
returns only complete events, each with its raw bytes so a caller can pass an event
through untouched or drop it. Handles \\n, \\r\\n and \\r line ends, comments, multi-line
data and `event:` names. As the Lua filter does (gateway/envoyconf/lua/metering.lua), so that
both metering sources count the same: memory is bounded, an event that outgrows `max_event`
without its end is passed on as raw pieces (`SseEvent.whole` False: never read) up to its
end, counted in `oversized`; and a last event without its blank line is passed on unread
(`flush`: an SSE client discards it too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r|\r\n\n|\n\r\n")
_LINE = re.compile(rb"\r\n|\n|\r")


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes  # the event's bytes as received, including its terminating blank line
    data: bytes  # data lines joined with \n ("" for an event without data)
    event: bytes = b""  # the `event:` field, if any
    whole: bool = True  # False: raw bytes passed on unread (an oversized or unterminated event)

    @property
    def done(self) -> bool:
        return self.data == b"[DONE]"


def parse_event(raw: bytes) -> SseEvent:
    data: list[bytes] = []
    event = b""
    for line in _LINE.split(raw):
        if not line or line[0] == 0x3A:  # blank, or ':' comment
            continue
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value
    return SseEvent(raw, b"\n".join(data), event)


def _unread(raw: bytes) -> SseEvent:
    return SseEvent(raw, b"", b"", whole=False)


class SseDecoder:
    def __init__(self, max_event: int = 1 << 20) -> None:
        self._buf = b""
        self.max_event = max_event  # the Lua filter's MAX_HELD
        self.oversized = 0
        self._passing = False  # passing on the rest of an oversized event
        self._tail2 = b""  # its last two bytes: a boundary may straddle two chunks

    def feed(self, chunk: bytes) -> list[SseEvent]:
        events = []
        if self._passing:
            probe = self._tail2 + chunk
            m = _BOUNDARY.search(probe)
            if m is None:
                self._tail2 = probe[-2:]
                return [_unread(chunk)] if chunk else []
            stop = m.end() - len(self._tail2)
            self._passing, self._tail2 = False, b""
            events.append(_unread(chunk[:stop]))
            chunk = chunk[stop:]
        buf = self._buf + chunk if self._buf else chunk
        start = 0
        for m in _BOUNDARY.finditer(buf):
            if m.start() < start:
                continue
            raw = buf[start:m.end()]
            start = m.end()
            events.append(parse_event(raw))
        self._buf = buf[start:]
        if start == 0 and len(self._buf) > self.max_event:
            # no event ends in it and it outgrew the bound: pass it on unread up to its end
            events.append(_unread(self._buf))
            self._passing, self._tail2, self._buf = True, self._buf[-2:], b""
            self.oversized += 1
        return events

    def flush(self) -> list[SseEvent]:
        """At end of stream: an unterminated last event is passed on as it came, unread (an
        SSE client discards it; the Lua filter neither counts it)."""
        tail, self._buf = self._buf, b""
        self._passing, self._tail2 = False, b""
        return [_unread(tail)] if tail else []

    @property
    def pending(self) -> bytes:
        return self._buf
