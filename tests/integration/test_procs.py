"""The process launchers against the real binaries: Redis, Tansu and Envoy on free ports."""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devspoke.envoy_proc import envoy_service
from devspoke.procs import (
    Service,
    ServiceError,
    free_port,
    port_open,
    redis_service,
    tansu_service,
)
from gateway.envoyconf.bootstrap import EnvoyPorts, render


def ping(port: int, timeout: float = 2.0) -> bytes:
    """Redis inline PING over a raw socket."""
    with socket.create_connection(("127.0.0.1", port), timeout) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Service]:
    with redis_service(free_port(), tmp_path) as service:
        yield service


def test_redis_kill_and_restart_on_the_same_port(redis: Service) -> None:
    assert ping(redis.port) == b"+PONG\r\n"

    redis.kill()
    assert not redis.alive
    assert not port_open(redis.port)

    redis.restart()
    assert redis.alive
    assert ping(redis.port) == b"+PONG\r\n"


def test_paused_redis_holds_its_port_but_answers_nothing(redis: Service) -> None:
    redis.pause()
    assert redis.alive
    with pytest.raises(TimeoutError):
        ping(redis.port, timeout=0.3)
    redis.resume()
    assert ping(redis.port) == b"+PONG\r\n"


def test_stop_ends_a_paused_process(redis: Service) -> None:
    redis.pause()
    redis.stop(timeout=5)
    assert not redis.alive
    assert not port_open(redis.port)


def test_start_reports_a_child_that_dies_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('boom: bad flag', flush=True); sys.exit(3)"]
    service = Service("dies", argv, free_port(), tmp_path)
    with pytest.raises(ServiceError, match=r"(?s)exited with 3.*boom: bad flag"):
        service.start()
    assert service.log_path.parent == tmp_path


def test_start_is_not_fooled_by_someone_else_on_the_port(tmp_path: Path) -> None:
    """Another program took the port first: our Redis cannot bind, and start() says so."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        service = redis_service(squatter.getsockname()[1], tmp_path)
        with pytest.raises(ServiceError, match="exited"):
            service.start()
    assert not service.alive


def test_tansu_broker_opens_its_port(tmp_path: Path) -> None:
    with tansu_service(free_port(), tmp_path) as broker:
        assert port_open(broker.port)
    assert not broker.alive
    assert not port_open(broker.port)


def test_envoy_fails_closed_when_the_sidecar_is_down(tmp_path: Path) -> None:
    """Nothing listens on the sidecar or engine ports: every path gets 503, none gets through."""
    listen, admin = free_port(), free_port()
    ports = EnvoyPorts(
        listen=f"127.0.0.1:{listen}",
        admin=f"127.0.0.1:{admin}",
        sidecar=f"127.0.0.1:{free_port()}",
        engine=f"127.0.0.1:{free_port()}",
        authz_http=f"127.0.0.1:{free_port()}",
    )
    with envoy_service(render(ports), admin, listen, tmp_path):
        for path, body in [("/v1/chat/completions", b'{"model": "m"}'), ("/v1/models", None)]:
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(f"http://127.0.0.1:{listen}{path}", data=body, timeout=10)
            assert answer.value.code == 503, path
