"""ext_authz Check over gRPC: CheckRequest → AuthzRequest → the Check → CheckResponse."""

from __future__ import annotations

import grpc
from envoy.service.auth.v3 import external_auth_pb2 as pb
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc

from gateway.authz.check import Allowed, Check
from gateway.authz.request import AuthzRequest
from gateway.server import check_grpc

SERVICE = "envoy.service.auth.v3.Authorization"


def to_request(check: pb.CheckRequest) -> AuthzRequest:
    """Ours sends `headers` and `raw_body` (pack_as_bytes); an Envoy set otherwise sends
    `header_map` (encode_raw_headers: values in raw_value, one entry per line, joined here
    as `headers` joins them) or `body` (a UTF-8 string), and is read the same."""
    http = check.attributes.request.http
    headers = dict(http.headers)
    if not headers and http.header_map.headers:
        for h in http.header_map.headers:
            value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
            key = h.key.lower()
            headers[key] = f"{headers[key]},{value}" if key in headers else value
    return AuthzRequest(
        request_id=headers.get("x-request-id", ""),
        method=http.method,
        path=http.path.partition("?")[0],
        headers=headers,
        body=http.raw_body or http.body.encode(),
    )


class AuthorizationService(pb_grpc.AuthorizationServicer):
    def __init__(self, check: Check) -> None:
        self.check = check

    def register(self, server: grpc.aio.Server) -> None:
        """Like the generated add_AuthorizationServicer_to_server, with a serializer that
        passes our pre-serialized answers through."""
        handlers = {"Check": grpc.unary_unary_rpc_method_handler(
            self.Check, request_deserializer=pb.CheckRequest.FromString,
            response_serializer=check_grpc.serialize)}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]

    async def Check(
        self, request: pb.CheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckResponse | bytes:
        req = to_request(request)
        # the call's metadata (a trace context) only when a span may start
        traced = self.check.tracing is not None and context is not None
        answer = await self.check(req, context.invocation_metadata() if traced else None)
        if isinstance(answer, Allowed) and answer.leased and context is not None:
            # Cancelled before our answer reached Envoy: no ext_proc stream will follow to
            # release the lease, so undo the admission now rather than at the lease TTL.
            rid = req.request_id

            def undo_if_cancelled(ctx: grpc.aio.ServicerContext) -> None:
                if ctx.cancelled():
                    self.check.abandon(rid)

            context.add_done_callback(undo_if_cancelled)  # type: ignore[arg-type]
        return check_grpc.encode(answer)
