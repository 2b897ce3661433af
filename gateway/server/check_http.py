"""A Check's answer (gateway/authz/check.py) as the HTTP/1.1 answer Envoy's ext_authz
`http_service` reads: the HTTP door's encoder (its server: gateway/server/authz_http.py).

Why a second door beside the gRPC Check: on a 2-core box a grpc.aio unary call costs the
sidecar ~350-400 µs of CPU before any of our code runs, and a keep-alive HTTP/1.1 answer
~20 µs (docs/envoy.md, "The HTTP door"). Envoy's HTTP ext_authz carries everything the gRPC
Check does once its config names the headers, and gateway/envoyconf/filters.py takes the
names from gateway/envoy_contract.py, as this does, so the two cannot drift apart:

* **200 allows.** The caller's context headers (those of CONTEXT_HEADERS it sets) are set
  on the request to the engine, REMOVE_HEADER names the credentials and forged x-gateway-*
  headers to drop, and the RATE_PREFIXES headers are added to the client's response.
* **Any other status denies**, and Envoy sends it to the client with our body and the
  CLIENT_HEADERS. Envoy reads an answer >= 500 as the door failing (its `status_on_error`,
  no body, no metadata) and a 200 as an allow, so a 503 denial and the gateway's own 200
  answers travel as WIRE_STATUS codes that the bootstrap's local-reply mappers turn back.
* **Metadata**: each entry of the Check's metadata (gateway/metering/handoff.py) is a
  header of the same name, filed by `dynamic_metadata_from_headers` under ext_authz's
  namespace. Envoy files them as strings; handoff.read and the Lua filter read "true" and
  "12" as the gRPC Check's true and 12.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.authz.check import Allowed, Answer, LocalReply
from gateway.envoy_contract import REMOVE_HEADER, WIRE_STATUS
from gateway.metering import handoff

_REASONS = {250: b"Answered", 400: b"Bad Request", 401: b"Unauthorized",
            403: b"Forbidden", 404: b"Not Found", 413: b"Payload Too Large",
            429: b"Too Many Requests", 450: b"Unavailable"}
_ENCODED = "http"  # this encoder's entry in Shared.encoded
_REMOVE = REMOVE_HEADER.encode() + b": "

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


def encode(answer: Answer) -> bytes:
    """The whole HTTP/1.1 response for an answer."""
    if isinstance(answer, Allowed):
        return _allowed(answer)
    return _local(answer)


def _allowed(a: Allowed) -> bytes:
    shared = a.shared.encoded.get(_ENCODED)
    if shared is None:
        shared = a.shared.encoded[_ENCODED] = _headers(a.shared.upstream) + metadata_headers(
            a.shared.metadata)
    return b"".join((
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n",
        _headers(a.upstream),
        _REMOVE, _clean(",".join(a.remove)), b"\r\n",
        _headers(a.client.items()),
        metadata_headers(a.metadata),
        shared,
        b"\r\n",
    ))


def _local(r: LocalReply) -> bytes:
    """A denial or the gateway's own answer: `status` as the client is to see it."""
    body = r.body
    wire = WIRE_STATUS.get(r.status, r.status)
    return b"".join((b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n" % (
        wire, _REASONS.get(wire, b"Denied"), len(body)), _headers(r.headers),
        metadata_headers(r.metadata), b"\r\n", body))
