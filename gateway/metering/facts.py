"""What a response was, as either metering source observed it: the one record both produce.

ext_proc's `Meter` (gateway/metering/meter.py) builds it chunk by chunk; Envoy's record
(gateway/metering/record.py) carries it in the attributes its filters wrote. Everything
decided from it (outcome, usage, its source, the cancellation bill) is decided once, in
gateway/metering/billing.py, so the two sources cannot drift apart; a test feeds one corpus
through both and requires equal facts (tests/unit/test_metering_parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.usage_event import Usage


@dataclass(slots=True)  # not frozen: that costs µs a request (treated as immutable all the same)
class ResponseFacts:
    status: int = 0  # 0: no response (the client left before the engine answered)
    # Envoy's %RESPONSE_FLAGS% (who cut the stream: the engine, UPE, or the client, DC);
    # empty when unknown (ext_proc, until Envoy's word on a stream that ended early)
    flags: frozenset[str] = frozenset()
    ended: bool = False  # the response reached its end (end_of_stream; Envoy: no cut flag)
    end_seen: bool = False  # the engine's own end marker ([DONE], a terminal Responses
    # event, message_stop) or a whole JSON document
    engine_error: bool = False  # the engine reported a failure inside its stream
    content_events: int = 0  # events that carried content towards the client
    content_chars: int = 0  # the bytes of that content, as its JSON text was written
    usage: Usage | None = None  # as the engine reported it, normalised; None: not reported
    # `usage` is only the input side (an Anthropic stream cut after message_start): its
    # output is to be estimated from what streamed
    input_only: bool = False
    served_model: str = ""
    ttft_ms: float = 0.0  # to the first content event (a whole answer: to its first byte)
    generation_ms: float | None = None  # first to last content of a stream; None: not one

    @property
    def delivered(self) -> int:
        """Completion tokens estimated from the content that passed towards the client."""
        return max(self.content_events, -(-self.content_chars // 4))
