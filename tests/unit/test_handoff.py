"""The ext_authz → metering contract round-trips (gateway/metering/handoff.py): what the Check
writes is what ext_proc, Envoy's record and the orphan sweep read back, through the same
encodings Envoy uses (a Struct on the wire, the Struct as JSON in the access log)."""

from __future__ import annotations

import orjson
import pytest
from envoy.service.auth.v3 import external_auth_pb2 as pb
from google.protobuf import json_format

from gateway import envoy_contract as contract
from gateway.metering import handoff
from gateway.metering.handoff import RequestFacts
from gateway.metering.inject import Injected, Splice
from gateway.server import check_http, check_wire
from gateway.server.extproc_service import _plain

SPLICE = Splice(1, 0, b'"stream_options":{"include_usage":true},', Injected(True, False))

ALLOWED = handoff.allowed("r1", 1200, 37, "00-abc-def-01", SPLICE) | handoff.caller(
    "k1", "team-a", "m", "/v1/chat/completions", True, True, False, False, True, "delivered")
ALLOWED_FACTS = RequestFacts(
    request_id="r1", key_id="k1", team="team-a", model="m", endpoint="/v1/chat/completions",
    stream=True, leased=True, prompt_estimate=37, continuous_usage=True,
    traceparent="00-abc-def-01", splice=SPLICE, cancelled="delivered")


def via_struct(md: handoff.Metadata) -> dict[str, object]:
    """As ext_proc sees it: the Check's hand-written bytes, parsed, then made plain."""
    wire = check_wire.allowed(upstream=(), remove=(), response_headers=(), metadata=md)
    return _plain(pb.CheckResponse.FromString(wire).dynamic_metadata)


def via_record(md: handoff.Metadata) -> dict[str, object]:
    """As Envoy's record carries it: the Struct rendered as JSON (%DYNAMIC_METADATA%)."""
    wire = check_wire.allowed(upstream=(), remove=(), response_headers=(), metadata=md)
    value: dict[str, object] = orjson.loads(json_format.MessageToJson(
        pb.CheckResponse.FromString(wire).dynamic_metadata))
    return value


def via_http_door(md: handoff.Metadata) -> dict[str, object]:
    """As ext_authz's HTTP door carries it: a header per entry, which Envoy files as a string
    (and the record renders as such)."""
    lines = check_http.metadata_headers(md).decode().split("\r\n")
    return dict(line.split(": ", 1) for line in lines if line)


CARRIERS = [dict, via_struct, via_record, via_http_door]


@pytest.mark.parametrize("carry", CARRIERS)
def test_an_allowed_request_reads_back_as_written(carry: object) -> None:
    assert handoff.read(carry(ALLOWED)) == ALLOWED_FACTS  # type: ignore[operator]


@pytest.mark.parametrize("carry", CARRIERS)
def test_a_denial_reads_back_with_its_status(carry: object) -> None:
    md = handoff.denied("r2", "rps", 429, "k1", "team-a", "m", "/v1/completions")
    assert handoff.read(carry(md)) == RequestFacts(  # type: ignore[operator]
        request_id="r2", key_id="k1", team="team-a", model="m", endpoint="/v1/completions",
        denied_status=429)


@pytest.mark.parametrize("carry", CARRIERS)
def test_a_denied_stream_reads_back_as_a_stream(carry: object) -> None:
    md = handoff.denied("r2", "rps", 429, "k1", "team-a", "m", "/v1/completions", stream=True)
    assert handoff.read(carry(md)).stream is True  # type: ignore[operator]


@pytest.mark.parametrize("carry", CARRIERS)
def test_the_gateways_own_answer_is_not_a_denial(carry: object) -> None:
    md = handoff.replied("r3", "k1", "team-a", "", "/v1/models", "00-t-s-01")
    facts = handoff.read(carry(md))  # type: ignore[operator]
    assert facts.denied_status == 0 and facts.key_id == "k1" and facts.traceparent


def test_envoys_own_ids_fill_in_what_no_check_said() -> None:
    facts = handoff.read({}, path="/v1/embeddings?x=1", request_id="envoy-rid")
    assert (facts.request_id, facts.endpoint, facts.key_id) == ("envoy-rid", "/v1/embeddings", "")
    facts = handoff.read(ALLOWED, path="/other", request_id="envoy-rid")
    assert (facts.request_id, facts.endpoint) == ("r1", "/v1/chat/completions")


def test_values_of_the_wrong_type_read_as_absent() -> None:
    facts = handoff.read({"key_id": 5, "stream": "yes", "prompt_estimate": True,
                          "leased": 1, "status": 429})
    assert facts == RequestFacts()


def test_an_orphans_meta_round_trips() -> None:
    meta = handoff.orphan_meta("k1", "team-a", "m", "/v1/chat/completions", True)
    assert meta == '["k1","team-a","m","/v1/chat/completions",true]'  # as stored in Redis
    assert handoff.orphan_facts("r9", meta) == RequestFacts(
        request_id="r9", key_id="k1", team="team-a", model="m",
        endpoint="/v1/chat/completions", stream=True)


@pytest.mark.parametrize("meta", ["", "not json", "[1, 2]", '{"key_id": "k"}'])
def test_an_unreadable_orphan_meta_still_names_the_request(meta: str) -> None:
    assert handoff.orphan_facts("r9", meta) == RequestFacts(request_id="r9")


@pytest.mark.parametrize("value", [None, "", "everything", 3, True])
def test_a_missing_or_unknown_cancel_rule_reads_as_the_default(value: object) -> None:
    """A Check from a version that wrote no rule (or garbage) bills as before: generated."""
    md = dict(ALLOWED)
    if value is None:
        del md["cancelled"]
    else:
        md["cancelled"] = value  # type: ignore[assignment]
    assert handoff.read(md).cancelled == "generated"


def test_the_lua_filter_gets_its_names_from_the_contract() -> None:
    """The Lua cannot import Python: its loader writes gateway/envoy_contract.py's names into
    it as locals, and the file itself spells none of them."""
    from importlib import resources

    from gateway.envoyconf import lua

    source = lua.source()
    assert f'local AUTHZ_NS = "{contract.AUTHZ_NAMESPACE}"' in source
    assert f'local STREAM_NS = "{contract.STREAM_NAMESPACE}"' in source
    assert f'local SPLICE = "{contract.SPLICE}"' in source
    raw = resources.files(lua).joinpath("metering.lua").read_text(encoding="utf-8")
    code = "\n".join(line.partition("--")[0] for line in raw.splitlines())
    assert lua.MARKER in raw and lua.MARKER not in source
    for name in (contract.AUTHZ_NAMESPACE, contract.STREAM_NAMESPACE, contract.USAGE_NAMESPACE):
        assert name not in code
    for key in (contract.SPLICE, contract.SPLICE_AT, contract.SPLICE_CUT, contract.HIDE_USAGE,
                contract.HIDE_CONTINUOUS, contract.CONTENT_EVENTS, contract.CONTENT_CHARS,
                contract.STREAM_DONE, contract.STREAM_FAILED):
        assert f'"{key}"' not in code and f"facts.{key}" not in code
