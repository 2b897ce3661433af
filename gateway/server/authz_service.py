"""ext_authz Check: CheckRequest → AuthzRequest → Authorizer → CheckResponse."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2 as pb
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from gateway import metrics, tracing
from gateway.authz import answers
from gateway.authz.decision import Allow, Decision, Deny, Reply
from gateway.authz.engine import Authorizer
from gateway.authz.request import AuthzRequest
from gateway.endpoints import api_of
from gateway.log import log
from gateway.metering import handoff
from gateway.policy.billing_rules import CancelRule
from gateway.server import check_wire

HVO = base_pb2.HeaderValueOption
OVERWRITE = HVO.OVERWRITE_IF_EXISTS_OR_ADD
_DENIED = status_pb2.Status(code=code_pb2.PERMISSION_DENIED)
SERVICE = "envoy.service.auth.v3.Authorization"

_ALLOWED = metrics.DECISIONS.labels("allowed", "", "")
_ANSWERED = metrics.DECISIONS.labels("answered", "", "")  # our own answer (GET /v1/models)


def observe_decision(decision: Decision, seconds: float) -> None:
    metrics.CHECK_SECONDS.observe(seconds)
    if isinstance(decision, Deny):
        metrics.DECISIONS.labels("denied", decision.reason, decision.tier or "").inc()
    elif isinstance(decision, Allow):
        _ALLOWED.inc()
    else:
        _ANSWERED.inc()


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


def to_response(decision: Decision, req: AuthzRequest,
                traceparent: str = "") -> pb.CheckResponse | bytes:
    """A denial as a message; an allow as its serialized bytes (both go out as they are).
    A traced request's `traceparent` rides in the metadata to ext_proc, which sees no
    request headers."""
    if isinstance(decision, Deny):
        return _denied(decision, req, traceparent)
    if isinstance(decision, Reply):
        return _replied(decision, req, traceparent)
    return _allowed(decision, req, traceparent)


def _serialize(response: pb.CheckResponse | bytes) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


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


def _allowed(allow: Allow, req: AuthzRequest, traceparent: str = "") -> bytes:
    """The OK answer, already serialized (see check_wire: the hot path's biggest cost)."""
    c = allow.context
    return check_wire.allowed(
        upstream=(("x-gateway-request-id", c.request_id),),
        remove=answers.removed_headers(req.headers),
        response_headers=answers.allowed_headers(allow.rate, api_of(c.endpoint)).items(),
        metadata=handoff.allowed(c.request_id, c.reserved, c.prompt_estimate, traceparent,
                                 c.splice),
        also=_fixed(c.key_id, c.team, c.model, c.endpoint, c.stream, c.leased,
                    c.stream_options, c.include_usage, c.continuous_usage, c.cancelled),
    )


@functools.lru_cache(maxsize=4096)
def _fixed(key_id: str, team: str, model: str, endpoint: str, stream: bool, leased: bool,
           stream_options: bool, include_usage: bool, continuous_usage: bool,
           cancelled: CancelRule) -> check_wire.Fixed:
    """The parts of an OK answer that repeat for every request of a caller and model shape,
    encoded once."""
    return check_wire.fixed(
        upstream=(("x-gateway-key-id", key_id), ("x-gateway-team", team),
                  ("x-gateway-model", model)),
        metadata=handoff.caller(key_id, team, model, endpoint, stream, leased, stream_options,
                                include_usage, continuous_usage, cancelled))


def _denied(deny: Deny, req: AuthzRequest, traceparent: str = "") -> pb.CheckResponse:
    resp = pb.CheckResponse(status=_DENIED)
    denied = resp.denied_response
    denied.status.code = deny.status  # type: ignore[assignment,unused-ignore]
    _set_headers(denied.headers, [("content-type", "application/json"),
                                  *answers.denial_headers(deny).items()])
    denied.body = answers.error_body(deny, req.request_id).decode()
    _set_metadata(resp.dynamic_metadata, handoff.denied(
        req.request_id, deny.reason, deny.status, deny.key_id, deny.team, deny.model, req.path,
        traceparent, deny.stream))
    return resp


def _replied(reply: Reply, req: AuthzRequest, traceparent: str = "") -> pb.CheckResponse:
    """The gateway's own answer, sent by Envoy as a local reply (ext_authz's denied_response
    with a 2xx status). Its metadata names the caller, without `denied`: its usage event is
    a completed request that cost no tokens."""
    resp = pb.CheckResponse(status=_DENIED)
    local = resp.denied_response
    local.status.code = reply.status  # type: ignore[assignment,unused-ignore]
    _set_headers(local.headers, [("content-type", "application/json")])
    local.body = reply.body.decode()
    _set_metadata(resp.dynamic_metadata, handoff.replied(
        req.request_id, reply.key_id, reply.team, reply.model, req.path, traceparent))
    return resp


def _annotate(span: tracing.Span, decision: Decision) -> None:
    if isinstance(decision, Reply):
        span.set_attributes({"gateway.decision": "answered", "gateway.key_id": decision.key_id,
                             "gateway.team": decision.team})
        return
    if isinstance(decision, Allow):
        c = decision.context
        span.set_attributes({"gateway.request_id": c.request_id, "gateway.decision": "allowed",
                             "gateway.key_id": c.key_id, "gateway.team": c.team,
                             "gateway.model": c.model, "gateway.reserved_tokens": c.reserved})
        return
    span.set_attributes({"gateway.decision": "denied", "gateway.deny_reason": decision.reason,
                         "http.response.status_code": decision.status,
                         "gateway.key_id": decision.key_id, "gateway.team": decision.team,
                         "gateway.model": decision.model})
    if decision.tier:
        span.set_attribute("gateway.limit_tier", decision.tier)
    if decision.status >= 500:
        span.set_status(tracing.Status(tracing.StatusCode.ERROR, decision.message))


class AuthorizationService(pb_grpc.AuthorizationServicer):
    def __init__(self, authorizer: Authorizer, tracer: tracing.Tracing | None = None) -> None:
        self.authorizer = authorizer
        self.tracing = tracer

    def register(self, server: grpc.aio.Server) -> None:
        """Like the generated add_AuthorizationServicer_to_server, with a serializer that
        passes our pre-serialized answers through."""
        handlers = {"Check": grpc.unary_unary_rpc_method_handler(
            self.Check, request_deserializer=pb.CheckRequest.FromString,
            response_serializer=_serialize)}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]

    async def Check(
        self, request: pb.CheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckResponse | bytes:
        req = to_request(request)
        span = None
        if self.tracing is not None:  # the call's metadata only when a span may start
            span = self.span(req, context.invocation_metadata() if context is not None else None)
        decision = await self.decide(req, span)
        if isinstance(decision, Allow) and decision.context.leased and context is not None:
            # Cancelled before our answer reached Envoy: no ext_proc stream will follow to
            # release the lease, so undo the admission now rather than at the lease TTL.
            rid = req.request_id

            def undo_if_cancelled(ctx: grpc.aio.ServicerContext) -> None:
                if ctx.cancelled():
                    self.authorizer.abandon(rid)

            context.add_done_callback(undo_if_cancelled)  # type: ignore[arg-type]
        return to_response(decision, req, "" if span is None else
                           req.headers.get("traceparent", ""))

    async def decide(self, req: AuthzRequest, span: tracing.Span | None) -> Decision:
        """The decision, whichever door asked: metrics, the denial log line and the span.
        Cancelled (Envoy gave up on the Check: its client left, or its timeout passed), it
        undoes whatever the admission took."""
        t0 = time.perf_counter()
        try:
            decision = await self.authorizer.check(req)
        except asyncio.CancelledError:
            self.authorizer.abandon(req.request_id)
            if span is not None:
                span.set_status(tracing.Status(tracing.StatusCode.ERROR, "cancelled by Envoy"))
                span.end()
            raise
        observe_decision(decision, time.perf_counter() - t0)
        if isinstance(decision, Deny):
            log.info("denied", request_id=req.request_id, key_id=decision.key_id or None,
                     status=decision.status, reason=decision.reason, tier=decision.tier)
        if span is not None:
            _annotate(span, decision)
            span.end()
        return decision

    def span(self, req: AuthzRequest, metadata: Iterable[tuple[str, str | bytes]] | None = None
              ) -> tracing.Span | None:
        """A span when tracing is on and the request is traced (the trace context from the
        call's metadata, or the request's own headers)."""
        if self.tracing is None:
            return None
        tp, ts = tracing.trace_context(metadata, req.headers.get("traceparent", ""),
                                       req.headers.get("tracestate", ""))
        return self.tracing.start("ext_authz Check", tp, ts) if tp else None
