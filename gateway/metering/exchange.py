"""One request as ext_proc sees it, phase by phase, without gRPC (sans-I/O).

The ext_proc server (gateway/server/extproc_service.py) only translates: it reads each
message into one call here and wraps the answer back into a message. Everything decided
about the request lives here: the splice applied to its body, how its response is
recognised, and how it ended (the event's outcome).
"""

from __future__ import annotations

import time

from gateway.metering import billing
from gateway.metering.facts import ResponseFacts
from gateway.metering.handoff import RequestFacts
from gateway.metering.meter import Meter

SSE_STARTS = (b"data:", b"event:", b":", b"id:", b"retry:")


def _undecided(head: bytes) -> bool:
    """The first bytes are too few to tell: the start of a field name ("dat", "event"),
    not yet a whole one (Envoy splits an upstream read anywhere)."""
    return not head.startswith(SSE_STARTS) and any(s.startswith(head) for s in SSE_STARTS)


class Exchange:
    """The request's facts, its meter, and how far its response got."""

    def __init__(self) -> None:
        self.started = time.time()
        self.facts: RequestFacts | None = None  # known from the first message on
        self.meter = Meter(endpoint="", stream=False)
        self.ended = False  # end_of_stream seen on the response
        self.sniffed = False  # the response's kind (SSE or not) is known
        self._early = b""  # first bytes held back until they say which kind

    def learn(self, facts: RequestFacts) -> None:
        self.facts = facts
        self.meter = Meter(endpoint=facts.endpoint, stream=facts.stream,
                           prompt_estimate=facts.prompt_estimate, weights=facts.weights)

    def request_body(self, body: bytes) -> bytes | None:
        """The body with the splice the Check planned (gateway/metering/inject.py) applied,
        or None to pass it unchanged (no splice, or a body shorter than the plan)."""
        sp = self.facts.splice if self.facts is not None else None
        if sp is None or len(body) < sp.at + sp.cut:
            return None
        self.meter.injected = sp.injected
        return sp.apply(body)

    def response_start(self, status: int | None, first: bytes, end: bool = False) -> None:
        """The response's first body bytes, with the status when Envoy sent it along (response
        headers skipped, as on the API's POST routes: SSE is recognised by its first bytes)."""
        if status is not None:
            self.meter.status = status
        head = first[:64].lstrip()[:6]
        if head and (end or not _undecided(head)):  # an empty first chunk says nothing yet
            self.sniffed = True
            sse = head.startswith(SSE_STARTS)
            self.meter.response_headers(self.meter.status, "text/event-stream" if sse else "")

    def response_headers(self, status: int, content_type: str, end: bool) -> None:
        self.meter.response_headers(status, content_type)
        self.sniffed = True
        self.ended = self.ended or end

    def response_body(self, chunk: bytes, end: bool, status: int | None = None) -> bytes:
        """The bytes to send on for this chunk (changed only to hide what was injected)."""
        if not self.sniffed:
            chunk, self._early = self._early + chunk, b""
            self.response_start(status, chunk, end)
            if not self.sniffed and chunk.strip():  # "dat": held until the next bytes
                self._early = chunk
                return b""
        out = self.meter.chunk(chunk, end)
        self.ended = self.ended or end
        return chunk if out is None else out

    def response_trailers(self) -> None:
        self.ended = True

    def response(self, flags: frozenset[str] = frozenset()) -> ResponseFacts:
        """The response's facts as seen so far; `flags`: Envoy's word on who ended it."""
        return self.meter.facts(ended=self.ended, flags=flags)

    def outcome(self) -> str:
        return billing.outcome(self.facts or RequestFacts(), self.response())
