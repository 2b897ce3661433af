"""Build the CheckRequests Envoy would send, for tests and benchmarks that talk gRPC directly."""

from __future__ import annotations

import uuid

from envoy.service.auth.v3 import attribute_context_pb2 as actx
from envoy.service.auth.v3 import external_auth_pb2 as pb


def check_request(
    key: str | None,
    body: bytes = b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}',
    path: str = "/v1/chat/completions",
    method: str = "POST",
    extra_headers: dict[str, str] | None = None,
    request_id: str | None = None,
) -> pb.CheckRequest:
    headers = {
        ":path": path, ":method": method, ":authority": "127.0.0.1", ":scheme": "http",
        "content-type": "application/json", "user-agent": "OpenAI/Python 3.57.0",
        "x-request-id": request_id or str(uuid.uuid4()), "accept": "application/json",
        "x-forwarded-proto": "http", "x-envoy-external-address": "127.0.0.1",
        "content-length": str(len(body)), "x-stainless-lang": "python",
    }
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    headers.update(extra_headers or {})
    http = actx.AttributeContext.HttpRequest(
        id="11517394706964432185", method=method, headers=headers, path=path, host="127.0.0.1",
        scheme="http", protocol="HTTP/1.1", size=len(body), raw_body=body)
    return pb.CheckRequest(attributes=actx.AttributeContext(
        request=actx.AttributeContext.Request(http=http)))
