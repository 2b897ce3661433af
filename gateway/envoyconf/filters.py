"""The sidecar's two HTTP filters (ext_authz, ext_proc) and the gRPC service they call.

Why each setting that differs from Envoy's default (the rest of the bootstrap is explained
in gateway/envoyconf/bootstrap.py; Envoy 1.40 behaviour in docs/envoy.md):

* **Fail closed everywhere.** Both filters say `failure_mode_allow: false` (the default,
  spelled out because it is the security property) and `status_on_error: 503`: a sidecar
  that is down, slow or broken means "try again later", not 403 (ext_authz default) or
  500 (ext_proc default), and never "let it through". ext_authz is the *first* HTTP
  filter and no route disables it: there is no side door.
* **ext_authz through the HTTP door** (only with `EnvoyPorts.authz_http`): `http_service`
  instead of `grpc_service`, the same Check at a fraction of a gRPC call's CPU. Which
  answer headers go upstream, to the client or into metadata comes from
  gateway/envoy_contract.py, as does the door's encoder (gateway/server/check_http.py); the
  connection manager's local-reply mappers (`http_door_replies`) turn the door's stand-in
  statuses back (docs/envoy.md §3.8).
* **ext_authz timeout 0.5 s** (default 200 ms): a Check includes a Redis round trip and
  the whole request body; 200 ms turns a GC pause into a spurious 503.
* **ext_authz `with_request_body`** (`max_request_bytes` 8 MiB, `allow_partial_message:
  false`, `pack_as_bytes: true`): the admission decision needs the model and max_tokens
  from the body, so it gets the whole body or the request is refused (413) rather than
  judged on a truncated prompt; raw bytes skip a UTF-8 round trip. Buffering here also
  raises the stream's buffer limit, and the listener's and engine cluster's
  `per_connection_buffer_limit_bytes` are raised to match (default 1 MiB: a 1.5 MB
  prompt got 413), so a body ext_authz accepted also fits ext_proc's buffer.
* **ext_authz `allowed_headers`**: only `authorization`, `x-api-key`, `x-request-id`,
  the W3C trace context (`traceparent`, `tracestate`), `content-encoding` (a compressed
  body is refused: the Check cannot read its model) and `x-gateway-*` go to the sidecar
  (least privilege, and a smaller CheckRequest: an SDK sends a dozen more); method, path
  and body travel in their own fields.
* **ext_proc processing modes**: request headers SKIP (everything the sidecar needs
  rides on the body message: attributes and forwarded ext_authz metadata; the buffer
  filter after ext_proc keeps the headers from the engine until the sidecar has had that
  message: gateway/envoyconf/bootstrap.py `_metering_filters`), request body
  BUFFERED (one message to rewrite, e.g. to inject `stream_options.include_usage`),
  response headers SEND, but SKIP on the API's own POST routes (`ExtProcPerRoute`, the
  routes in gateway/envoyconf/bootstrap.py). SEND makes every answer open a stream: a
  request with no body whose answer has none either (an allowed HEAD, a pass-through's
  204/304) opened none with SKIP, and had no usage event; its headers give the status and,
  from `content-type`, whether it is SSE. On an inference POST, which always has a body (so
  a stream), SKIP saves a message per request and lets the engine's headers reach the
  client without a sidecar round trip (with SEND, an engine that dies right after its
  headers is Envoy's 502 instead of its 200 cut short); there the status rides as the
  `response.code` attribute on the first body message and SSE is recognised by its first
  bytes. Response body
  FULL_DUPLEX_STREAMED (every chunk is seen and echoed: blocking, because
  `observability_mode` silently drops streams under load and billing must not lose them;
  full duplex, because it has no per-message timeout, so a slow sidecar can slow a stream
  but never reset it, whereas STREAMED resets the client after `message_timeout`), and
  response trailers SEND (full duplex requires it).
* **ext_proc `message_timeout` 2 s** (default 200 ms): it applies to the request body
  and the response headers (full-duplex body chunks have none); a timeout there answers
  504 before the response started, never mid-generation. `max_message_timeout` 10 s lets the
  sidecar extend it per message with `override_message_timeout` if it ever needs to.
* **Attributes and metadata**: `request.id` (= x-request-id, the billing key) and
  `request.path` with the request, `request.id`/`response.code` with the response;
  ext_authz's decision (namespace `envoy.filters.http.ext_authz`) is forwarded to
  ext_proc; ext_proc may write back only `gateway.usage`, which the access log can show.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from gateway.endpoints import ANTHROPIC_PREFIX
from gateway.envoy_contract import (
    ANTHROPIC_REQUEST_ID,
    AUTHZ_ERROR_DETAILS,
    AUTHZ_NAMESPACE,
    CLIENT_HEADERS,
    CLIENT_HEADERS_ON_SUCCESS,
    CONTENT_ENCODING,
    CONTEXT_HEADERS,
    CONTEXT_PREFIX,
    CREDENTIALS,
    EXTPROC_NAMESPACE,
    METADATA_KEYS,
    RATE_PREFIXES,
    WIRE_STATUS,
)
from gateway.envoyconf.plain import quiet_imports

with quiet_imports():
    from envoy_data_plane.envoy.config.accesslog.v3 import (
        AccessLogFilter,
        AndFilter,
        ComparisonFilter,
        ComparisonFilterOp,
        ExtensionFilter,
        HeaderFilter,
        ResponseFlagFilter,
        StatusCodeFilter,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        ApiVersion,
        GrpcService,
        GrpcServiceEnvoyGrpc,
        HeaderValue,
        HeaderValueOption,
        HttpUri,
        RuntimeUInt32,
        SubstitutionFormatString,
    )
    from envoy_data_plane.envoy.config.route.v3 import HeaderMatcher
    from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import (
        ExpressionFilter,
    )
    from envoy_data_plane.envoy.extensions.filters.http.ext_authz.v3 import (
        AuthorizationResponse,
        BufferSettings,
        ExtAuthz,
        HttpService,
    )
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
        ExternalProcessor,
        ExtProcOverrides,
        ExtProcPerRoute,
        MetadataOptions,
        MetadataOptionsMetadataNamespaces,
        ProcessingMode,
        ProcessingModeBodySendMode,
        ProcessingModeHeaderSendMode,
    )
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        LocalReplyConfig,
        ResponseMapper,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import ListStringMatcher, StringMatcher
    from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
    from envoy_data_plane.google.protobuf import Any, Struct

EXT_AUTHZ = "envoy.filters.http.ext_authz"
EXT_PROC = "envoy.filters.http.ext_proc"
SIDECAR_CLUSTER = "sidecar"
AUTHZ_HTTP_CLUSTER = "sidecar_authz_http"  # ext_authz's HTTP door, when configured


# The only request headers a Check reads: the key, the request id, the body's encoding (to
# refuse a body it cannot read) and any client-sent x-gateway-* (to remove them). Anything
# else (cookies, other credentials) never leaves Envoy.
AUTHZ_HEADERS = (*CREDENTIALS, "x-request-id", "traceparent", "tracestate", CONTENT_ENCODING)


def ext_authz(timeout: timedelta, max_request_bytes: int, http: bool = False) -> ExtAuthz:
    """The Check, over gRPC or (`http`) through the sidecar's HTTP door."""
    return ExtAuthz(
        grpc_service=None if http else _sidecar_grpc(timeout=timeout),
        http_service=_http_door(timeout) if http else None,
        transport_api_version=ApiVersion.V3,
        failure_mode_allow=False,
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        with_request_body=BufferSettings(
            max_request_bytes=max_request_bytes,
            allow_partial_message=False,
            pack_as_bytes=True,
        ),
        allowed_headers=_matchers(AUTHZ_HEADERS, [CONTEXT_PREFIX]),
    )


def _matchers(exact: Iterable[str] = (), prefix: Iterable[str] = ()) -> ListStringMatcher:
    return ListStringMatcher(patterns=[*(StringMatcher(exact=n) for n in exact),
                                       *(StringMatcher(prefix=p) for p in prefix)])


def _http_door(timeout: timedelta) -> HttpService:
    """Which of the door's answer headers go where (gateway/server/check_http.py)."""
    return HttpService(
        server_uri=HttpUri(uri=f"http://{AUTHZ_HTTP_CLUSTER}", cluster=AUTHZ_HTTP_CLUSTER,
                           timeout=timeout),
        authorization_response=AuthorizationResponse(
            allowed_upstream_headers=_matchers(CONTEXT_HEADERS),
            allowed_client_headers=_matchers(CLIENT_HEADERS, RATE_PREFIXES),
            allowed_client_headers_on_success=_matchers(CLIENT_HEADERS_ON_SUCCESS,
                                                        RATE_PREFIXES),
            dynamic_metadata_from_headers=_matchers(METADATA_KEYS)))


def local_replies(max_request_bytes: int, authz_http: bool,
                  authz_error_body: bool = True) -> LocalReplyConfig:
    """Envoy's own answers in the API's shape: a body over the limit gets a JSON 413
    (Anthropic's on the Messages API, OpenAI's elsewhere) instead of Envoy's plain text;
    with the HTTP door, its stand-in statuses turned back (`http_door_replies`); and, unless
    `authz_error_body` is false, a failed Check's 503 gets a JSON body
    (`authz_error_replies`). False with the ext_proc filter: a local reply's body streams
    through ext_proc, which in full-duplex mode has no timeout, so a frozen sidecar would
    hold that 503 until it thawed (Envoy's bare 503 skips ext_proc's body stream)."""
    door = http_door_replies() if authz_http else []
    failed = authz_error_replies() if authz_error_body else []
    return LocalReplyConfig(mappers=[*door, *failed, *too_large_replies(max_request_bytes)])


def _cel(expression: str) -> AccessLogFilter:
    """An access-log filter on a CEL expression over the request and its answer."""
    return AccessLogFilter(extension_filter=ExtensionFilter(
        name="envoy.access_loggers.extension_filters.cel",
        typed_config=Any.pack(ExpressionFilter(expression=expression))))


def unanswered_check(paths: Iterable[str]) -> AccessLogFilter:
    """A request Envoy refused itself because its Check failed (the sidecar down or slower
    than the timeout), a POST to one of `paths`: with the ext_proc source that bodiless 503
    opens no ext_proc stream there (response headers SKIP on those routes), so Envoy's
    record of it is the only word the sidecar gets, and its event is made from that."""
    return _cel(f"response.code_details == '{AUTHZ_ERROR_DETAILS}' && {_posts_to(paths)}")


def bodiless_answer(paths: Iterable[str]) -> AccessLogFilter:
    """A POST to one of `paths` answered with no body at all (an engine's 204 or 304, any
    status with content-length: 0): with the ext_proc source its stream sees no response
    message (response headers SKIP on those routes, and no body), so it ends without its
    end, as a cut one does; Envoy's record gives the sidecar the status and no cut flag."""
    return _cel(f"{_posts_to(paths)} && response.size == 0")


def _posts_to(paths: Iterable[str]) -> str:
    """CEL: a POST to one of `paths`."""
    listed = ", ".join(f"'{p}'" for p in paths)
    return f"request.method == 'POST' && request.url_path in [{listed}]"


def authz_error_replies() -> list[ResponseMapper]:
    """ext_authz failing: Envoy answers its `status_on_error` (503) with no body at all, which
    the SDKs read as a bare status. Given the API's JSON instead (by route, as the sidecar's
    own 503 in gateway/authz/answers.py `unavailable`) and its `retry-after: 1`. Told from
    the sidecar's own 503 denial by Envoy's response code details (a CEL filter)."""
    failed = _cel(f"response.code_details == '{AUTHZ_ERROR_DETAILS}'")
    return _by_api(failed, "The gateway could not check this request in time; try again.",
                   # Anthropic's type for a 503: answers.anthropic_error_type's
                   anthropic_type="api_error", openai_type="server_error",
                   code="service_unavailable",
                   headers=(HeaderValueOption(header=HeaderValue(key="retry-after", value="1")),))


def too_large_replies(max_request_bytes: int) -> list[ResponseMapper]:
    """A 413 Envoy answers itself (the body outgrew ext_authz's buffer): its JSON by route,
    as gateway/authz/answers.py shapes every other answer, naming the limit."""
    status = AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
        op=ComparisonFilterOp.EQ, value=RuntimeUInt32(
            default_value=413, runtime_key="gateway.too_large_status"))))
    return _by_api(status, f"Request body too large: the limit is {max_request_bytes} bytes "
                           f"({max_request_bytes / (1 << 20):g} MiB).",
                   anthropic_type="request_too_large", openai_type="invalid_request_error",
                   code="request_too_large")


def _by_api(when: AccessLogFilter, message: str, *, anthropic_type: str, openai_type: str,
            code: str, headers: tuple[HeaderValueOption, ...] = ()) -> list[ResponseMapper]:
    """Envoy's own reply `when` it matches, with a JSON body in the route's API shape:
    Anthropic's error on the Messages API, OpenAI's elsewhere (as gateway/authz/answers.py)."""
    on_messages = AccessLogFilter(header_filter=HeaderFilter(header=HeaderMatcher(
        name=":path", string_match=StringMatcher(prefix=ANTHROPIC_PREFIX))))
    anthropic: dict[str, object] = {"type": "error", "error": {
        "type": anthropic_type, "message": message}, "request_id": "%REQ(X-REQUEST-ID)%"}
    openai: dict[str, object] = {"error": {
        "message": message, "type": openai_type, "param": None, "code": code},
        "request_id": "%REQ(X-REQUEST-ID)%"}
    # Anthropic's request-id header, as on the sidecar's answers (answers._request_id)
    request_id = HeaderValueOption(header=HeaderValue(key=ANTHROPIC_REQUEST_ID,
                                                      value="%REQ(X-REQUEST-ID)%"))
    return [
        ResponseMapper(filter=AccessLogFilter(and_filter=AndFilter(filters=[when, on_messages])),
                       body_format_override=_json(anthropic),
                       headers_to_add=[*headers, request_id]),
        ResponseMapper(filter=when, body_format_override=_json(openai),
                       headers_to_add=list(headers)),
    ]


def _json(shape: dict[str, object]) -> SubstitutionFormatString:
    return SubstitutionFormatString(json_format=Struct.from_dict(shape),
                                    content_type="application/json")


def http_door_replies() -> list[ResponseMapper]:
    """The door's stand-in statuses turned back into the real ones (a 503 denial, the
    gateway's own 200 answers): Envoy would read a 5xx from the door as its failure and a
    200 as an allow. Only ext_authz's replies (flag UAEX) are touched."""
    return [ResponseMapper(
        filter=AccessLogFilter(and_filter=AndFilter(filters=[
            AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
                op=ComparisonFilterOp.EQ, value=RuntimeUInt32(
                    default_value=wire, runtime_key=f"gateway.door_status_{wire}")))),
            AccessLogFilter(response_flag_filter=ResponseFlagFilter(flags=["UAEX"])),
        ])), status_code=status) for status, wire in sorted(WIRE_STATUS.items())]


def ext_proc(message_timeout: timedelta) -> ExternalProcessor:
    return ExternalProcessor(
        grpc_service=_sidecar_grpc(),
        failure_mode_allow=False,
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        message_timeout=message_timeout,
        max_message_timeout=timedelta(seconds=10),
        processing_mode=_processing_mode(response_headers=True),
        request_attributes=["request.id", "request.path"],
        response_attributes=["request.id", "response.code"],
        metadata_options=MetadataOptions(
            forwarding_namespaces=MetadataOptionsMetadataNamespaces(untyped=[AUTHZ_NAMESPACE]),
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[EXTPROC_NAMESPACE]),
        ),
    )


def _processing_mode(response_headers: bool) -> ProcessingMode:
    send, skip = ProcessingModeHeaderSendMode.SEND, ProcessingModeHeaderSendMode.SKIP
    return ProcessingMode(
        request_header_mode=skip,
        request_body_mode=ProcessingModeBodySendMode.BUFFERED,
        request_trailer_mode=skip,
        response_header_mode=send if response_headers else skip,
        response_body_mode=ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED,
        response_trailer_mode=send,
    )


def ext_proc_without_response_headers() -> ExtProcPerRoute:
    """The ext_proc modes of the API's own POST routes (gateway/envoyconf/bootstrap.py): the
    filter's, but response headers SKIP. Every allowed request there has a body, so its stream
    opens with it; the engine's headers then go to the client without waiting for the
    sidecar. A whole mode: Envoy reads an override's unset body mode as NONE."""
    return ExtProcPerRoute(overrides=ExtProcOverrides(
        processing_mode=_processing_mode(response_headers=False)))


def _sidecar_grpc(timeout: timedelta | None = None) -> GrpcService:
    return GrpcService(
        envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=SIDECAR_CLUSTER), timeout=timeout
    )
