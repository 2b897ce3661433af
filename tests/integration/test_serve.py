"""`gateway serve` as its own process: gRPC health, Check, /metrics, /readyz, file reload,
and several workers on one port."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from envoy.service.auth.v3 import external_auth_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devspoke.procs import (
    Service,
    exited,
    free_port,
    listening_children,
    port_open,
    redis_service,
)
from gateway.policy import secrets
from testkit.check_requests import check_request

SECRET = secrets.new_secret("k1")


def _policy(disabled: bool = False, limits: dict[str, int] | None = None) -> str:
    return yaml.safe_dump({
        "models": {"mock-model": {}},
        "teams": {"t": {"models": ["*"], "limits": limits or {"rps": 1000}}},
        "keys": {"k1": {"team": "t", "sha256": secrets.digest(SECRET).hex(),
                        "disabled": disabled}},
    })


def _sidecar(tmp: Path, env: dict[str, str]) -> tuple[Service, int]:
    port, mport = free_port(), free_port()
    svc = Service("sidecar", [sys.executable, "-m", "gateway", "serve"], port, tmp, env={
        "GATEWAY_LISTEN": f"127.0.0.1:{port}", "GATEWAY_METRICS_LISTEN": f"127.0.0.1:{mport}",
        "GATEWAY_AUTHZ_HTTP_LISTEN": "",  # never the fixed default port; tests that want it set it
        **env})
    return svc.start(), mport


def _check_code(port: int, key: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = pb_grpc.AuthorizationStub(ch).Check(check_request(key), timeout=5)
    return resp.denied_response.status.code if resp.status.code else 200


def _door_code(door: int, key: str) -> int:
    """The same Check through ext_authz's HTTP door, as Envoy's http_service sends it."""
    r = httpx.post(f"http://127.0.0.1:{door}/v1/chat/completions", timeout=5,
                   headers={"authorization": f"Bearer {key}", "x-request-id": str(uuid.uuid4())},
                   content=b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}')
    return r.status_code


def _until(cond: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def test_embedded_mode_serves_health_metrics_and_reloads(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy())
    svc, mport = _sidecar(tmp_path, {"GATEWAY_POLICY_FILE": str(policy)})
    try:
        with grpc.insecure_channel(svc.address) as ch:
            h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        assert _check_code(svc.port, SECRET) == 200
        assert _check_code(svc.port, "sk-wrong") == 401
        assert httpx.get(f"http://127.0.0.1:{mport}/readyz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{mport}/healthz").status_code == 200
        text = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
        assert 'gateway_authz_decisions_total{outcome="allowed"' in text
        assert 'reason="invalid_api_key"' in text
        assert "gateway_authz_check_seconds_bucket" in text
        assert "gateway_policy_revision 1.0" in text
        assert "gateway_hub_feed_up" not in text  # the syncer's, not a sidecar's: no feed here
        policy.write_text(_policy(disabled=True))  # the operator edits the file
        _until(lambda: _check_code(svc.port, SECRET) == 401, 10.0)  # a reload's, not a speed
        policy.write_text("keys: {k1: {team: nobody}}\n")  # invalid: the old one keeps serving
        _until(lambda: "policy_rejected" in svc.log_path.read_text(), 10.0)  # was a 1 s sleep
        assert _check_code(svc.port, "sk-wrong") == 401
        assert "gc_tuned" in svc.log_path.read_text()  # the start-up heap frozen
    finally:
        svc.stop()
    assert SECRET not in svc.log_path.read_text()


def test_a_spool_directory_it_cannot_make_is_one_clear_line(tmp_path: Path) -> None:
    """Where events would wait cannot be made (a path through a file, a read-only mount):
    `serve` exits 1 naming the directory and its setting, not with a traceback."""
    import subprocess
    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy())
    (tmp_path / "a-file").write_text("")
    spool = tmp_path / "a-file" / "spool"
    env = {**os.environ, "GATEWAY_POLICY_FILE": str(policy), "GATEWAY_SPOOL_DIR": str(spool),
           "GATEWAY_LISTEN": f"127.0.0.1:{free_port()}", "GATEWAY_AUTHZ_HTTP_LISTEN": "",
           "GATEWAY_METRICS_LISTEN": f"127.0.0.1:{free_port()}"}
    proc = subprocess.run([sys.executable, "-m", "gateway", "serve"], env=env, timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error: spool directory {spool}/" in proc.stderr
    assert "GATEWAY_SPOOL_DIR" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("workers", "taken"), [
    (1, "GATEWAY_METRICS_LISTEN"), (1, "GATEWAY_AUTHZ_HTTP_LISTEN"), (1, "GATEWAY_LISTEN"),
    (2, "GATEWAY_METRICS_LISTEN"), (2, "GATEWAY_AUTHZ_HTTP_LISTEN")])
def test_a_taken_port_is_one_clear_line_naming_its_setting(
        tmp_path: Path, redis_url: str, workers: int, taken: str) -> None:
    """Another process holds one of the addresses: `serve` exits 1 naming the address and
    its setting, alone or with workers (whose supervisor stops rather than restarting a
    worker that would fail the same, for ever), not with a traceback."""
    import socket
    import subprocess
    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy())
    env = {**os.environ, "GATEWAY_REDIS_URL": redis_url, "GATEWAY_WORKERS": str(workers),
           "GATEWAY_SPOOL_DIR": str(tmp_path / "spool"),
           **{k: f"127.0.0.1:{free_port()}" for k in (
               "GATEWAY_LISTEN", "GATEWAY_AUTHZ_HTTP_LISTEN", "GATEWAY_METRICS_LISTEN")}}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        env[taken] = f"127.0.0.1:{holder.getsockname()[1]}"
        proc = subprocess.run([sys.executable, "-m", "gateway", "serve"], env=env, timeout=60,
                              capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error: cannot listen on {env[taken]} ({taken}): " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_a_taken_grpc_port_says_why_in_one_line(tmp_path: Path) -> None:
    """GATEWAY_LISTEN held by another process: the one error line says why ("Address already
    in use"), as the HTTP listeners' do, not gRPC's "Failed to bind ...; set
    GRPC_VERBOSITY=debug" after a line of gRPC's own C++ log."""
    import socket
    import subprocess
    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy())
    env = {**os.environ, "GATEWAY_POLICY_FILE": str(policy),
           "GATEWAY_SPOOL_DIR": str(tmp_path / "spool"), "GATEWAY_AUTHZ_HTTP_LISTEN": "",
           "GATEWAY_METRICS_LISTEN": f"127.0.0.1:{free_port()}"}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        env["GATEWAY_LISTEN"] = f"127.0.0.1:{holder.getsockname()[1]}"
        proc = subprocess.run([sys.executable, "-m", "gateway", "serve"], env=env, timeout=60,
                              capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("{")]
    assert errors == [f"error: cannot listen on {env['GATEWAY_LISTEN']} (GATEWAY_LISTEN): "
                      "Address already in use"], proc.stderr


@pytest.mark.parametrize("taken", ["GATEWAY_LISTEN", "GATEWAY_AUTHZ_HTTP_LISTEN"])
def test_a_taken_port_with_workers_is_said_once(tmp_path: Path, redis_url: str,
                                                taken: str) -> None:
    """With GATEWAY_WORKERS=2 and a shared port held by another process, every worker said
    the same error line: the supervisor tries the address before it starts any (as it does
    for its own GATEWAY_METRICS_LISTEN), so it is said once."""
    import socket
    import subprocess
    env = {**os.environ, "GATEWAY_REDIS_URL": redis_url, "GATEWAY_WORKERS": "2",
           "GATEWAY_SPOOL_DIR": str(tmp_path / "spool"),
           **{k: f"127.0.0.1:{free_port()}" for k in (
               "GATEWAY_LISTEN", "GATEWAY_AUTHZ_HTTP_LISTEN", "GATEWAY_METRICS_LISTEN")}}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        env[taken] = f"127.0.0.1:{holder.getsockname()[1]}"
        proc = subprocess.run([sys.executable, "-m", "gateway", "serve"], env=env, timeout=60,
                              capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("{")]
    assert errors == [f"error: cannot listen on {env[taken]} ({taken}): "
                      "Address already in use"], proc.stderr


@pytest.mark.parametrize("setting", [
    "GATEWAY_LISTEN", "GATEWAY_AUTHZ_HTTP_LISTEN", "GATEWAY_METRICS_LISTEN"])
def test_a_listen_host_that_does_not_resolve_says_so_in_one_line(
        tmp_path: Path, setting: str) -> None:
    """A listen address whose host name does not resolve (a typo): one line with the
    resolver's reason, not 'Unknown error -2' (asyncio) or gRPC's 'Failed to bind'."""
    import subprocess
    policy = tmp_path / "policy.yaml"
    policy.write_text(_policy())
    env = {**os.environ, "GATEWAY_POLICY_FILE": str(policy),
           "GATEWAY_SPOOL_DIR": str(tmp_path / "spool"),
           **{k: f"127.0.0.1:{free_port()}" for k in (
               "GATEWAY_LISTEN", "GATEWAY_AUTHZ_HTTP_LISTEN", "GATEWAY_METRICS_LISTEN")},
           setting: "no-such-host.invalid:9001"}
    proc = subprocess.run([sys.executable, "-m", "gateway", "serve"], env=env, timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("{")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith(
        f"error: cannot listen on no-such-host.invalid:9001 ({setting}): "), errors
    assert "Unknown error" not in errors[0] and "GRPC_VERBOSITY" not in errors[0], errors


def test_serve_without_a_policy_refuses_and_says_why(tmp_path: Path, redis_url: str) -> None:
    """An operator who starts `serve` before `policy apply` sees every request refused (fail
    closed) and is told why in the log and on /readyz, then served once a policy is held."""
    from gateway.cli import main
    svc, mport = _sidecar(tmp_path, {"GATEWAY_REDIS_URL": redis_url})
    try:
        ready = httpx.get(f"http://127.0.0.1:{mport}/readyz")
        assert (ready.status_code, ready.text) == (503, "no policy loaded\n")
        assert _check_code(svc.port, SECRET) == 503
        _until(lambda: '"no_policy"' in svc.log_path.read_text(), 3.0)
        assert "gateway policy apply" in svc.log_path.read_text()
        (tmp_path / "p.yaml").write_text(_policy())
        assert main(["policy", "apply", str(tmp_path / "p.yaml"), "--redis-url", redis_url]) == 0
        _until(lambda: _check_code(svc.port, SECRET) == 200, 10)
    finally:
        svc.stop()


def test_serve_whose_redis_never_answers_refuses_everything(tmp_path: Path) -> None:
    """A sidecar that cannot reach its Redis from the start does not serve unlimited (Higress
    #4067: the limiter never connects and every request passes): every Check is refused,
    /readyz says not ready, and it serves once the Redis it was given comes up."""
    from gateway.cli import main
    rport = free_port()
    url = f"redis://127.0.0.1:{rport}/0"
    svc, mport = _sidecar(tmp_path, {"GATEWAY_REDIS_URL": url})
    redis = None
    try:
        assert httpx.get(f"http://127.0.0.1:{mport}/readyz").status_code == 503
        assert [_check_code(svc.port, SECRET) for _ in range(3)] == [503] * 3
        redis = redis_service(rport, tmp_path).start()
        (tmp_path / "p.yaml").write_text(_policy())
        assert main(["policy", "apply", str(tmp_path / "p.yaml"), "--redis-url", url]) == 0
        _until(lambda: _check_code(svc.port, SECRET) == 200, 15)
        assert httpx.get(f"http://127.0.0.1:{mport}/readyz").status_code == 200
    finally:
        svc.stop()
        if redis is not None:
            redis.stop()


def test_two_workers_share_one_port(tmp_path: Path, redis_url: str) -> None:
    from gateway.cli import main
    (tmp_path / "p.yaml").write_text(_policy())
    assert main(["policy", "apply", str(tmp_path / "p.yaml"), "--redis-url", redis_url]) == 0
    door = free_port()
    svc, mport = _sidecar(tmp_path, {"GATEWAY_REDIS_URL": redis_url, "GATEWAY_WORKERS": "2",
                                     "GATEWAY_INSTANCE_ID": "box",
                                     "GATEWAY_AUTHZ_HTTP_LISTEN": f"127.0.0.1:{door}"})
    try:
        _until(lambda: httpx.get(f"http://127.0.0.1:{mport}/readyz").status_code == 200, 10)
        codes = [_check_code(svc.port, SECRET) for _ in range(20)]
        codes += [_door_code(door, SECRET) for _ in range(20)]  # both workers bind the door
        assert codes == [200] * 40
        assert _door_code(door, "sk-wrong") == 401
        import redis
        statuses = redis.Redis.from_url(redis_url).hkeys("gw:policy:status")
        assert sorted(statuses) == [b"box-w0", b"box-w1"]
        text = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
        assert 'gateway_authz_decisions_total{outcome="allowed",reason="",tier=""} 40.0' in text
        assert 'outcome="denied",reason="invalid_api_key"' in text
        assert svc.log_path.read_text().count("gc_tuned") == 2  # in each worker
    finally:
        svc.stop()


def test_a_restart_settles_what_the_killed_run_had_spooled(tmp_path: Path,
                                                           redis_url: str) -> None:
    """Killed after a request's event was durable, before its settlement reached Redis:
    the next start settles it from the spool's tail, long before its lease would run out
    and the orphan sweep would bill it as an orphan."""
    import asyncio

    import redis

    from gateway.cli import main
    from gateway.limits import maths
    from gateway.sinks.spool import Spool
    from tests.unit.test_spool_tail import event
    (tmp_path / "p.yaml").write_text(_policy(limits={"concurrency": 5,
                                                     "tokens_per_day": 1_000_000}))
    assert main(["policy", "apply", str(tmp_path / "p.yaml"), "--redis-url", redis_url]) == 0
    door, spools = free_port(), tmp_path / "spool"
    svc, mport = _sidecar(tmp_path, {
        "GATEWAY_REDIS_URL": redis_url, "GATEWAY_INSTANCE_ID": "i1", "GATEWAY_LEASE_TTL_S": "30",
        "GATEWAY_SPOOL_DIR": str(spools), "GATEWAY_USAGE_JSONL": str(tmp_path / "u.jsonl"),
        "GATEWAY_AUTHZ_HTTP_LISTEN": f"127.0.0.1:{door}"})
    r = redis.Redis.from_url(redis_url)
    counter = f"gw:tpd:team:t:{maths.day_id(time.time())}"
    try:
        _until(lambda: httpx.get(f"http://127.0.0.1:{mport}/readyz").status_code == 200, 10)
        rid = str(uuid.uuid4())
        answer = httpx.post(f"http://127.0.0.1:{door}/v1/chat/completions", timeout=5,
                            headers={"authorization": f"Bearer {SECRET}", "x-request-id": rid},
                            content=b'{"model":"mock-model","messages":[],"max_tokens":50}')
        assert answer.status_code == 200
        assert r.zscore("gw:reqs", rid) is not None  # admitted, owes its settlement
        reserved = int(r.get(counter) or 0)
        assert reserved > 42
        svc.kill()
        spool = Spool(spools, "i1").open()  # its event, durable as the kill came
        seq = spool.next_seq()
        spool.put(seq, event(rid, seq, 42))
        asyncio.run(spool.commit())
        spool.close()
        svc.restart()
        _until(lambda: r.zscore("gw:reqs", rid) is None, 10)
        assert int(r.get(counter) or 0) == 42  # the reservation replaced by what was billed
        assert '"spool_tail_resettled"' in svc.log_path.read_text()
    finally:
        svc.stop()


def _door_answers(door: int) -> bool:
    try:
        return _door_code(door, SECRET) == 200
    except httpx.TransportError:
        return False


@pytest.mark.serial  # the parent's SIGKILL to its workers' exit is timed (~5.5 s, alone)
def test_door_workers_serve_the_door_and_the_rest_serves_the_rest(tmp_path: Path,
                                                                  redis_url: str) -> None:
    """GATEWAY_DOOR_WORKERS=1: `box-d0` alone binds the HTTP door, `box-w0` alone the gRPC
    port; one policy status each, one /metrics for both; a killed door worker comes back;
    a supervisor killed with SIGKILL takes its workers with it."""
    import redis

    from gateway.cli import main
    (tmp_path / "p.yaml").write_text(_policy())
    assert main(["policy", "apply", str(tmp_path / "p.yaml"), "--redis-url", redis_url]) == 0
    door = free_port()
    svc, mport = _sidecar(tmp_path, {"GATEWAY_REDIS_URL": redis_url, "GATEWAY_DOOR_WORKERS": "1",
                                     "GATEWAY_INSTANCE_ID": "box",
                                     "GATEWAY_SPOOL_DIR": str(tmp_path / "spool"),
                                     "GATEWAY_AUTHZ_HTTP_LISTEN": f"127.0.0.1:{door}"})
    workers: set[int] = set()
    try:
        assert svc.pid is not None
        _until(lambda: httpx.get(f"http://127.0.0.1:{mport}/readyz").status_code == 200, 10)
        records, doors = listening_children(svc.pid, svc.port), listening_children(svc.pid, door)
        assert len(records) == 1 and len(doors) == 1 and records != doors, (records, doors)
        workers = records | doors
        codes = [_check_code(svc.port, SECRET) for _ in range(7)]  # the records worker
        codes += [_door_code(door, SECRET) for _ in range(5)]  # the door worker
        assert codes == [200] * 12
        assert _door_code(door, "sk-wrong") == 401
        assert _check_code(svc.port, "sk-wrong") == 401
        statuses = redis.Redis.from_url(redis_url).hkeys("gw:policy:status")
        assert sorted(statuses) == [b"box-d0", b"box-w0"]
        text = httpx.get(f"http://127.0.0.1:{mport}/metrics").text  # both processes' counts
        assert 'gateway_authz_decisions_total{outcome="allowed",reason="",tier=""} 12.0' in text
        assert 'outcome="denied",reason="invalid_api_key",tier=""} 2.0' in text

        (killed,) = doors
        os.kill(killed, signal.SIGKILL)
        _until(lambda: exited(killed), 10)  # SIGKILL: at once, but a loaded /proc read
        _until(lambda: _door_answers(door), 15)  # restarted by the supervisor
        (again,) = listening_children(svc.pid, door)
        assert again != killed and listening_children(svc.pid, svc.port) == records
        assert "worker_died" in svc.log_path.read_text()
        workers = records | {again}

        # SIGKILL: nobody restarts a worker now, so the workers stop too: each sees its
        # parent gone within a second (docs/operations.md), then stops. Timed, so serial:
        # beside seven workers a loaded machine's clean stop has no bound of its own.
        svc.kill()
        t0 = time.monotonic()
        _until(lambda: all(exited(p) for p in workers), 3.5)
        assert time.monotonic() - t0 < 3.5
        assert not port_open(door) and not port_open(svc.port)
    finally:
        svc.stop()
        for p in workers:  # never leave a worker behind, whatever failed above
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
