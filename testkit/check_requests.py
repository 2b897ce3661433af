"""Build the CheckRequests Envoy would send, for tests and benchmarks that talk gRPC directly;
and an authorizer that holds its decision, for the tests of Envoy giving up on a Check."""

from __future__ import annotations

import asyncio
import uuid

from envoy.config.core.v3 import address_pb2
from envoy.service.auth.v3 import attribute_context_pb2 as actx
from envoy.service.auth.v3 import external_auth_pb2 as pb

from gateway.authz.decision import Decision
from gateway.authz.request import AuthzRequest


def check_request(
    key: str | None,
    body: bytes = b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}',
    path: str = "/v1/chat/completions",
    method: str = "POST",
    extra_headers: dict[str, str] | None = None,
    request_id: str | None = None,
) -> pb.CheckRequest:
    # Only what Envoy forwards under the ext_authz filter's allowed_headers (envoyconf/filters.py):
    # the key headers, the request id, x-gateway-* and Envoy's own partial-body flag.
    # Method, path and host arrive in their own fields, not as pseudo-headers.
    headers = {
        "x-request-id": request_id or str(uuid.uuid4()), "x-envoy-auth-partial-body": "false",
    }
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    headers.update(extra_headers or {})
    http = actx.AttributeContext.HttpRequest(
        id="11517394706964432185", method=method, headers=headers, path=path, host="127.0.0.1",
        scheme="http", protocol="HTTP/1.1", size=len(body), raw_body=body)

    def peer(port: int) -> actx.AttributeContext.Peer:
        return actx.AttributeContext.Peer(address=address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address="127.0.0.1", port_value=port)))

    request = actx.AttributeContext.Request(http=http)
    request.time.seconds, request.time.nanos = 1795980361, 946616000
    return pb.CheckRequest(attributes=actx.AttributeContext(
        source=peer(58076), destination=peer(10000), request=request))


class HeldAuthorizer:
    """An authorizer whose decisions (`decision`) wait until `release` is set; it records
    what was abandoned: a Check Envoy gave up on must undo its admission."""

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self.release = asyncio.Event()
        self.abandoned: list[str] = []

    async def check(self, req: AuthzRequest) -> Decision:
        await self.release.wait()
        return self.decision

    def abandon(self, request_id: str) -> None:
        self.abandoned.append(request_id)
