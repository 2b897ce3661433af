"""The Envoy bootstrap for a spoke, built from typed envoy-data-plane objects.

`render()` is what `gateway envoy-config` prints; `envoy/envoy.yaml` is its output for the
reference ports and a test keeps the two equal. Envoy 1.40 behaviour behind each choice
is in docs/envoy.md (V = verified against the real binary).

Why each setting that differs from Envoy's default (the two filters that call the
sidecar are explained in gateway/envoyconf/filters.py):

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
* **One canonical path** (no side door): `normalize_path` (RFC 3986: dot segments
  resolved, percent-encoded unreserved characters decoded, `\\` made `/`), `merge_slashes`
  and `path_with_escaped_slashes_action: UNESCAPE_AND_FORWARD` (`%2F` → `/`), so the
  sidecar judges and the engine routes the same path. Without them Envoy forwards
  `/v1/chat/%63ompletions` or `/v1//chat/completions` as sent, and an engine behind
  uvicorn decodes them into a chat completion. Verified against the real binary for each
  spelling (tests/e2e/test_side_doors.py). Unescaping rather than rejecting `%2F` keeps
  model ids with a slash (`GET /v1/models/org%2Fname`, as SDKs send them) working. The
  sidecar canonicalizes again (gateway/routes.py) for Envoys without these settings.
* **Headers with underscores dropped** (`headers_with_underscores_action: DROP_HEADER`,
  Envoy's edge-proxy advice; the default passes them): a WSGI/CGI server reads
  `x_gateway_team` as `x-gateway-team` (both are `HTTP_X_GATEWAY_TEAM`), so a forged
  context the sidecar strips under one spelling would reach a service behind under the
  other. No OpenAI or Anthropic header has one.
* **Route `timeout: 0s`** (default 15 s): long generations stream for minutes.
  `stream_idle_timeout` (5 min) still cuts a stream that goes silent.
* **Clusters** (HTTP/2 for the sidecar's gRPC, raised circuit breakers): explained in
  gateway/envoyconf/clusters.py.
* **Access log and tracing**: what Envoy tells operators, explained in
  gateway/envoyconf/observability.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import betterproto2
import yaml

from gateway.endpoints import ENDPOINTS
from gateway.envoy_contract import CUT_FLAGS
from gateway.envoyconf import metering as envoy_metering
from gateway.envoyconf.clusters import (
    ENGINE_CLUSTER,
    OTLP_CLUSTER,
    authz_http_cluster,
    engine_cluster,
    http2_cluster,
    listen_address,
    records_http_cluster,
    sidecar_cluster,
)
from gateway.envoyconf.filters import (
    EXT_AUTHZ,
    EXT_PROC,
    ext_authz,
    ext_proc,
    ext_proc_without_response_headers,
    local_replies,
)
from gateway.envoyconf.observability import stdout_access_log, tracing
from gateway.envoyconf.plain import quiet_imports, to_plain
from gateway.metering.sources import MeteringSource, source_named
from gateway.settings import (
    DEFAULT_METERING,
    REFERENCE_AUTHZ_HTTP,
    REFERENCE_LISTEN,
    Metering,
)

with quiet_imports():
    from envoy_data_plane.envoy.config.bootstrap.v3 import (
        Admin,
        Bootstrap,
        BootstrapStaticResources,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        HttpProtocolOptions,
        HttpProtocolOptionsHeadersWithUnderscoresAction,
    )
    from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
    from envoy_data_plane.envoy.config.route.v3 import (
        HeaderMatcher,
        Route,
        RouteAction,
        RouteConfiguration,
        RouteMatch,
        VirtualHost,
    )
    from envoy_data_plane.envoy.extensions.filters.http.buffer.v3 import Buffer
    from envoy_data_plane.envoy.extensions.filters.http.ext_authz.v3 import ExtAuthz
    from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
        ExternalProcessor,
    )
    from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
        HttpConnectionManagerHcmAccessLogOptions,
        HttpConnectionManagerPathWithEscapedSlashesAction,
        HttpFilter,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
    from envoy_data_plane.google.protobuf import Any

HEADER = (
    "# Generated by: gateway envoy-config (do not edit; tests keep it equal)\n"
    "# Why each setting: the docstrings of gateway/envoyconf/bootstrap.py and filters.py\n"
)

ROUTER = "envoy.filters.http.router"
BUFFER = "envoy.filters.http.buffer"
HCM = "envoy.filters.network.http_connection_manager"
BUFFER_HEADROOM_BYTES = 64 * 1024  # request headers and framing on top of the largest body

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
    sidecar: str = REFERENCE_LISTEN
    engine: str = "127.0.0.1:8000"
    admin: str = "127.0.0.1:9901"
    otlp: str | None = None  # an OTLP/gRPC collector for Envoy's spans; None: no tracing
    # The sidecar's ext_authz HTTP door (its GATEWAY_AUTHZ_HTTP_LISTEN), the reference
    # config's Check; None: the gRPC Check at `sidecar` (managed gateways)
    authz_http: str | None = REFERENCE_AUTHZ_HTTP
    # The sidecar's GATEWAY_RECORDS_HTTP_LISTEN: Envoy's records over OTLP/HTTP, cheaper but
    # never retried (docs/envoy.md §6); None: over gRPC to `sidecar`, retried (the default)
    records_http: str | None = None


@dataclass(frozen=True)
class _Limits:
    max_request_bytes: int
    authz_timeout: timedelta
    message_timeout: timedelta
    source: MeteringSource
    authz_http: bool = False
    records_http: bool = False
    heartbeat: timedelta = envoy_metering.RECORD_HEARTBEAT
    keep_request_ids: bool = False
    records_flush: timedelta = envoy_metering.FLUSH


def render(
    ports: EnvoyPorts = EnvoyPorts(),
    *,
    metering: Metering = DEFAULT_METERING,
    max_request_bytes: int = 8 * 1024 * 1024,
    authz_timeout_s: float = 0.5,
    message_timeout_s: float = 2.0,
    heartbeat_s: float = envoy_metering.RECORD_HEARTBEAT.total_seconds(),
    keep_request_ids: bool = False,
    records_flush_s: float = envoy_metering.FLUSH.total_seconds(),
) -> str:
    """The bootstrap YAML for `ports`, with the generated-file header."""
    typed = bootstrap(
        ports,
        metering=metering,
        max_request_bytes=max_request_bytes,
        authz_timeout_s=authz_timeout_s,
        message_timeout_s=message_timeout_s,
        heartbeat_s=heartbeat_s,
        keep_request_ids=keep_request_ids,
        records_flush_s=records_flush_s,
    )
    plain = to_plain(typed, _SPELLED_OUT_FALSE)
    return HEADER + yaml.dump(plain, Dumper=_Dumper, sort_keys=False, width=100)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the Lua filter's code) as literal blocks, readable as written."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def bootstrap(
    ports: EnvoyPorts = EnvoyPorts(),
    *,
    metering: Metering = DEFAULT_METERING,
    max_request_bytes: int = 8 * 1024 * 1024,
    authz_timeout_s: float = 0.5,
    message_timeout_s: float = 2.0,
    heartbeat_s: float = envoy_metering.RECORD_HEARTBEAT.total_seconds(),
    keep_request_ids: bool = False,
    records_flush_s: float = envoy_metering.FLUSH.total_seconds(),
) -> Bootstrap:
    """The typed bootstrap: one listener, the sidecar and engine clusters, admin."""
    limits = _Limits(
        max_request_bytes=max_request_bytes,
        authz_timeout=timedelta(seconds=authz_timeout_s),
        message_timeout=timedelta(seconds=message_timeout_s),
        source=source_named(metering),
        authz_http=bool(ports.authz_http),
        # ext_proc's early-end records go over gRPC whatever `records_http` says (below)
        records_http=bool(ports.records_http) and source_named(metering).records_are_events,
        heartbeat=timedelta(seconds=heartbeat_s),
        keep_request_ids=keep_request_ids,
        records_flush=timedelta(seconds=records_flush_s),
    )
    clusters = [sidecar_cluster(ports.sidecar), engine_cluster(ports.engine, _buffer_limit(limits))]
    if ports.authz_http:
        clusters.append(authz_http_cluster(ports.authz_http))
    # With the ext_proc source the records only say who ended a stream that ended early,
    # and that word is paired, in memory, with the stream in the sidecar process that ran
    # it. Over gRPC it shares the sidecar cluster's HTTP/2 connection of the Envoy worker
    # that served the request, so with GATEWAY_WORKERS it reaches that same process; over
    # OTLP/HTTP (a connection of its own, to any worker) it often did not: an engine's cut
    # was billed as client_cancelled, a 204 as a client_cancelled with status 0
    # (tests/e2e/test_workers_ext_proc_metering.py). So `records_http` is the Envoy
    # source's only.
    if limits.records_http and ports.records_http:
        clusters.append(records_http_cluster(ports.records_http))
    if ports.otlp:
        clusters.append(http2_cluster(OTLP_CLUSTER, ports.otlp))
    return Bootstrap(
        admin=Admin(address=listen_address(ports.admin, "admin")),
        static_resources=BootstrapStaticResources(
            listeners=[_listener(ports.listen, limits, traced=bool(ports.otlp))],
            clusters=clusters,
        ),
    )


def _listener(listen: str, limits: _Limits, traced: bool) -> Listener:
    hcm = Filter(name=HCM, typed_config=Any.pack(_http_connection_manager(limits, traced)))
    return Listener(
        name="ingress",
        address=listen_address(listen, "listen"),
        filter_chains=[FilterChain(filters=[hcm])],
        per_connection_buffer_limit_bytes=_buffer_limit(limits),
    )


def _http_connection_manager(limits: _Limits, traced: bool) -> HttpConnectionManager:
    return HttpConnectionManager(
        tracing=tracing() if traced else None,
        stat_prefix="ingress",
        route_config=_route_config(limits.source),
        http_filters=[
            HttpFilter(name=EXT_AUTHZ, typed_config=Any.pack(
                ext_authz(limits.authz_timeout, limits.max_request_bytes, limits.authz_http))),
            *_metering_filters(limits),
            HttpFilter(name=ROUTER, typed_config=Any.pack(Router())),
        ],
        access_log=[stdout_access_log(limits.source), envoy_metering.record_log(
            only_flags=() if limits.source.records_are_events else CUT_FLAGS,
            http=limits.records_http, flush=limits.records_flush,
            # the ext_proc source: also a failed Check's, where no stream sees it, and an
            # answer's with no body, whose stream ends without its end
            unanswered_on=() if limits.source.records_are_events else ENDPOINTS)],
        # Envoy-fed metering: a heartbeat record per request in flight (metering.py)
        access_log_options=HttpConnectionManagerHcmAccessLogOptions(
            access_log_flush_interval=limits.heartbeat) if limits.source.heartbeat else None,
        use_remote_address=True,
        # A client's own x-request-id is replaced: it is the usage event's id (a config
        # that keeps them is refused a live duplicate at admission, README)
        preserve_external_request_id=limits.keep_request_ids,
        always_set_request_id_in_response=True,
        normalize_path=True,
        merge_slashes=True,
        path_with_escaped_slashes_action=(
            HttpConnectionManagerPathWithEscapedSlashesAction.UNESCAPE_AND_FORWARD),
        local_reply_config=local_replies(limits.max_request_bytes, limits.authz_http,
                                         not limits.source.ext_proc_filter),
        common_http_protocol_options=HttpProtocolOptions(
            headers_with_underscores_action=(
                HttpProtocolOptionsHeadersWithUnderscoresAction.DROP_HEADER)),
    )


def _metering_filters(limits: _Limits) -> list[HttpFilter]:
    """ext_proc sees every chunk; the Envoy source does the byte work in Envoy's own
    filters (gateway/envoyconf/metering.py).

    After ext_proc, a buffer filter: with request headers SKIP, ext_proc lets the headers
    on to the engine at once and holds only the body until the sidecar has answered it, so
    an engine (or a proxy before it) that answers from the headers alone, with no body,
    ended the request before its body message reached the sidecar (a few MB take a while
    on the gRPC stream): Envoy reset that stream, and no stream had the request's facts
    (no event, or the orphan sweep's with status 0, seconds later). Held here until the
    body has passed ext_proc, the engine sees the request only once the sidecar has it,
    without the extra sidecar message per request that request headers SEND would cost.
    The body is whole already (ext_authz buffered it), so this holds nothing new; the
    engine gets a content-length instead of `transfer-encoding: chunked`."""
    filters: list[HttpFilter] = []
    if limits.source.ext_proc_filter:
        filters += [
            HttpFilter(name=EXT_PROC, typed_config=Any.pack(ext_proc(limits.message_timeout))),
            HttpFilter(name=BUFFER, typed_config=Any.pack(
                Buffer(max_request_bytes=_buffer_limit(limits)))),
        ]
    if limits.source.lua_filters:
        filters += [
            HttpFilter(name=envoy_metering.LUA, typed_config=Any.pack(envoy_metering.lua())),
            HttpFilter(name=envoy_metering.JSON_TO_METADATA,
                       typed_config=Any.pack(
                           envoy_metering.json_to_metadata_filter(_buffer_limit(limits)))),
        ]
    return filters


def _route_config(source: MeteringSource) -> RouteConfiguration:
    """Everything goes to the engine; `timeout: 0s` because generations outlive 15 s.
    Without the client's Accept-Encoding (the openai SDK asks for gzip): a compressed
    answer cannot be metered by either source, nor its injected usage hidden.

    With ext_proc metering, a POST to one of the API's paths (gateway/endpoints.py; the
    query string is not part of the match) has its own route, the same but for ext_proc's
    response headers, skipped there (`ext_proc_without_response_headers`); every other
    request (a pass-through path, a HEAD) has them sent, so that an answer with no body
    still opens a stream and gets its event."""
    def route(match: RouteMatch, per_filter: dict[str, Any] | None = None) -> Route:
        return Route(match=match,
                     route=RouteAction(cluster=ENGINE_CLUSTER, timeout=timedelta(0)),
                     request_headers_to_remove=["accept-encoding"],
                     typed_per_filter_config=per_filter or {})

    routes = []
    if source.ext_proc_filter:
        post = [HeaderMatcher(name=":method", string_match=StringMatcher(exact="POST"))]
        skip = {EXT_PROC: Any.pack(ext_proc_without_response_headers())}
        routes = [route(RouteMatch(path=path, headers=post), skip) for path in ENDPOINTS]
    return RouteConfiguration(
        name="ingress",
        virtual_hosts=[VirtualHost(name="llm", domains=["*"],
                                   routes=[*routes, route(RouteMatch(prefix="/"))])],
    )


def _buffer_limit(limits: _Limits) -> int:
    return limits.max_request_bytes + BUFFER_HEADROOM_BYTES
