"""Unix domain sockets between Envoy and the sidecar, for the benchmarks' `--uds`
(docs/benchmarks.md: no gain over loopback TCP, so not a documented option): `unix:/path`
for GATEWAY_LISTEN and GATEWAY_AUTHZ_HTTP_LISTEN, parsed with errors that name the setting;
refused with workers; `envoy-config` renders them as pipe endpoints; the HTTP door answers
on one."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import yaml

from gateway.addresses import AddressError, check_listen, remove_socket, unix_path
from gateway.authz.check import Check
from gateway.cli import main
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from gateway.envoyconf.filters import AUTHZ_HTTP_CLUSTER, SIDECAR_CLUSTER
from gateway.server import authz_http
from testkit.check_requests import HeldAuthorizer
from tests.unit.test_check_http import ALLOW, request


def test_unix_paths_parse_and_bad_ones_name_the_setting() -> None:
    assert unix_path("unix:/run/gw/door.sock") == "/run/gw/door.sock"
    assert unix_path("127.0.0.1:9002") is None
    check_listen("unix:/run/gw/grpc.sock", "GATEWAY_LISTEN")
    check_listen("127.0.0.1:9001", "GATEWAY_LISTEN")
    for bad in ("unix:door.sock", "unix:", "unix://host/door.sock", "unix:/" + "x" * 107):
        with pytest.raises(AddressError, match=r"^GATEWAY_AUTHZ_HTTP_LISTEN: "):
            check_listen(bad, "GATEWAY_AUTHZ_HTTP_LISTEN")


def test_shutdown_removes_the_socket_file_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    remove_socket(f"unix:{path}")
    assert not path.exists()
    (tmp_path / "f").write_text("not a socket")
    remove_socket(f"unix:{tmp_path / 'f'}")
    remove_socket("127.0.0.1:9002")
    assert (tmp_path / "f").exists()


@pytest.mark.parametrize("argv, says", [
    (["serve", "--listen", "unix:grpc.sock"], "GATEWAY_LISTEN: 'unix:grpc.sock' is not "
                                              "unix:/absolute/path"),
    (["serve", "--authz-http-listen", "unix:/tmp/d.sock", "--workers", "2"],
     "GATEWAY_AUTHZ_HTTP_LISTEN=unix:/tmp/d.sock: a unix socket is served by one process; "
     "GATEWAY_WORKERS > 1"),
    (["serve", "--listen", "unix:/tmp/g.sock", "--door-workers", "1"],
     "GATEWAY_LISTEN=unix:/tmp/g.sock: a unix socket is served by one process; "
     "GATEWAY_DOOR_WORKERS"),
    (["serve", "--records-http-listen", "unix:/tmp/r.sock"], "GATEWAY_RECORDS_HTTP_LISTEN: "),
])
def test_serve_refuses_unix_where_it_cannot_serve_it_in_one_line(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_REDIS_URL", "redis://127.0.0.1:1/0")  # workers need Redis
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}"), err
    assert err.count("\n") == 1 and "Traceback" not in err


def _cluster_addresses(ports: EnvoyPorts) -> dict[str, tuple[str, dict[str, object]]]:
    doc = yaml.safe_load(render(ports, metering="envoy"))
    return {c["name"]: (c["type"], c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
                        ["endpoint"]["address"]) for c in doc["static_resources"]["clusters"]}


def test_envoy_config_renders_pipes_for_unix_addresses_and_tcp_by_default() -> None:
    default = _cluster_addresses(EnvoyPorts())
    assert default[SIDECAR_CLUSTER] == ("STATIC", {"socket_address": {
        "address": "127.0.0.1", "port_value": 9001}})
    assert default[AUTHZ_HTTP_CLUSTER] == ("STATIC", {"socket_address": {
        "address": "127.0.0.1", "port_value": 9002}})
    uds = _cluster_addresses(EnvoyPorts(sidecar="unix:/run/gw/grpc.sock",
                                        authz_http="unix:/run/gw/door.sock"))
    assert uds[SIDECAR_CLUSTER] == ("STATIC", {"pipe": {"path": "/run/gw/grpc.sock"}})
    assert uds[AUTHZ_HTTP_CLUSTER] == ("STATIC", {"pipe": {"path": "/run/gw/door.sock"}})


def test_envoy_config_cli_takes_unix_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--sidecar", "unix:/run/gw/grpc.sock",
                 "--authz-http", "unix:/run/gw/door.sock"]) == 0
    out = capsys.readouterr().out
    assert "path: /run/gw/grpc.sock" in out and "path: /run/gw/door.sock" in out
    assert main(["envoy-config", "--sidecar", "unix:grpc.sock"]) == 2
    assert capsys.readouterr().err.startswith("error: sidecar: 'unix:grpc.sock' is not unix:/")


async def test_the_http_door_answers_on_a_unix_socket(tmp_path: Path) -> None:
    authorizer = HeldAuthorizer(ALLOW)
    authorizer.release.set()
    path = str(tmp_path / "door.sock")
    server = await authz_http.serve_unix(Check(authorizer),  # type: ignore[arg-type]
                                         path, max_body=1024)
    try:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(request("a"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
