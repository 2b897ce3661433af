"""The Envoy bootstrap for a spoke, built from typed envoy-data-plane objects.

`render()` is what `gateway envoy-config` prints; `envoy/envoy.yaml` is its output for the
reference ports and a test keeps the two equal. Envoy 1.40 behaviour behind each choice
is in docs/envoy-protocol.md (V = verified against the real binary).

Why each setting that differs from Envoy's default:

* **Fail closed everywhere.** Both filters say `failure_mode_allow: false` (the default,
  spelled out because it is the security property) and `status_on_error: 503`: a sidecar
  that is down, slow or broken means "try again later", not 403 (ext_authz default) or
  500 (ext_proc default), and never "let it through". ext_authz is the *first* HTTP
  filter and no route disables it: there is no side door.
* **ext_authz timeout 0.5 s** (default 200 ms): a Check includes a Redis round trip and
  the whole request body; 200 ms turns a GC pause into a spurious 503.
* **ext_authz `with_request_body`** (`max_request_bytes` 8 MiB, `allow_partial_message:
  false`, `pack_as_bytes: true`): the admission decision needs the model and max_tokens
  from the body, so it gets the whole body or the request is refused (413) rather than
  judged on a truncated prompt; raw bytes skip a UTF-8 round trip. Buffering here also
  raises the stream's buffer limit, and the listener's and engine cluster's
  `per_connection_buffer_limit_bytes` are raised to match (default 1 MiB: a 1.5 MB
  prompt got 413), so a body ext_authz accepted also fits ext_proc's buffer.
* **ext_authz `allowed_headers`**: only `authorization`, `x-api-key`, `x-request-id` and
  `x-gateway-*` go to the sidecar (least privilege, and a smaller CheckRequest: an SDK
  sends a dozen more); method, path and body travel in their own fields.
* **ext_proc processing modes**: request headers SKIP (everything the sidecar needs
  rides on the body message: attributes and forwarded ext_authz metadata), request body
  BUFFERED (one message to rewrite, e.g. to inject `stream_options.include_usage`),
  response headers SKIP (one message fewer per request: the status rides as the
  `response.code` attribute on the first body message, and SSE is recognised by its first
  bytes), response body
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
* **Request id**: x-request-id is the usage event's idempotency key, so a client must
  not choose it. `use_remote_address: true` makes requests from the downstream peer
  "edge" requests and `preserve_external_request_id: false` makes Envoy replace an edge
  request's x-request-id; an *internal* request keeps it. With `internal_address_config`
  unset, Envoy 1.40 treats no address as internal, so a client on 127.0.0.1 is edge too.
  Verified against the real binary (a client sending `x-request-id: client-chosen`):
  unset -> the upstream sees a fresh UUID; but `internal_address_config: {}` (empty
  `cidr_ranges`) falls back to the RFC1918 + loopback defaults and the upstream sees
  `client-chosen`, as with `cidr_ranges: [127.0.0.1/32]`, `use_remote_address: false` or
  `preserve_external_request_id: true`. So leave `internal_address_config` unset; a test
  sends a chosen id through the rendered config and checks Envoy's access log.
  `always_set_request_id_in_response` hands the id back to the client: it is the
  `event_id` of the request's usage event, so support and billing speak of one id.
* **Route `timeout: 0s`** (default 15 s): long generations stream for minutes.
  `stream_idle_timeout` (5 min) still cuts a stream that goes silent.
* **Clusters**: gRPC to the sidecar needs HTTP/2, set through
  `typed_extension_protocol_options` (`Cluster.http2_protocol_options` is deprecated).
  Circuit breaker thresholds are raised from 1024 to 100000: the defaults would turn a
  burst of long-lived SSE streams into 503s (`UO`) long before anything is overloaded.
* **Access log**: JSON lines on stdout with the request id, status, flags, details,
  duration, upstream and ext_authz's metadata, so one line explains any answer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any as AnyValue

import betterproto2
import yaml

from gateway.addresses import is_ip, split_hostport
from gateway.envoy_yaml import to_plain

# envoy-data-plane 2.2.0 declares ~250 `@model_validator(mode="after")` classmethods, each
# a PydanticDeprecatedSince212 warning at import: noise in every test run, nothing to fix
# on our side. Only that message is silenced, and only while these modules load.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"Using `@model_validator` with mode='after'")
    from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog
    from envoy_data_plane.envoy.config.bootstrap.v3 import (
        Admin,
        Bootstrap,
        BootstrapStaticResources,
    )
    from envoy_data_plane.envoy.config.cluster.v3 import (
        CircuitBreakers,
        CircuitBreakersThresholds,
        Cluster,
        ClusterDiscoveryType,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        Address,
        ApiVersion,
        GrpcService,
        GrpcServiceEnvoyGrpc,
        Http2ProtocolOptions,
        SocketAddress,
        SubstitutionFormatString,
    )
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )
    from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
    from envoy_data_plane.envoy.config.route.v3 import (
        Route,
        RouteAction,
        RouteConfiguration,
        RouteMatch,
        VirtualHost,
    )
    from envoy_data_plane.envoy.extensions.access_loggers.stream.v3 import StdoutAccessLog
    from envoy_data_plane.envoy.extensions.filters.http.ext_authz.v3 import BufferSettings, ExtAuthz
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
        ExternalProcessor,
        MetadataOptions,
        MetadataOptionsMetadataNamespaces,
        ProcessingMode,
        ProcessingModeBodySendMode,
        ProcessingModeHeaderSendMode,
    )
    from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
        HttpFilter,
    )
    from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
        HttpProtocolOptions,
        HttpProtocolOptionsExplicitHttpConfig,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import ListStringMatcher, StringMatcher
    from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
    from envoy_data_plane.google.protobuf import Any, Struct

HEADER = (
    "# Generated by: gateway envoy-config (do not edit; tests keep it equal)\n"
    "# Why each setting: the docstring of gateway/envoy_config.py\n"
)

EXT_AUTHZ = "envoy.filters.http.ext_authz"
EXT_PROC = "envoy.filters.http.ext_proc"
ROUTER = "envoy.filters.http.router"
HCM = "envoy.filters.network.http_connection_manager"
SIDECAR_CLUSTER = "sidecar"
ENGINE_CLUSTER = "engine"
USAGE_NAMESPACE = "gateway.usage"
CIRCUIT_BREAKER_LIMIT = 100_000
BUFFER_HEADROOM_BYTES = 64 * 1024  # request headers and framing on top of the largest body

ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "duration_ms": "%DURATION%",
    "upstream": "%UPSTREAM_HOST%",
    "authz": f"%DYNAMIC_METADATA({EXT_AUTHZ})%",
    "usage": f"%DYNAMIC_METADATA({USAGE_NAMESPACE})%",
}

# proto3 JSON drops fields equal to their default. These `false`s are the security
# properties a reviewer looks for, so the YAML spells them out: {type: dotted paths}.
_SPELLED_OUT_FALSE: dict[type[betterproto2.Message], tuple[str, ...]] = {
    ExtAuthz: ("failure_mode_allow", "with_request_body.allow_partial_message"),
    ExternalProcessor: ("failure_mode_allow",),
    HttpConnectionManager: ("preserve_external_request_id",),
}


@dataclass(frozen=True)
class EnvoyPorts:
    """Where everything listens or is reached, as "host:port" (DESIGN.md §7 reference)."""

    listen: str = "127.0.0.1:10000"
    sidecar: str = "127.0.0.1:9001"
    engine: str = "127.0.0.1:8000"
    admin: str = "127.0.0.1:9901"


@dataclass(frozen=True)
class _Limits:
    max_request_bytes: int
    authz_timeout: timedelta
    message_timeout: timedelta


def render(
    ports: EnvoyPorts = EnvoyPorts(),
    *,
    max_request_bytes: int = 8 * 1024 * 1024,
    authz_timeout_s: float = 0.5,
    message_timeout_s: float = 2.0,
) -> str:
    """The bootstrap YAML for `ports`, with the generated-file header."""
    typed = bootstrap(
        ports,
        max_request_bytes=max_request_bytes,
        authz_timeout_s=authz_timeout_s,
        message_timeout_s=message_timeout_s,
    )
    plain = to_plain(typed, _SPELLED_OUT_FALSE)
    return HEADER + yaml.safe_dump(plain, sort_keys=False, width=100)


def bootstrap(
    ports: EnvoyPorts = EnvoyPorts(),
    *,
    max_request_bytes: int = 8 * 1024 * 1024,
    authz_timeout_s: float = 0.5,
    message_timeout_s: float = 2.0,
) -> Bootstrap:
    """The typed bootstrap: one listener, the sidecar and engine clusters, admin."""
    limits = _Limits(
        max_request_bytes=max_request_bytes,
        authz_timeout=timedelta(seconds=authz_timeout_s),
        message_timeout=timedelta(seconds=message_timeout_s),
    )
    return Bootstrap(
        admin=Admin(address=_listen_address(ports.admin, "admin")),
        static_resources=BootstrapStaticResources(
            listeners=[_listener(ports.listen, limits)],
            clusters=[_sidecar_cluster(ports.sidecar), _engine_cluster(ports.engine, limits)],
        ),
    )


def _listener(listen: str, limits: _Limits) -> Listener:
    hcm = Filter(name=HCM, typed_config=Any.pack(_http_connection_manager(limits)))
    return Listener(
        name="ingress",
        address=_listen_address(listen, "listen"),
        filter_chains=[FilterChain(filters=[hcm])],
        per_connection_buffer_limit_bytes=_buffer_limit(limits),
    )


def _http_connection_manager(limits: _Limits) -> HttpConnectionManager:
    return HttpConnectionManager(
        stat_prefix="ingress",
        route_config=_route_config(),
        http_filters=[
            HttpFilter(name=EXT_AUTHZ, typed_config=Any.pack(_ext_authz(limits))),
            HttpFilter(name=EXT_PROC, typed_config=Any.pack(_ext_proc(limits))),
            HttpFilter(name=ROUTER, typed_config=Any.pack(Router())),
        ],
        access_log=[_stdout_access_log()],
        use_remote_address=True,
        preserve_external_request_id=False,
        always_set_request_id_in_response=True,
    )


def _route_config() -> RouteConfiguration:
    """Everything goes to the engine; `timeout: 0s` because generations outlive 15 s."""
    route = Route(
        match=RouteMatch(prefix="/"),
        route=RouteAction(cluster=ENGINE_CLUSTER, timeout=timedelta(0)),
    )
    return RouteConfiguration(
        name="ingress",
        virtual_hosts=[VirtualHost(name="llm", domains=["*"], routes=[route])],
    )


def _stdout_access_log() -> AccessLog:
    log_format = SubstitutionFormatString(json_format=Struct.from_dict(ACCESS_LOG_FORMAT))
    return AccessLog(
        name="envoy.access_loggers.stdout",
        typed_config=Any.pack(StdoutAccessLog(log_format=log_format)),
    )


# The only request headers a Check reads: the key, the request id, and any client-sent
# x-gateway-* (to remove them). Anything else (cookies, other credentials) never leaves Envoy.
AUTHZ_HEADERS = ("authorization", "x-api-key", "x-request-id")


def _ext_authz(limits: _Limits) -> ExtAuthz:
    return ExtAuthz(
        grpc_service=_sidecar_grpc(timeout=limits.authz_timeout),
        transport_api_version=ApiVersion.V3,
        failure_mode_allow=False,
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        with_request_body=BufferSettings(
            max_request_bytes=limits.max_request_bytes,
            allow_partial_message=False,
            pack_as_bytes=True,
        ),
        allowed_headers=ListStringMatcher(patterns=[
            *(StringMatcher(exact=name) for name in AUTHZ_HEADERS),
            StringMatcher(prefix="x-gateway-"),
        ]),
    )


def _ext_proc(limits: _Limits) -> ExternalProcessor:
    return ExternalProcessor(
        grpc_service=_sidecar_grpc(),
        failure_mode_allow=False,
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        message_timeout=limits.message_timeout,
        max_message_timeout=timedelta(seconds=10),
        processing_mode=ProcessingMode(
            request_header_mode=ProcessingModeHeaderSendMode.SKIP,
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            request_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
            response_header_mode=ProcessingModeHeaderSendMode.SKIP,
            response_body_mode=ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED,
            response_trailer_mode=ProcessingModeHeaderSendMode.SEND,
        ),
        request_attributes=["request.id", "request.path"],
        response_attributes=["request.id", "response.code"],
        metadata_options=MetadataOptions(
            forwarding_namespaces=MetadataOptionsMetadataNamespaces(untyped=[EXT_AUTHZ]),
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[USAGE_NAMESPACE]),
        ),
    )


def _sidecar_grpc(timeout: timedelta | None = None) -> GrpcService:
    return GrpcService(
        envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=SIDECAR_CLUSTER), timeout=timeout
    )


def _sidecar_cluster(sidecar: str) -> Cluster:
    """The gRPC sidecar: HTTP/2 is mandatory (without it every call fails, `protocol_error`)."""
    h2 = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions()
        )
    )
    return _cluster(
        SIDECAR_CLUSTER,
        sidecar,
        connect_timeout=timedelta(seconds=1),
        typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": Any.pack(h2)
        },
    )


def _engine_cluster(engine: str, limits: _Limits) -> Cluster:
    """The OpenAI-compatible engine, plain HTTP/1.1 (Envoy's default upstream protocol)."""
    return _cluster(
        ENGINE_CLUSTER,
        engine,
        connect_timeout=timedelta(seconds=2),
        per_connection_buffer_limit_bytes=_buffer_limit(limits),
    )


def _cluster(name: str, hostport: str, **options: AnyValue) -> Cluster:
    """One endpoint; STATIC for an IP literal, STRICT_DNS for a name such as `localhost`."""
    host, port = split_hostport(hostport, name)
    discovery = ClusterDiscoveryType.STATIC if is_ip(host) else ClusterDiscoveryType.STRICT_DNS
    endpoint = LbEndpoint(endpoint=Endpoint(address=_socket(host, port)))
    return Cluster(
        name=name,
        type=discovery,
        load_assignment=ClusterLoadAssignment(
            cluster_name=name, endpoints=[LocalityLbEndpoints(lb_endpoints=[endpoint])]
        ),
        circuit_breakers=CircuitBreakers(
            thresholds=[
                CircuitBreakersThresholds(
                    max_connections=CIRCUIT_BREAKER_LIMIT,
                    max_pending_requests=CIRCUIT_BREAKER_LIMIT,
                    max_requests=CIRCUIT_BREAKER_LIMIT,
                    max_retries=CIRCUIT_BREAKER_LIMIT,
                )
            ]
        ),
        **options,
    )


def _buffer_limit(limits: _Limits) -> int:
    return limits.max_request_bytes + BUFFER_HEADROOM_BYTES


def _listen_address(hostport: str, what: str) -> Address:
    """A bind address: Envoy listeners need an IP literal, not a name."""
    host, port = split_hostport(hostport, what)
    if not is_ip(host):
        raise ValueError(
            f"{what}: {hostport!r} must be an IP address and port, e.g. 127.0.0.1:10000"
        )
    return _socket(host, port)


def _socket(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))

