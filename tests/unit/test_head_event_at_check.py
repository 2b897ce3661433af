"""ext_proc metering: a HEAD the Check answers itself gets its event from the Check (Envoy's
answer has no body, so no ext_proc stream sees it), exactly once: a stream that does see it
(a config that sends response headers) emits none. Through real Envoy:
tests/e2e/test_metering_edges.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from gateway import envoy_contract as contract
from gateway.authz import answers
from gateway.authz.check import Allowed, Check, LocalReply
from gateway.authz.decision import Decision
from gateway.authz.request import AuthzRequest
from gateway.metering import handoff
from gateway.server.extproc_service import ExternalProcessorService
from testkit.check_requests import HeldAuthorizer
from tests.unit.test_check import ALLOW
from tests.unit.test_cut_streams import recorder


def _req(method: str) -> AuthzRequest:
    return AuthzRequest("h1", method, "/v1/chat/completions", {"authorization": "Bearer sk"},
                        b"")


async def _check(decision: Decision, method: str, bodiless: bool = True) -> tuple[
        object, list[dict]]:
    rec, spool = recorder()
    authorizer = HeldAuthorizer(decision)
    authorizer.release.set()
    out = await Check(authorizer, bodiless=rec if bodiless else None)(  # type: ignore[arg-type]
        _req(method))
    return out, [orjson.loads(e) for e in spool.events]


async def test_a_refused_head_is_emitted_once_by_the_check_and_marked() -> None:
    out, events = await _check(answers.unknown_url("HEAD", "/v1/chat/completions"), "HEAD")
    assert isinstance(out, LocalReply) and out.metadata[contract.METERED] is True
    [e] = events
    assert (e["event_id"], e["outcome"], e["status_code"], e["usage_source"]) == (
        "h1", "denied", 404, "")
    assert handoff.read(out.metadata).metered


async def test_only_a_head_and_only_with_ext_proc_metering() -> None:
    out, events = await _check(answers.unauthorized(), "POST")  # its body streams: ext_proc's
    assert events == [] and isinstance(out, LocalReply)
    assert contract.METERED not in out.metadata
    out, events = await _check(answers.unauthorized(), "HEAD", bodiless=False)  # Envoy source
    assert events == [] and contract.METERED not in out.metadata  # type: ignore[attr-defined]
    out, events = await _check(ALLOW, "HEAD")  # allowed: not ended yet, nothing here
    assert events == [] and isinstance(out, Allowed)


async def test_a_duplicate_id_gets_no_event_of_its_own() -> None:
    out, events = await _check(answers.duplicate_request_id("h1"), "HEAD")
    assert events == [] and contract.METERED not in out.metadata  # type: ignore[attr-defined]


async def _stream(msgs: list[ep.ProcessingRequest]) -> list[dict]:
    rec, spool = recorder()
    service = ExternalProcessorService(rec, rec.ledger)

    async def it() -> AsyncIterator[ep.ProcessingRequest]:
        for m in msgs:
            yield m

    async for _ in service.Process(it(), None):  # type: ignore[arg-type]
        pass
    return [orjson.loads(e) for e in spool.events]


def _headers_only(md: handoff.Metadata) -> ep.ProcessingRequest:
    msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders(end_of_stream=True))
    s = struct_pb2.Struct()
    s.update(md)
    msg.metadata_context.filter_metadata[contract.AUTHZ_NAMESPACE].CopyFrom(s)
    return msg


async def test_a_stream_of_a_head_the_check_metered_emits_nothing() -> None:
    md = handoff.denied("h1", "unknown_url", 404, "k", "t", "", "/v1/chat/completions")
    [e] = await _stream([_headers_only(md)])  # unmarked: the stream's event, as before
    assert (e["event_id"], e["outcome"]) == ("h1", "denied")
    handoff.metered(md)
    assert await _stream([_headers_only(md)]) == []
