"""What Envoy tells operators about each request: its stdout access log and, when a
collector is named, its traces. Neither feeds billing (the records that do are
gateway/envoyconf/metering.py's).

* **Access log**: JSON lines on stdout with the request id, status, flags, details,
  duration, upstream and ext_authz's metadata, so one line explains any answer, and
  `to_engine_us`: from the request's first byte to its first byte sent to the engine (the
  client's upload plus what the gateway's filters held it for: the Check, the splice), the
  latency the gateway adds before any GPU work (absent for answers the engine never saw).
  One line per request, not one per heartbeat record of a long stream.
* **Tracing** (only when `EnvoyPorts.otlp` names a collector): Envoy's OpenTelemetry
  tracer sends its spans there over OTLP/gRPC; its gRPC calls to the sidecar carry a
  `traceparent`, so the sidecar's Check and ext_proc spans join Envoy's trace
  (gateway/tracing.py). Its `http.url` tag is the path without its query string (a key
  sent in one never reaches the collector). Sampling is Envoy's default (100 %, or the
  client's decision); operators lower `random_sampling` for production traffic.
"""

from __future__ import annotations

from gateway.envoy_contract import AUTHZ_NAMESPACE, EXTPROC_NAMESPACE, USAGE_NAMESPACE
from gateway.envoyconf.clusters import OTLP_CLUSTER
from gateway.envoyconf.plain import quiet_imports
from gateway.metering.sources import MeteringSource

with quiet_imports():
    from envoy_data_plane.envoy.config.accesslog.v3 import (
        AccessLog,
        AccessLogFilter,
        LogTypeFilter,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        GrpcService,
        GrpcServiceEnvoyGrpc,
        SubstitutionFormatString,
        TypedExtensionConfig,
    )
    from envoy_data_plane.envoy.config.trace.v3 import OpenTelemetryConfig, TracingHttp
    from envoy_data_plane.envoy.data.accesslog.v3 import AccessLogType
    from envoy_data_plane.envoy.extensions.access_loggers.stream.v3 import StdoutAccessLog
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManagerTracing,
    )
    from envoy_data_plane.envoy.extensions.formatter.req_without_query.v3 import (
        ReqWithoutQuery,
    )
    from envoy_data_plane.envoy.type.tracing.v3 import CustomTag
    from envoy_data_plane.google.protobuf import Any, Struct

ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ_WITHOUT_QUERY(:PATH)%",  # a query string may carry a secret
    "status": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "duration_ms": "%DURATION%",
    "to_engine_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "upstream": "%UPSTREAM_HOST%",
    "authz": f"%DYNAMIC_METADATA({AUTHZ_NAMESPACE})%",
    "usage": f"%DYNAMIC_METADATA({EXTPROC_NAMESPACE})%",
}


def stdout_access_log(source: MeteringSource) -> AccessLog:
    fmt = dict(ACCESS_LOG_FORMAT)
    if source.lua_filters:
        fmt["usage"] = f"%DYNAMIC_METADATA({USAGE_NAMESPACE})%"
    log_format = SubstitutionFormatString(
        json_format=Struct.from_dict(fmt),
        formatters=[TypedExtensionConfig(  # %REQ_WITHOUT_QUERY%: the path, no query string
            name="envoy.formatter.req_without_query", typed_config=Any.pack(ReqWithoutQuery()))])
    return AccessLog(
        name="envoy.access_loggers.stdout",
        # one line per request, not one per heartbeat of a long stream
        filter=AccessLogFilter(log_type_filter=LogTypeFilter(
            types=[AccessLogType.DownstreamPeriodic], exclude=True)),
        typed_config=Any.pack(StdoutAccessLog(log_format=log_format)),
    )


def tracing() -> HttpConnectionManagerTracing:
    otel = OpenTelemetryConfig(
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=OTLP_CLUSTER)),
        service_name="envoy",
    )
    return HttpConnectionManagerTracing(
        provider=TracingHttp(name="envoy.tracers.opentelemetry", typed_config=Any.pack(otel)),
        # Envoy's own http.url is the whole URL, query string included: a key sent as
        # ?api_key=... would reach the collector. The path alone replaces it.
        custom_tags=[CustomTag(tag="http.url", value="%PATH(NQ)%")])
