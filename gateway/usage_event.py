"""The usage event (protos/gateway/usage/v1/usage.proto), what it carries, and its JSON.

A leaf: metering makes the event and sinks encode it, so the type sits below both and
imports nothing of the gateway.

The value on the topic is the proto3 JSON mapping with the proto's field names: 64-bit
integers are JSON strings, and every field is present, zeros included. `event_json` writes
that mapping directly with orjson (json_format costs ~100 µs an event, on every request),
so the metering core needs no protobuf; the proto encoding is the sink's
(gateway/sinks/usage_proto.py), and a test keeps the two equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson

CE_TYPE = "gateway.usage.v1"


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


_SECONDS: dict[int, str] = {}  # "2026-12-02T09:00:31" by epoch second: every event has two


def rfc3339(ts: float) -> str:
    """`ts` in RFC 3339, UTC, to the millisecond (truncated, as isoformat does, after
    datetime's own rounding to the microsecond: half to even). The second's text is cached:
    formatting a datetime cost ~2 µs, twice an event; a test keeps this equal to `_rfc3339`."""
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)
    if ts < 0 or us < 0:
        return _rfc3339(ts)
    sec = int(whole)
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    head = _SECONDS.get(sec)
    if head is None:
        if len(_SECONDS) >= 64:
            _SECONDS.clear()
        head = _SECONDS[sec] = datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{head}.{us // 1000:03d}Z"


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts (gateway/metering/usage.py reads them from each API's answers)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, read from the engine's prompt cache
    reasoning_tokens: int = 0  # of completion_tokens
    cache_creation_tokens: int = 0  # of prompt_tokens, written to the cache (Anthropic)


@dataclass(frozen=True, slots=True)
class Cancellation:
    """The facts of a client-cancelled stream, and the rule it was billed by
    (gateway/metering/cancel.py). All empty for every other outcome."""

    billing_rule: str = ""
    prompt_tokens: int = 0  # the prompt the engine processed (billed unless `none`)
    generated_completion_tokens: int = 0
    delivered_completion_tokens: int = 0


NOT_CANCELLED = Cancellation()


@dataclass(slots=True)  # not frozen: that cost ~2 µs an event (treated as immutable all the same)
class UsageEvent:
    event_id: str
    spoke: str
    instance_id: str
    seq: int
    started_at: str
    ended_at: str
    key_id: str
    team: str
    model: str
    served_model: str
    endpoint: str
    stream: bool
    status_code: int
    outcome: str
    usage: Usage
    usage_source: str
    ttft_ms: float
    tpot_ms: float
    duration_ms: float
    cancellation: Cancellation = NOT_CANCELLED
    cost: float = 0.0  # at the price in force at started_at (gateway/metering/cost.py)
    price_effective: str = ""  # that price's `effective`, RFC 3339; "" = no price


def event_json(e: UsageEvent) -> bytes:
    u, c = e.usage, e.cancellation
    return orjson.dumps({
        "event_id": e.event_id, "spoke": e.spoke, "instance_id": e.instance_id,
        "seq": str(e.seq), "started_at": e.started_at, "ended_at": e.ended_at,
        "key_id": e.key_id, "team": e.team, "model": e.model, "served_model": e.served_model,
        "endpoint": e.endpoint, "stream": e.stream, "status_code": e.status_code,
        "outcome": e.outcome,
        "usage": {
            "prompt_tokens": str(u.prompt_tokens), "completion_tokens": str(u.completion_tokens),
            "total_tokens": str(u.total_tokens), "cached_tokens": str(u.cached_tokens),
            "reasoning_tokens": str(u.reasoning_tokens),
            "cache_creation_tokens": str(u.cache_creation_tokens),
        },
        "usage_source": e.usage_source,
        "timing": {"ttft_ms": e.ttft_ms, "tpot_ms": e.tpot_ms, "duration_ms": e.duration_ms},
        "cancellation": {
            "billing_rule": c.billing_rule, "prompt_tokens": str(c.prompt_tokens),
            "generated_completion_tokens": str(c.generated_completion_tokens),
            "delivered_completion_tokens": str(c.delivered_completion_tokens),
        },
        "cost": e.cost, "price_effective": e.price_effective,
    })
