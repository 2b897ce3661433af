"""Incremental, sans-I/O decoder of Server-Sent Events (the WHATWG event-stream format).

Chunks from Envoy do not follow event boundaries: `feed` keeps the unfinished tail and
returns only complete events, each with its raw bytes so a caller can pass an event
through untouched or drop it. Handles \\n, \\r\\n and \\r line ends, comments, multi-line
data and `event:` names. Memory is bounded: an event larger than `max_event` is
discarded (counted in `oversized`), never buffered without limit.
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


class SseDecoder:
    def __init__(self, max_event: int = 4 << 20) -> None:
        self._buf = b""
        self.max_event = max_event
        self.oversized = 0

    def feed(self, chunk: bytes) -> list[SseEvent]:
        buf = self._buf + chunk if self._buf else chunk
        events = []
        start = 0
        for m in _BOUNDARY.finditer(buf):
            if m.start() < start:
                continue
            raw = buf[start:m.end()]
            start = m.end()
            events.append(parse_event(raw))
        self._buf = buf[start:]
        if len(self._buf) > self.max_event:
            self._buf = b""
            self.oversized += 1
        return events

    def flush(self) -> list[SseEvent]:
        """At end of stream: an unterminated last event still counts (engines that forget
        the final blank line), but an empty tail does not."""
        tail, self._buf = self._buf, b""
        return [parse_event(tail)] if tail.strip() else []

    @property
    def pending(self) -> bytes:
        return self._buf
