"""The usage event (protos/gateway/usage/v1/usage.proto) and its Kafka framing.

The value is the proto3 JSON mapping with the proto's field names (64-bit integers are
therefore JSON strings, as the mapping says; every field is present, zeros included).
Headers follow CloudEvents 1.0 binary mode.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format

from gateway._proto.gateway.usage.v1 import usage_pb2

CE_TYPE = "gateway.usage.v1"
OUTCOMES = ("completed", "client_cancelled", "upstream_error", "denied")


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def to_json(event: usage_pb2.UsageEvent) -> bytes:
    return json_format.MessageToJson(
        event, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
        indent=None).encode()


def from_json(data: bytes | str) -> usage_pb2.UsageEvent:
    return json_format.Parse(data, usage_pb2.UsageEvent(), ignore_unknown_fields=True)


def new_event(**fields: Any) -> usage_pb2.UsageEvent:
    return usage_pb2.UsageEvent(**fields)
