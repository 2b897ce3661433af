"""The bootstrap's upstream side: one cluster per thing Envoy calls, and the addresses.

* **The sidecar's gRPC services need HTTP/2**, set through `typed_extension_protocol_options`
  (`Cluster.http2_protocol_options` is deprecated); without it every call fails with
  `protocol_error`. ext_authz's HTTP door and the engine speak plain HTTP/1.1, Envoy's
  default upstream protocol.
* **Circuit breaker thresholds are raised** from 1024 to 100000: the defaults would turn a
  burst of long-lived SSE streams into 503s (`UO`) long before anything is overloaded.
* **One endpoint each**: STATIC for an IP literal, STRICT_DNS for a name such as
  `localhost`. Listeners (and admin) need an IP literal.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any as AnyValue

from gateway.addresses import AddressError, is_ip, split_hostport
from gateway.envoyconf.filters import AUTHZ_HTTP_CLUSTER, SIDECAR_CLUSTER
from gateway.envoyconf.metering import RECORDS_HTTP_CLUSTER
from gateway.envoyconf.plain import quiet_imports

with quiet_imports():
    from envoy_data_plane.envoy.config.cluster.v3 import (
        CircuitBreakers,
        CircuitBreakersThresholds,
        Cluster,
        ClusterDiscoveryType,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        Address,
        Http2ProtocolOptions,
        SocketAddress,
    )
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )
    from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
        HttpProtocolOptions,
        HttpProtocolOptionsExplicitHttpConfig,
    )
    from envoy_data_plane.google.protobuf import Any

ENGINE_CLUSTER = "engine"
OTLP_CLUSTER = "otel_collector"
CIRCUIT_BREAKER_LIMIT = 100_000


def sidecar_cluster(sidecar: str) -> Cluster:
    """The sidecar's gRPC services (ext_authz's Check, ext_proc, the records)."""
    return http2_cluster(SIDECAR_CLUSTER, sidecar)


def authz_http_cluster(door: str) -> Cluster:
    """ext_authz's HTTP door: HTTP/1.1, keep-alive."""
    return _cluster(AUTHZ_HTTP_CLUSTER, door, connect_timeout=timedelta(seconds=1))


def records_http_cluster(records: str) -> Cluster:
    """Envoy's records over OTLP/HTTP (gateway/envoyconf/metering.py): HTTP/1.1, keep-alive."""
    return _cluster(RECORDS_HTTP_CLUSTER, records, connect_timeout=timedelta(seconds=1))


def http2_cluster(name: str, hostport: str) -> Cluster:
    """A gRPC service (the sidecar, an OTLP collector)."""
    h2 = HttpProtocolOptions(
        explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
            http2_protocol_options=Http2ProtocolOptions()
        )
    )
    return _cluster(
        name,
        hostport,
        connect_timeout=timedelta(seconds=1),
        typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": Any.pack(h2)
        },
    )


def engine_cluster(engine: str, buffer_limit: int) -> Cluster:
    """The OpenAI-compatible engine, plain HTTP/1.1, with the listener's buffer limit."""
    return _cluster(
        ENGINE_CLUSTER,
        engine,
        connect_timeout=timedelta(seconds=2),
        per_connection_buffer_limit_bytes=buffer_limit,
    )


def _cluster(name: str, hostport: str, **options: AnyValue) -> Cluster:
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


def listen_address(hostport: str, what: str) -> Address:
    """A bind address: Envoy listeners need an IP literal, not a name."""
    host, port = split_hostport(hostport, what)
    if not is_ip(host):
        raise AddressError(
            f"{what}: {hostport!r} must be an IP address and port, e.g. 127.0.0.1:10000"
        )
    return _socket(host, port)


def _socket(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))
