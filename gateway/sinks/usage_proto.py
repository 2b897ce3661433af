"""The usage event as its protobuf message (protos/gateway/usage/v1/usage.proto).

The sink's side of the event: what is shipped is `event_json`'s bytes, which are the
proto3 JSON mapping of this message; json_format here is the slow reference for that
mapping, and the parser the billing consumer reads the topic with.
"""

from __future__ import annotations

from google.protobuf import json_format

from gateway._proto.gateway.usage.v1 import usage_pb2
from gateway.usage_event import UsageEvent


def to_proto(e: UsageEvent) -> usage_pb2.UsageEvent:
    u, c = e.usage, e.cancellation
    return usage_pb2.UsageEvent(
        event_id=e.event_id, spoke=e.spoke, instance_id=e.instance_id, seq=e.seq,
        started_at=e.started_at, ended_at=e.ended_at, key_id=e.key_id, team=e.team,
        model=e.model, served_model=e.served_model, endpoint=e.endpoint, stream=e.stream,
        status_code=e.status_code, outcome=e.outcome,
        usage=usage_pb2.Usage(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
            total_tokens=u.total_tokens, cached_tokens=u.cached_tokens,
            reasoning_tokens=u.reasoning_tokens, cache_creation_tokens=u.cache_creation_tokens),
        usage_source=e.usage_source,
        timing=usage_pb2.Timing(ttft_ms=e.ttft_ms, tpot_ms=e.tpot_ms, duration_ms=e.duration_ms),
        cancellation=usage_pb2.Cancellation(  # always set: every field is present in the JSON
            billing_rule=c.billing_rule, prompt_tokens=c.prompt_tokens,
            generated_completion_tokens=c.generated_completion_tokens,
            delivered_completion_tokens=c.delivered_completion_tokens),
        cost=e.cost, price_effective=e.price_effective,
    )


def proto_json(event: usage_pb2.UsageEvent) -> bytes:
    """The reference mapping, by json_format (slow; used to check `event_json`)."""
    return json_format.MessageToJson(
        event, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
        indent=None).encode()


def from_json(data: bytes | str) -> usage_pb2.UsageEvent:
    return json_format.Parse(data, usage_pb2.UsageEvent(), ignore_unknown_fields=True)
