"""The Envoy bootstrap: the committed file is the builder's output, real Envoy accepts it,
and nothing in it lets a request reach the engine without ext_authz."""

from __future__ import annotations

import dataclasses
import os
import socketserver
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.auth.v3 import external_auth_pb2 as pb
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc
from google.rpc import status_pb2

from devspoke.envoy_proc import envoy_binary, envoy_service
from devspoke.procs import free_port
from gateway import cli
from gateway.endpoints import ENDPOINTS
from gateway.envoyconf.bootstrap import BUFFER, EXT_AUTHZ, HCM, EnvoyPorts, render
from gateway.envoyconf.filters import AUTHZ_HTTP_CLUSTER, EXT_PROC, SIDECAR_CLUSTER
from gateway.settings import METERING_SOURCES, Settings
from testkit.envoys import access_log_entry

REPO = Path(__file__).resolve().parents[2]


def random_ports(door: str = "grpc") -> EnvoyPorts:
    """Free ports for everything; sidecar and engine are never started (nothing listens).
    `door`: how ext_authz reaches the sidecar, its gRPC Check or its HTTP door."""
    ports = EnvoyPorts(*(f"127.0.0.1:{free_port()}" for _ in range(4)))
    return dataclasses.replace(ports, authz_http=f"127.0.0.1:{free_port()}" if door == "http"
                               else None)


DOORS = ["grpc", "http"]


def port_of(hostport: str) -> int:
    return int(hostport.rsplit(":", 1)[1])


def hcms(config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every HttpConnectionManager typed_config in every listener's filter chains."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                assert network_filter["name"] == HCM, f"non-HTTP side door: {network_filter}"
                yield network_filter["typed_config"]


def per_filter_configs(hcm: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(where, filter name, config) for each typed_per_filter_config at every route level."""
    route_config = hcm["route_config"]
    for name, cfg in route_config.get("typed_per_filter_config", {}).items():
        yield "route_config", name, cfg
    for vhost in route_config["virtual_hosts"]:
        for name, cfg in vhost.get("typed_per_filter_config", {}).items():
            yield f"virtual host {vhost['name']}", name, cfg
        for route in vhost["routes"]:
            for name, cfg in route.get("typed_per_filter_config", {}).items():
                yield f"route {route['match']}", name, cfg


def cluster_addresses(config: dict[str, Any]) -> dict[str, str]:
    """Each cluster's one endpoint, as "host:port"."""
    found = {}
    for cluster in config["static_resources"]["clusters"]:
        [locality] = cluster["load_assignment"]["endpoints"]
        [endpoint] = locality["lb_endpoints"]
        sock = endpoint["endpoint"]["address"]["socket_address"]
        found[cluster["name"]] = f"{sock['address']}:{sock['port_value']}"
    return found


def check_door(config: dict[str, Any]) -> str:
    """How the committed config's ext_authz reaches the sidecar: "http" or "grpc"."""
    [hcm] = hcms(config)
    authz = hcm["http_filters"][0]["typed_config"]
    return "http" if "http_service" in authz else "grpc" if "grpc_service" in authz else "?"


@pytest.mark.parametrize("name", ["envoy.yaml", "envoy-ext-proc.yaml"])
def test_reference_config_reaches_what_serve_binds_on_defaults(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN §7: `gateway serve` on default settings and the committed reference config
    work together, with the Check through the HTTP door (the cheaper path)."""
    for var in [v for v in os.environ if v.startswith("GATEWAY_")]:
        monkeypatch.delenv(var)
    serve = Settings()
    config = yaml.safe_load((REPO / "envoy" / name).read_text())
    clusters = cluster_addresses(config)
    assert clusters[SIDECAR_CLUSTER] == serve.listen
    assert clusters[AUTHZ_HTTP_CLUSTER] == serve.authz_http_listen
    assert check_door(config) == "http"


def test_envoy_config_cli_default_is_the_reference_and_grpc_check_is_a_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["envoy-config"]) == 0
    assert capsys.readouterr().out == (REPO / "envoy" / "envoy.yaml").read_text()
    assert cli.main(["envoy-config", "--grpc-check"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert check_door(config) == "grpc"
    assert AUTHZ_HTTP_CLUSTER not in cluster_addresses(config)


def flush_intervals(config: dict[str, Any]) -> list[str]:
    """Every access logger's buffer_flush_interval in a rendered bootstrap."""
    return [log["typed_config"]["common_config"]["buffer_flush_interval"]
            for hcm in hcms(config) for log in hcm.get("access_log", [])
            if "common_config" in log.get("typed_config", {})]


def test_envoy_config_records_flush_ms_sets_the_access_loggers_flush(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["envoy-config"]) == 0
    assert flush_intervals(yaml.safe_load(capsys.readouterr().out)) == ["0.050s"]
    assert cli.main(["envoy-config", "--records-flush-ms", "20"]) == 0
    assert flush_intervals(yaml.safe_load(capsys.readouterr().out)) == ["0.020s"]
    for bad in ("0", "-5", "abc", "inf"):
        with pytest.raises(SystemExit) as exited:
            cli.main(["envoy-config", "--records-flush-ms", bad])
        assert exited.value.code == 2
        assert "--records-flush-ms: not a positive number of milliseconds" in \
            capsys.readouterr().err


def test_committed_envoy_yaml_is_render_output() -> None:
    committed = (REPO / "envoy" / "envoy.yaml").read_text()
    assert committed == render(metering="envoy"), \
        "stale: run `gateway envoy-config > envoy/envoy.yaml`"
    ext_proc = (REPO / "envoy" / "envoy-ext-proc.yaml").read_text()
    assert ext_proc == render(metering="ext_proc"), \
        "stale: run `gateway envoy-config --metering ext_proc > envoy/envoy-ext-proc.yaml`"


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("metering", METERING_SOURCES)
@pytest.mark.parametrize("traced", [False, True])
def test_real_envoy_validates_rendered_config(tmp_path: Path, traced: bool, metering: str,
                                              door: str) -> None:
    config = tmp_path / "envoy.yaml"
    ports = random_ports(door)
    if traced:  # with Envoy's OpenTelemetry tracer and its collector cluster
        ports = dataclasses.replace(ports, otlp=f"127.0.0.1:{free_port()}")
    config.write_text(render(ports, metering=metering))  # type: ignore[arg-type]
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("metering", METERING_SOURCES)
def test_every_route_goes_through_ext_authz_failing_closed(metering: str, door: str) -> None:
    config = yaml.safe_load(render(random_ports(door), metering=metering))  # type: ignore[arg-type]
    found = list(hcms(config))
    assert found, "no HTTP listener"
    for hcm in found:
        filters = hcm["http_filters"]
        assert filters[0]["name"] == EXT_AUTHZ, "ext_authz must run before any other filter"
        assert filters[0]["typed_config"]["failure_mode_allow"] is False
        assert filters[0]["typed_config"]["status_on_error"] == {"code": "ServiceUnavailable"}
        for f in filters:
            assert not f.get("disabled") and not f.get("is_optional"), f
        assert "rds" not in hcm and "scoped_routes" not in hcm, "routes must be inspectable here"
        for where, name, cfg in per_filter_configs(hcm):
            assert not (name == EXT_AUTHZ and cfg.get("disabled")), f"{where} disables ext_authz"


def test_ext_proc_is_followed_by_a_buffer_filter() -> None:
    """With the ext_proc source, a buffer filter right after ext_proc holds the request's
    headers until its body has passed ext_proc (request headers SKIP let them on at once):
    an engine answering from the headers alone, with no body, reset the stream before the
    sidecar had the body, and the request had no event (docs/envoy.md §4.7). Its limit
    takes any body ext_authz takes; the Envoy source has no ext_proc and no buffer."""
    (hcm,) = hcms(yaml.safe_load(render(random_ports(), metering="ext_proc")))
    names = [f["name"] for f in hcm["http_filters"]]
    assert names[names.index(EXT_PROC) + 1] == BUFFER
    authz, buffer = (next(f["typed_config"] for f in hcm["http_filters"] if f["name"] == n)
                     for n in (EXT_AUTHZ, BUFFER))
    assert buffer["max_request_bytes"] >= authz["with_request_body"]["max_request_bytes"]
    (hcm,) = hcms(yaml.safe_load(render(random_ports(), metering="envoy")))
    assert BUFFER not in [f["name"] for f in hcm["http_filters"]]


def test_ext_proc_sends_response_headers_but_on_the_apis_post_routes() -> None:
    """Response headers SEND, so an answer with no body to a request with none (an allowed
    HEAD, a pass-through's 204) still opens a stream; SKIP on a POST to one of the API's
    paths (always a body: the stream opens with it), in an override that is the filter's
    mode but for that one field (Envoy reads an override's unset body mode as NONE)."""
    (hcm,) = hcms(yaml.safe_load(render(random_ports(), metering="ext_proc")))
    mode = next(f["typed_config"]["processing_mode"] for f in hcm["http_filters"]
                if f["name"] == EXT_PROC)
    assert mode["response_header_mode"] == "SEND"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    *api, last = routes
    assert last["match"] == {"prefix": "/"} and "typed_per_filter_config" not in last
    assert [r["match"]["path"] for r in api] == list(ENDPOINTS)
    for r in api:
        assert r["match"]["headers"] == [{"name": ":method", "string_match": {"exact": "POST"}}]
        assert {k: v for k, v in r.items() if k not in ("match", "typed_per_filter_config")} \
            == {k: v for k, v in last.items() if k != "match"}
        override = r["typed_per_filter_config"][EXT_PROC]["overrides"]["processing_mode"]
        assert override == mode | {"response_header_mode": "SKIP"}
    (envoy_hcm,) = hcms(yaml.safe_load(render(random_ports(), metering="envoy")))
    assert [r["match"] for r in envoy_hcm["route_config"]["virtual_hosts"][0]["routes"]] == [
        {"prefix": "/"}]


def test_admin_interface_is_loopback_only() -> None:
    """The admin port can drain or quit Envoy: never reachable from outside the host."""
    config = yaml.safe_load(render(random_ports()))
    assert config["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_bad_address_names_the_flag() -> None:
    with pytest.raises(ValueError, match="listen"):
        render(EnvoyPorts(listen="localhost:10000"))
    with pytest.raises(ValueError, match="engine"):
        render(EnvoyPorts(engine="127.0.0.1"))


def test_client_cannot_choose_x_request_id(tmp_path: Path) -> None:
    """x-request-id is the billing idempotency key: a loopback client's value is replaced.

    The sidecar is down, so the answer is ext_authz's fail-closed 503; the access log still
    records the request id Envoy settled on.
    """
    ports = random_ports()
    admin, listen = port_of(ports.admin), port_of(ports.listen)
    chosen = f"client-chosen-{uuid.uuid4()}"
    with envoy_service(render(ports), admin, listen, tmp_path) as envoy:
        request = urllib.request.Request(
            f"http://{ports.listen}/v1/chat/completions",
            data=b'{"model": "m"}',
            headers={"x-request-id": chosen, "content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=10)
        assert answer.value.code == 503
        entry = access_log_entry(envoy.log_path, "path", "/v1/chat/completions")
    assert entry["request_id"] != chosen
    assert uuid.UUID(entry["request_id"])  # Envoy generated a fresh one
    assert chosen not in envoy.log_path.read_text()


@pytest.mark.parametrize("door", DOORS)
def test_a_check_that_fails_is_a_json_503_in_the_routes_shape(tmp_path: Path,
                                                               door: str) -> None:
    """The sidecar down (nothing listens): Envoy's fail-closed 503 carries the API's JSON,
    by route, and retry-after, not Envoy's empty body. The ext_proc source keeps the empty
    one (a body would wait on ext_proc: gateway/envoyconf/filters.py `local_replies`)."""
    ports = random_ports(door)
    admin, listen = port_of(ports.admin), port_of(ports.listen)
    with envoy_service(render(ports), admin, listen, tmp_path):
        for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
            request = urllib.request.Request(f"http://{ports.listen}{path}",
                                             data=b'{"model": "m"}')
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(request, timeout=10)
            assert answer.value.code == 503
            assert answer.value.headers["retry-after"] == "1"
            body = yaml.safe_load(answer.value.read())
            assert body["request_id"] == answer.value.headers["x-request-id"]
            if shape == "openai":
                assert body["error"]["code"] == "service_unavailable"
            else:
                assert (body["type"], body["error"]["type"]) == ("error", "api_error")
    config = yaml.safe_load(render(random_ports(door), metering="ext_proc"))
    for hcm in hcms(config):
        assert "ext_authz_error" not in str(hcm.get("local_reply_config"))


def denied_through_envoy(ports: EnvoyPorts, tmp_path: Path) -> int:
    """One request with a key, a cookie, a forged x-gateway-* and other headers through an
    Envoy rendered for `ports`, whose Check denies it: the status the client got."""
    with envoy_service(render(ports), port_of(ports.admin), port_of(ports.listen), tmp_path):
        request = urllib.request.Request(
            f"http://{ports.listen}/v1/chat/completions", data=b'{"model": "m"}',
            headers={"authorization": "Bearer sk-x", "x-api-key": "sk-y", "cookie": "s=1",
                     "x-gateway-team": "forged", "x-other": "1", "user-agent": "t"})
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(request, timeout=10)
        return denied.value.code


def test_the_sidecar_sees_only_the_headers_a_check_reads(tmp_path: Path) -> None:
    """allowed_headers: the key, the request id and x-gateway-* reach the Check; a cookie or
    any other header the client sent does not. A recording server stands in for the sidecar."""
    seen: list[dict[str, str]] = []

    class Recorder(pb_grpc.AuthorizationServicer):
        def Check(self, request: pb.CheckRequest,
                  context: grpc.ServicerContext) -> pb.CheckResponse:
            seen.append(dict(request.attributes.request.http.headers))
            return pb.CheckResponse(status=status_pb2.Status(code=7))  # denied

    ports = random_ports()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_AuthorizationServicer_to_server(Recorder(), server)
    server.add_insecure_port(ports.sidecar)
    server.start()
    try:
        assert denied_through_envoy(ports, tmp_path) == 403
    finally:
        server.stop(0)
    [headers] = seen
    assert {"authorization", "x-api-key", "x-request-id", "x-gateway-team"} <= set(headers)
    assert not {"cookie", "x-other", "user-agent"} & set(headers), headers


def test_the_http_door_sees_only_the_headers_a_check_reads(tmp_path: Path) -> None:
    """The same least privilege through ext_authz's HTTP door: a recording HTTP server
    stands in for the sidecar's door and denies."""
    seen: list[bytes] = []
    ports = random_ports("http")
    assert ports.authz_http

    class Door(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                head += self.rfile.read(1)
            seen.append(head)
            self.wfile.write(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n"
                             b"connection: close\r\n\r\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", port_of(ports.authz_http)), Door)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert denied_through_envoy(ports, tmp_path) == 403
    finally:
        server.shutdown()
        server.server_close()
    [head] = seen
    names = {line.split(b":")[0].lower().decode() for line in head.split(b"\r\n")[1:] if line}
    assert {"authorization", "x-api-key", "x-request-id", "x-gateway-team"} <= names
    assert not {"cookie", "x-other", "user-agent"} & names, names
