"""A Check's answer (gateway/authz/check.py) as ext_authz's gRPC CheckResponse.

An allowed answer goes out already serialized (check_wire: the hot path's biggest cost),
its Shared part encoded once; a local reply as a protobuf message.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2 as pb
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from gateway.authz.check import Allowed, Answer, LocalReply
from gateway.metering import handoff
from gateway.server import check_wire

HVO = base_pb2.HeaderValueOption
OVERWRITE = HVO.OVERWRITE_IF_EXISTS_OR_ADD
_DENIED = status_pb2.Status(code=code_pb2.PERMISSION_DENIED)
_ENCODED = "grpc"  # this encoder's entry in Shared.encoded


def encode(answer: Answer) -> pb.CheckResponse | bytes:
    """An allow as its serialized bytes, a local reply as a message (both go out as they
    are)."""
    if isinstance(answer, Allowed):
        return _allowed(answer)
    return _local(answer)


def serialize(response: pb.CheckResponse | bytes) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def _allowed(a: Allowed) -> bytes:
    shared = a.shared.encoded.get(_ENCODED)
    if shared is None:
        shared = a.shared.encoded[_ENCODED] = check_wire.fixed(a.shared.upstream,
                                                               a.shared.metadata)
    return check_wire.allowed(a.upstream, a.remove, a.client.items(), a.metadata, shared)


def _local(r: LocalReply) -> pb.CheckResponse:
    """A denial, or the gateway's own answer: ext_authz's denied_response, whatever its
    status (Envoy sends it as a local reply)."""
    resp = pb.CheckResponse(status=_DENIED)
    local = resp.denied_response
    local.status.code = r.status  # type: ignore[assignment,unused-ignore]
    _set_headers(local.headers, r.headers)
    local.body = r.body.decode()
    _set_metadata(resp.dynamic_metadata, r.metadata)
    return resp


def _set_headers(field: Any, items: Iterable[tuple[str, str]]) -> None:
    for key, value in items:
        h = field.add()
        h.header.key = key
        h.header.value = value  # ext_authz reads HeaderValue.value only
        h.append_action = OVERWRITE


def _set_metadata(md: struct_pb2.Struct, values: handoff.Metadata) -> None:
    fields = md.fields
    for k, v in values.items():
        if isinstance(v, str):
            fields[k].string_value = v
        elif isinstance(v, bool):
            fields[k].bool_value = v
        else:
            fields[k].number_value = v
