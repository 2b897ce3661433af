"""The transport-neutral Check (gateway/authz/check.py): one answer per decision, which the
two doors' encoders (gateway/server/check_grpc.py, check_http.py) write alike; and the
Shared part of an allowed answer, built once per caller and request shape."""

from __future__ import annotations

import asyncio

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import attribute_context_pb2 as actx
from envoy.service.auth.v3 import external_auth_pb2 as pb

from gateway import envoy_contract as contract
from gateway.authz import answers
from gateway.authz.check import Allowed, Check, LocalReply, answer
from gateway.authz.decision import Allow, Caller, Callers, Context, Decision, Reply
from gateway.authz.request import AuthzRequest, api_key
from gateway.limits.types import RateInfo
from gateway.metering import handoff
from gateway.metering.inject import Injected, Splice
from gateway.server import check_grpc, check_http
from gateway.server.authz_service import to_request
from gateway.server.extproc_service import _plain
from testkit.check_requests import HeldAuthorizer

SPLICE = Splice(1, 0, b'"stream_options":{"include_usage":true},', Injected(True, False))
REQ = AuthzRequest("r1", "POST", "/v1/chat/completions",
                   {"authorization": "Bearer sk", "x-gateway-spoof": "1"}, b"{}")
CALLER = Caller("k1", "team-a", "m", "delivered")
ALLOW = Allow(Context("r1", CALLER, True, 1200, True, "/v1/chat/completions", 37,
                      include_usage=True, splice=SPLICE),
              RateInfo(req_limit=10, req_remaining=9, req_reset=0.1))
DECISIONS: list[Decision] = [ALLOW, answers.unauthorized(), answers.unavailable("down"),
                             answers.model_not_found("x"),
                             Reply(200, b'{"object":"list","data":[]}', "k1", "team-a")]


def test_a_caller_is_built_once_per_revision_key_and_model() -> None:
    callers = Callers()
    first = callers.get(1, "k1", "team-a", "m", "generated")
    assert callers.get(1, "k1", "team-a", "m", "generated") is first
    assert callers.get(1, "k1", "team-a", "other", "generated") is not first
    moved = callers.get(2, "k1", "team-b", "m", "delivered")  # a new revision: afresh
    assert (moved.team, moved.cancelled) == ("team-b", "delivered")


def test_the_shared_part_is_found_per_endpoint_and_flags() -> None:
    caller = Caller("k1", "team-a", "m")
    shared = caller.shared("/v1/chat/completions", True, True, False, True, False)
    assert caller.shared("/v1/chat/completions", True, True, False, True, False) is shared
    assert caller.shared("/v1/completions", True, True, False, True, False) is not shared
    others = {id(caller.shared("/v1/chat/completions", *(bool(i >> b & 1) for b in range(5))))
              for i in range(32)}
    assert len(others) == 32 and id(shared) in others
    assert shared.metadata == handoff.caller("k1", "team-a", "m", "/v1/chat/completions",
                                             True, True, False, True, False)
    assert dict(shared.upstream) == {"x-gateway-key-id": "k1", "x-gateway-team": "team-a",
                                     "x-gateway-model": "m",
                                     "x-gateway-inference-fairness-id": "team-a"}


def via_grpc(a: Allowed | LocalReply) -> tuple[int, dict[str, str], bytes, dict[str, object]]:
    """(status, headers, body, metadata) as Envoy reads a CheckResponse."""
    raw = check_grpc.serialize(check_grpc.encode(a))
    resp = pb.CheckResponse.FromString(raw)
    md = _plain(resp.dynamic_metadata)
    if resp.status.code == 0:
        ok = resp.ok_response
        headers = {h.header.key: h.header.value for h in ok.headers}
        headers[contract.REMOVE_HEADER] = ",".join(ok.headers_to_remove)
        headers |= {h.header.key: h.header.value for h in ok.response_headers_to_add}
        return 200, headers, b"", md
    d = resp.denied_response
    return (d.status.code, {h.header.key: h.header.value for h in d.headers}, d.body.encode(),
            md)


def via_http(a: Allowed | LocalReply) -> tuple[int, dict[str, str], bytes, dict[str, object]]:
    """The same as Envoy reads the HTTP door's answer (its stand-in statuses turned back)."""
    head, _, body = check_http.encode(a).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert int(headers.pop("content-length")) == len(body)
    md: dict[str, object] = {k: headers.pop(k) for k in list(headers)
                             if k in contract.METADATA_KEYS}
    wire = int(lines[0].split()[1])
    status = {w: s for s, w in contract.WIRE_STATUS.items()}.get(wire, wire)
    return status, headers, body, md


@pytest.mark.parametrize("decision", DECISIONS, ids=lambda d: type(d).__name__)
def test_both_doors_say_the_same(decision: Decision) -> None:
    a = answer(decision, REQ, "00-t-s-01")
    for _ in range(2):  # the Shared part encoded, then as remembered
        g, h = via_grpc(a), via_http(a)
        assert g[:3] == h[:3]
        assert handoff.read(g[3]) == handoff.read(h[3])  # the HTTP door's are strings
    if isinstance(decision, Allow):
        assert g[1][contract.REMOVE_HEADER] == "authorization,x-api-key,x-gateway-spoof"
        assert handoff.read(g[3]).splice == SPLICE and handoff.read(g[3]).include_usage


async def test_a_check_envoy_gives_up_on_undoes_its_admission() -> None:
    authorizer = HeldAuthorizer(ALLOW)
    check = Check(authorizer)  # type: ignore[arg-type]
    task = asyncio.create_task(check(REQ))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert authorizer.abandoned == ["r1"]
    authorizer.release.set()
    assert isinstance(await check(REQ), Allowed) and authorizer.abandoned == ["r1"]


def test_a_check_request_from_an_envoy_set_otherwise_reads_the_same() -> None:
    # encode_raw_headers: true sends `header_map` (values in raw_value, one entry per line)
    # and leaves `headers` empty; pack_as_bytes: false sends the body as the `body` string
    def check(*lines: tuple[str, str], body: str = '{"model":"m"}') -> AuthzRequest:
        http = actx.AttributeContext.HttpRequest(
            method="POST", path="/v1/chat/completions?x=1", body=body,
            header_map=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in lines]))
        return to_request(pb.CheckRequest(attributes=actx.AttributeContext(
            request=actx.AttributeContext.Request(http=http))))

    req = check(("authorization", "Bearer sk-1"), ("x-request-id", "r9"),
                ("x-gateway-spoof", "admin"))
    assert (req.request_id, req.path, req.body) == ("r9", "/v1/chat/completions",
                                                     b'{"model":"m"}')
    assert api_key(req.headers) == "sk-1"
    assert "x-gateway-spoof" in answers.removed_headers(req.headers, CALLER.keeps)
    # a header sent twice is two entries: joined as Envoy's `headers` joins them, no key
    assert api_key(check(("authorization", "Bearer sk-1"),
                         ("authorization", "Bearer sk-2")).headers) is None
