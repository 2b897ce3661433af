"""/readyz follows the limiter store, with one process or GATEWAY_WORKERS of them: while
Redis does not answer every admission fails closed (503), so the sidecar is not ready
(README, docs/contracts.md: "ready when a policy is held and Redis answers"). And the gRPC
health on GATEWAY_LISTEN follows the policy by itself."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from devspoke.procs import Service, free_port
from gateway.cli import main
from gateway.policy import secrets


def _ready(mport: int) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{mport}/readyz", timeout=2).status_code
    except httpx.TransportError:
        return 0


def _until(mport: int, code: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _ready(mport) == code:
            return
        time.sleep(0.1)
    raise AssertionError(f"/readyz never answered {code} (last: {_ready(mport)})")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_readyz_is_503_while_redis_is_down(tmp_path: Path, redis_server: Service,
                                           redis_url: str, workers: str) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(yaml.safe_dump({
        "models": {"mock-model": {}}, "teams": {"t": {"models": ["*"]}},
        "keys": {"k1": {"team": "t", "sha256": secrets.digest(secrets.new_secret("k1")).hex()}},
    }))
    assert main(["policy", "apply", str(policy), "--redis-url", redis_url]) == 0
    port, mport = free_port(), free_port()
    svc = Service("sidecar", [sys.executable, "-m", "gateway", "serve"], port, tmp_path, env={
        "GATEWAY_LISTEN": f"127.0.0.1:{port}", "GATEWAY_METRICS_LISTEN": f"127.0.0.1:{mport}",
        "GATEWAY_AUTHZ_HTTP_LISTEN": "", "GATEWAY_REDIS_URL": redis_url,
        "GATEWAY_WORKERS": workers, "GATEWAY_INSTANCE_ID": "box",
        "GATEWAY_SPOOL_DIR": str(tmp_path / "spool"),
        "GATEWAY_USAGE_JSONL": str(tmp_path / "u.jsonl")}).start()
    try:
        _until(mport, 200, 15)
        redis_server.stop()
        # A worker sees its store gone within a second or two (its 1 s watch loop); 15 s
        # leaves a loaded machine room and is still "while Redis is down", the claim.
        _until(mport, 503, 15)
        redis_server.start()
        _until(mport, 200, 10)  # and ready again once it answers: no restart
    finally:
        svc.stop()
        if not redis_server.alive:
            redis_server.start()


def test_grpc_health_follows_the_policy_without_anyone_asking_readyz(
        tmp_path: Path, redis_url: str) -> None:
    """grpc.health.v1 on GATEWAY_LISTEN (DESIGN §7) is SERVING once a policy is held, as
    /readyz is, whether or not anything polls /readyz (a Kubernetes gRPC probe, an Envoy
    Gateway active health check, only ask the gRPC one)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port, mport = free_port(), free_port()
    svc = Service("sidecar", [sys.executable, "-m", "gateway", "serve"], port, tmp_path, env={
        "GATEWAY_LISTEN": f"127.0.0.1:{port}", "GATEWAY_METRICS_LISTEN": f"127.0.0.1:{mport}",
        "GATEWAY_AUTHZ_HTTP_LISTEN": "", "GATEWAY_REDIS_URL": redis_url,
        "GATEWAY_POLICY_RECHECK_S": "0.5", "GATEWAY_SPOOL_DIR": str(tmp_path / "spool"),
        "GATEWAY_USAGE_JSONL": str(tmp_path / "u.jsonl")}).start()

    def health() -> int:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            return int(health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5).status)

    try:
        assert health() == health_pb2.HealthCheckResponse.NOT_SERVING  # no policy yet
        policy = tmp_path / "p.yaml"
        policy.write_text(yaml.safe_dump({"models": {"m": {}}, "teams": {"t": {"models": ["*"]}},
                                          "keys": {}}))
        assert main(["policy", "apply", str(policy), "--redis-url", redis_url]) == 0
        deadline = time.monotonic() + 10
        while health() != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "gRPC health never turned SERVING"
            time.sleep(0.1)
    finally:
        svc.stop()
