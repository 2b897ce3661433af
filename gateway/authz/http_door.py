"""ext_authz's HTTP door: a decision as the HTTP/1.1 answer Envoy's `http_service` reads.

Why a second door beside the gRPC Check: on a 2-core box a grpc.aio unary call costs the
sidecar ~350-400 µs of CPU before any of our code runs, and a keep-alive HTTP/1.1 answer
~20 µs (docs/envoy.md, "The HTTP door"). Envoy's HTTP ext_authz carries everything the gRPC
Check does once its config names the headers, and gateway/envoyconf/filters.py takes the
names from here, so the two cannot drift apart:

* **200 allows.** `UPSTREAM` headers are set on the request to the engine,
  `x-envoy-auth-headers-to-remove` names the credentials and forged x-gateway-* headers to
  drop, and the `ON_SUCCESS` rate-limit headers are added to the client's response.
* **Any other status denies**, and Envoy sends it to the client with our body and the
  `CLIENT` headers. Envoy reads an answer >= 500 as the door failing (its `status_on_error`,
  no body, no metadata) and a 200 as an allow, so a 503 denial and the gateway's own 200
  answers travel as `WIRE_STATUS` codes that the bootstrap's local-reply mappers turn back.
* **Metadata**: each entry of the Check's metadata (gateway/metering/handoff.py) is a
  header of the same name, filed by `dynamic_metadata_from_headers` under ext_authz's
  namespace. Envoy files them as strings; handoff.read and the Lua filter read "true" and
  "12" as the gRPC Check's true and 12.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from gateway.authz import answers
from gateway.authz.decision import Allow, Decision, Deny, Reply
from gateway.authz.request import AuthzRequest
from gateway.endpoints import api_of
from gateway.metering import handoff
from gateway.policy.billing_rules import CancelRule

UPSTREAM = answers.CONTEXT_HEADERS
RATE_PREFIXES = ("x-ratelimit-", "anthropic-ratelimit-")  # to the client, allowed or denied
CLIENT = ("content-type", "retry-after", "x-should-retry", "x-gateway-limit-tier")
REMOVE = "x-envoy-auth-headers-to-remove"
# The status a decision means -> the status that carries it to Envoy (and back, in Envoy's
# local-reply mappers): unassigned codes, so nothing else answers with them.
WIRE_STATUS = {200: 250, 503: 450}
_REASONS = {250: b"Answered", 400: b"Bad Request", 401: b"Unauthorized",
            403: b"Forbidden", 404: b"Not Found", 413: b"Payload Too Large",
            429: b"Too Many Requests", 450: b"Unavailable"}


_CONTROL = bytes(range(0x20)) + b"\x7f"
_QUESTION = bytes.maketrans(_CONTROL, b"?" * len(_CONTROL))


def _clean(value: str) -> bytes:
    """A header value: UTF-8, with control characters (a client-chosen model name could
    carry CR LF) replaced, so no value can end the header or start another."""
    return value.encode().translate(_QUESTION)


def _headers(items: Iterable[tuple[str, str]]) -> bytes:
    return b"".join(k.encode() + b": " + _clean(v) + b"\r\n" for k, v in items)


def metadata_headers(md: handoff.Metadata) -> bytes:
    """The metadata entries as header lines (values as Envoy will file them: strings)."""
    return _headers((k, ("true" if v else "false") if isinstance(v, bool)
                     else v if isinstance(v, str) else str(int(v))) for k, v in md.items())


def _response(status: int, head: bytes, body: bytes = b"") -> bytes:
    """A denial or the gateway's own answer: `status` as the client is to see it."""
    wire = WIRE_STATUS.get(status, status)
    return b"".join((b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n" % (
        wire, _REASONS.get(wire, b"Denied"), len(body)), head, b"\r\n", body))


def answer(decision: Decision, req: AuthzRequest, traceparent: str = "") -> bytes:
    """The whole HTTP/1.1 response for a decision (`traceparent`: as the gRPC Check)."""
    if isinstance(decision, Deny):
        return _denied(decision, req, traceparent)
    if isinstance(decision, Reply):
        head = _headers([("content-type", "application/json")]) + metadata_headers(
            handoff.replied(req.request_id, decision.key_id, decision.team, decision.model,
                            req.path, traceparent))
        return _response(decision.status, head, decision.body)
    return _allowed(decision, req, traceparent)


def _allowed(allow: Allow, req: AuthzRequest, traceparent: str) -> bytes:
    c = allow.context
    head = b"".join((
        b"x-gateway-request-id: " + _clean(c.request_id) + b"\r\n",
        _headers(((REMOVE, ",".join(answers.removed_headers(req.headers))),)),
        _headers(answers.allowed_headers(allow.rate, api_of(c.endpoint)).items()),
        metadata_headers(handoff.allowed(c.request_id, c.reserved, c.prompt_estimate,
                                         traceparent, c.splice)),
        _fixed(c.key_id, c.team, c.model, c.endpoint, c.stream, c.leased, c.stream_options,
               c.include_usage, c.continuous_usage, c.cancelled),
    ))
    return b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n" + head + b"\r\n"


@functools.lru_cache(maxsize=4096)
def _fixed(key_id: str, team: str, model: str, endpoint: str, stream: bool, leased: bool,
           stream_options: bool, include_usage: bool, continuous_usage: bool,
           cancelled: CancelRule) -> bytes:
    """The headers that repeat for every request of a caller and model shape, encoded once."""
    return _headers((("x-gateway-key-id", key_id), ("x-gateway-team", team),
                     ("x-gateway-model", model))) + metadata_headers(handoff.caller(
                         key_id, team, model, endpoint, stream, leased, stream_options,
                         include_usage, continuous_usage, cancelled))


def _denied(deny: Deny, req: AuthzRequest, traceparent: str) -> bytes:
    head = _headers([("content-type", "application/json"),
                     *answers.denial_headers(deny).items()])
    head += metadata_headers(handoff.denied(req.request_id, deny.reason, deny.status,
                                            deny.key_id, deny.team, deny.model, req.path,
                                            traceparent, deny.stream))
    return _response(deny.status, head, answers.error_body(deny, req.request_id))
