"""The hand-written CheckResponse bytes parse to exactly what the protobuf API builds."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2 as pb
from google.protobuf import struct_pb2
from google.rpc import status_pb2
from hypothesis import given
from hypothesis import strategies as st

from gateway.server import check_wire

HVO = base_pb2.HeaderValueOption

names = st.text(min_size=1, max_size=40)
values = st.text(max_size=300)  # beyond 127 bytes: multi-byte length varints
headers = st.lists(st.tuples(names, values), max_size=12)
scalars = st.one_of(
    st.text(max_size=200), st.booleans(),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.floats(allow_nan=False))


def reference(upstream: list[tuple[str, str]], remove: list[str],
              response: list[tuple[str, str]], metadata: dict[str, object]) -> pb.CheckResponse:
    def opts(items: list[tuple[str, str]]) -> list[HVO]:
        return [HVO(header=base_pb2.HeaderValue(key=k, value=v),
                    append_action=HVO.OVERWRITE_IF_EXISTS_OR_ADD) for k, v in items]
    md = struct_pb2.Struct()
    md.update(metadata)
    return pb.CheckResponse(
        status=status_pb2.Status(code=0),
        ok_response=pb.OkHttpResponse(headers=opts(upstream), headers_to_remove=remove,
                                      response_headers_to_add=opts(response)),
        dynamic_metadata=md)


@given(upstream=headers, remove=st.lists(names, max_size=5), response=headers,
       metadata=st.dictionaries(names, scalars, max_size=14))
def test_bytes_parse_to_the_reference_message(
        upstream: list[tuple[str, str]], remove: list[str], response: list[tuple[str, str]],
        metadata: dict[str, str | int | bool]) -> None:
    raw = check_wire.allowed(upstream, remove, response, metadata)
    assert pb.CheckResponse.FromString(raw) == reference(upstream, remove, response, metadata)


@given(upstream=headers, also_upstream=headers, remove=st.lists(names, max_size=5),
       response=headers, metadata=st.dictionaries(names, scalars, max_size=8),
       also_metadata=st.dictionaries(names, scalars, max_size=8))
def test_fixed_parts_join_the_answer_as_if_passed_each_time(
        upstream: list[tuple[str, str]], also_upstream: list[tuple[str, str]], remove: list[str],
        response: list[tuple[str, str]], metadata: dict[str, str | int | bool],
        also_metadata: dict[str, str | int | bool]) -> None:
    also_metadata = {k: v for k, v in also_metadata.items() if k not in metadata}
    raw = check_wire.allowed(upstream, remove, response, metadata,
                             check_wire.fixed(also_upstream, also_metadata))
    assert pb.CheckResponse.FromString(raw) == reference(
        upstream + also_upstream, remove, response, {**metadata, **also_metadata})


def test_a_typical_answer() -> None:
    args = ([("x-gateway-request-id", "3ec987ef-b177-4475-adaf-9772b1f58b0f"),
             ("x-gateway-team", "team-a")],
            ["authorization", "x-api-key"],
            [("x-ratelimit-limit-requests", "100"), ("x-ratelimit-reset-requests", "1s")],
            {"request_id": "r", "stream": True, "reserved": 1030, "leased": False})
    parsed = pb.CheckResponse.FromString(check_wire.allowed(*args))
    assert parsed == reference(*args)  # type: ignore[arg-type]
    assert parsed.dynamic_metadata.fields["reserved"].number_value == 1030
