"""The hand-written event JSON must be exactly the proto3 JSON mapping of usage.proto."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gateway.sinks.shipper import record
from gateway.sinks.usage_proto import from_json, proto_json, to_proto
from gateway.usage_event import Cancellation, Usage, UsageEvent, event_json, rfc3339

text = st.text(max_size=20)
count = st.integers(min_value=0, max_value=2**62)
ms = st.floats(min_value=0, max_value=1e9, allow_nan=False).map(lambda f: round(f, 3))


events = st.builds(
    UsageEvent, event_id=text, spoke=text, instance_id=text,
    seq=st.integers(min_value=0, max_value=2**63), started_at=text, ended_at=text,
    key_id=text, team=text, model=text, served_model=text, endpoint=text,
    stream=st.booleans(), status_code=st.integers(0, 599), outcome=text,
    usage=st.builds(Usage, count, count, count, count, count), usage_source=text,
    ttft_ms=ms, tpot_ms=ms, duration_ms=ms,
    cancellation=st.builds(Cancellation, text, count, count, count),
    cost=st.floats(min_value=0, max_value=1e12, allow_nan=False).map(lambda f: round(f, 9)),
    price_effective=text)


@given(events)
def test_event_json_is_the_proto3_json_mapping(event: UsageEvent) -> None:
    fast = event_json(event)
    assert orjson.loads(fast) == orjson.loads(proto_json(to_proto(event)))
    assert from_json(fast) == to_proto(event)


@given(events)
def test_the_cloudevents_headers_are_the_events_fields(event: UsageEvent) -> None:
    """The shipper reads them from the line's head (any text: quotes, escapes, non-ASCII)."""
    line = event_json(event)
    key, value, headers = record(line)
    assert (key, value) == (event.event_id.encode(), line)
    assert dict(headers) == {
        "ce_specversion": b"1.0", "ce_id": event.event_id.encode(),
        "ce_source": f"/gateway/{event.spoke}/{event.instance_id}".encode(),
        "ce_type": b"gateway.usage.v1", "ce_time": event.ended_at.encode(),
        "content-type": b"application/json"}


def _isoformat(ts: float) -> str:
    """What rfc3339 wrote before it cached the second's text."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False)
       | st.integers(0, 4_000_000_000).flatmap(
           lambda s: st.integers(0, 999_999).map(lambda us: s + (us + 0.5) / 1e6)))
def test_rfc3339_is_datetimes_isoformat_to_the_millisecond(ts: float) -> None:
    assert rfc3339(ts) == _isoformat(ts)


def test_rfc3339_rounds_as_datetime_does_at_the_edges() -> None:
    for ts in [0.0, 0.0005, 0.9999994, 0.9999995, 0.9999996, 1800000000.9999995,
               1764666031.4999995, 1764666031.0004995, 59.9999999, 86399.9999996, -1.5]:
        assert rfc3339(ts) == _isoformat(ts), ts
