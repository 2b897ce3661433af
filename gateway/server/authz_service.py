"""ext_authz Check: CheckRequest → AuthzRequest → Authorizer → CheckResponse."""

from __future__ import annotations

import time

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2 as pb
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from gateway.authz import answers
from gateway.authz.decision import Allow, Decision, Deny
from gateway.authz.engine import Authorizer
from gateway.authz.request import AuthzRequest
from gateway.log import log
from gateway.server import metrics

HVO = base_pb2.HeaderValueOption
OVERWRITE = HVO.OVERWRITE_IF_EXISTS_OR_ADD
_OK = status_pb2.Status(code=code_pb2.OK)
_DENIED = status_pb2.Status(code=code_pb2.PERMISSION_DENIED)
_STRIP = ("authorization", "x-api-key")
METADATA_NS = "envoy.filters.http.ext_authz"


def hdr(key: str, value: str) -> base_pb2.HeaderValueOption:
    # ext_authz reads HeaderValue.value only (raw_value would give an empty header).
    return HVO(header=base_pb2.HeaderValue(key=key, value=value), append_action=OVERWRITE)


def to_request(check: pb.CheckRequest) -> AuthzRequest:
    http = check.attributes.request.http
    headers = dict(http.headers)
    return AuthzRequest(
        request_id=headers.get("x-request-id", ""),
        method=http.method,
        path=http.path.partition("?")[0],
        headers=headers,
        body=http.raw_body,
    )


def to_response(decision: Decision, req: AuthzRequest) -> pb.CheckResponse:
    if isinstance(decision, Deny):
        return _denied(decision, req)
    return _allowed(decision, req)


def _allowed(allow: Allow, req: AuthzRequest) -> pb.CheckResponse:
    c = allow.context
    upstream = [
        hdr("x-gateway-request-id", c.request_id),
        hdr("x-gateway-key-id", c.key_id),
        hdr("x-gateway-team", c.team),
        hdr("x-gateway-model", c.model),
    ]
    ours = {"x-gateway-request-id", "x-gateway-key-id", "x-gateway-team", "x-gateway-model"}
    # Client-sent x-gateway-* headers are forged context: ours overwrite, the rest go.
    remove = [*_STRIP, *(h for h in req.headers if h.startswith("x-gateway-") and h not in ours)]
    rate = answers.rate_headers(allow.rate)
    md = struct_pb2.Struct()
    md.update({
        "request_id": c.request_id, "key_id": c.key_id, "team": c.team, "model": c.model,
        "stream": c.stream, "reserved": c.reserved, "leased": c.leased,
        "endpoint": c.endpoint, "prompt_estimate": c.prompt_estimate,
        "stream_options": c.stream_options, "include_usage": c.include_usage,
        "continuous_usage": c.continuous_usage,
    })
    return pb.CheckResponse(
        status=_OK,
        ok_response=pb.OkHttpResponse(
            headers=upstream,
            headers_to_remove=remove,
            response_headers_to_add=[hdr(k, v) for k, v in rate.items()],
        ),
        dynamic_metadata=md,
    )


def _denied(deny: Deny, req: AuthzRequest) -> pb.CheckResponse:
    headers = [hdr("content-type", "application/json")]
    headers += [hdr(k, v) for k, v in deny.headers.items()]
    md = struct_pb2.Struct()
    md.update({"request_id": req.request_id, "denied": deny.reason, "status": deny.status,
               "key_id": deny.key_id, "team": deny.team, "model": deny.model,
               "endpoint": req.path})
    return pb.CheckResponse(
        status=_DENIED,
        denied_response=pb.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=deny.status),  # type: ignore[arg-type,unused-ignore]
            headers=headers,
            body=answers.error_body(deny, req.request_id).decode(),
        ),
        dynamic_metadata=md,
    )


class AuthorizationService(pb_grpc.AuthorizationServicer):
    def __init__(self, authorizer: Authorizer) -> None:
        self.authorizer = authorizer

    async def Check(
        self, request: pb.CheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckResponse:
        t0 = time.perf_counter()
        req = to_request(request)
        decision = await self.authorizer.check(req)
        metrics.observe_decision(decision, time.perf_counter() - t0)
        if isinstance(decision, Deny):
            log.info("denied", request_id=req.request_id, status=decision.status,
                     reason=decision.reason, tier=decision.tier)
        return to_response(decision, req)
