"""Installed as a user installs it: the wheel built from this checkout, plain `pip install`
into a fresh venv (no bootstrap script; the wheel's dependencies as pip resolves them), then
a spoke from it with the reference Envoy config and `gateway serve` on default settings (free
ports and local paths aside), traces on: every request answered, metered once, its slot
freed, its span exported.

The venv is put in the state that broke metering (issue 20) on purpose, so the test cannot
pass by install-order luck: opentelemetry-proto installed, then xds-protos reinstalled last,
whose OTLP 0.x copy of `opentelemetry/proto` overwrites it. pip's cache makes repeats fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import yaml

from devspoke.envoy_proc import envoy_service
from devspoke.procs import LOOPBACK, Service, free_port
from devspoke.stack import engine_service, wait_ready
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from testkit.otlp_receiver import otlp_receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a cold pip cache: minutes

ROOT = Path(__file__).resolve().parents[2]
MODEL_CONCURRENCY = 4
REQUESTS = 10
TRACE = "5" * 32  # each request a sampled child of this trace: the sidecar's spans join it
POLICY = {"models": {"mock-model": {"limits": {"concurrency": MODEL_CONCURRENCY}}},
          "teams": {"t": {"models": ["*"]}}}
# True when the OTLP logs messages at opentelemetry-proto's paths are xds-protos' 0.x copy
SHADOWED = ("from opentelemetry.proto.logs.v1 import logs_pb2 as m; "
            "print('scope_logs' not in m.ResourceLogs.DESCRIPTOR.fields_by_name)")


def _run(*argv: str | Path, env: dict[str, str] | None = None, cwd: Path) -> str:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=540)
    assert done.returncode == 0, f"{argv}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without what would make the venv import this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel of this checkout, plain-pip-installed, left shadowed."""
    tmp = tmp_path_factory.mktemp("plain")
    src = tmp / "src"  # a copy: building in the checkout would leave build/ behind
    files = _run("git", "ls-files", "-co", "--exclude-standard", "-z", cwd=ROOT).split("\0")
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    env = _clean_env()
    # Built with this interpreter's setuptools (pyproject's build requirement): a build
    # environment of its own cost 3 s and made the same files.
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", tmp / "dist", src, env=env, cwd=tmp)
    [wheel] = (tmp / "dist").glob("gateway-*.whl")
    # pip is this interpreter's, aimed at the venv (--python): the venv's own copy of pip
    # (ensurepip) took 5-7 s; --no-compile: bytecode is written as the modules are imported.
    _run(sys.executable, "-m", "venv", "--without-pip", tmp / "venv", env=env, cwd=tmp)
    pip = (sys.executable, "-m", "pip", "--python", tmp / "venv" / "bin" / "python",
           "install", "-q", "--no-compile")
    # The wheel with its dependencies as pip resolves them, and another distribution of
    # the real OTLP protos; then xds-protos last: its 0.x copy wins.
    _run(*pip, wheel, "opentelemetry-proto==1.45.2", env=env, cwd=tmp)
    _run(*pip, "--force-reinstall", "--no-deps", "xds-protos==1.85.0", env=env, cwd=tmp)
    yield tmp / "venv"


def test_plain_install_in_the_shadowed_state_meters_every_request(
        venv: Path, redis_url: str, tmp_path: Path) -> None:
    py, gw = venv / "bin" / "python", venv / "bin" / "gateway"
    env = _clean_env(GATEWAY_REDIS_URL=redis_url)
    where = _run(py, "-I", "-c", "import gateway; print(gateway.__file__)", env=env,
                 cwd=tmp_path)
    assert where.startswith(str(venv)), where  # the installed wheel, not this checkout
    assert _run(py, "-I", "-c", SHADOWED, env=env, cwd=tmp_path).strip() == "True"

    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    _run(gw, "policy", "apply", tmp_path / "policy.yaml", env=env, cwd=tmp_path)
    created = _run(gw, "keys", "create", "--team", "t", env=env, cwd=tmp_path)
    secret = next(ln.split()[-1] for ln in created.splitlines() if ln.startswith("secret:"))

    listen, door, metrics = free_port(), free_port(), free_port()
    with contextlib.ExitStack() as stack:
        collector, spans = stack.enter_context(otlp_receiver())
        sidecar = Service("sidecar", [str(gw), "serve"], listen, tmp_path, env={
            **env, "PYTHONPATH": "",  # Service adds the test's environment: empty is unset
            "GATEWAY_LISTEN": f"{LOOPBACK}:{listen}",
            "GATEWAY_AUTHZ_HTTP_LISTEN": f"{LOOPBACK}:{door}",
            "GATEWAY_METRICS_LISTEN": f"{LOOPBACK}:{metrics}",
            "GATEWAY_SPOOL_DIR": str(tmp_path / "spool"),
            "GATEWAY_USAGE_JSONL": str(tmp_path / "usage.jsonl"),
            # traces on: the OTLP exporter must work in this venv too
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{collector}"})
        engine = engine_service(free_port(), tmp_path)
        port, admin = free_port(), free_port()
        # envoy/envoy.yaml with these ports (a test keeps that file equal to this render)
        envoy = envoy_service(render(EnvoyPorts(
            listen=f"{LOOPBACK}:{port}", sidecar=sidecar.address, engine=engine.address,
            admin=f"{LOOPBACK}:{admin}", authz_http=f"{LOOPBACK}:{door}")),
            admin, port, tmp_path)
        for svc in (sidecar, engine, envoy):
            stack.enter_context(svc)
        wait_ready(f"http://{LOOPBACK}:{metrics}")
        c = openai.OpenAI(base_url=f"http://{LOOPBACK}:{port}/v1", api_key=secret,
                          max_retries=0)
        ids = []
        for i in range(REQUESTS):  # sequential: each ends before the next, so none is refused
            stream = i % 2 == 0
            raw = c.chat.completions.with_raw_response.create(
                model="mock-model", messages=[{"role": "user", "content": f"hi {i}"}],
                max_tokens=5, stream=stream,
                extra_headers={"traceparent": f"00-{TRACE}-{i + 1:016x}-01"})
            assert raw.status_code == 200, (i, raw.http_response.text)
            if stream:
                list(raw.parse())
            ids.append(raw.headers["x-request-id"])
        events = _events(tmp_path / "usage.jsonl", len(ids))
        assert sorted(e["event_id"] for e in events) == sorted(ids)  # one each, no other
        assert {e["outcome"] for e in events} == {"completed"}
        store = redis.Redis.from_url(redis_url)
        held = {k: store.zcard(k) for k in store.scan_iter("gw:conc:*")}
        assert sum(held.values()) == 0, held
        assert "record_unreadable" not in sidecar.log_path.read_text()
        traced = spans.wait_for(REQUESTS, TRACE)
        assert sorted(s.attributes["gateway.request_id"] for s in traced) == sorted(ids)


def test_the_wheel_is_the_product_alone(venv: Path, tmp_path: Path) -> None:
    """The wheel holds the gateway package and nothing else: the local spoke (devspoke/, the
    mock engine the tests check against) and the harnesses run from a checkout, and an
    installed `gateway dev` says so in one line."""
    [wheel] = (venv.parent / "dist").glob("gateway-*.whl")
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"gateway"}, tops
    done = subprocess.run([str(venv / "bin" / "gateway"), "dev"], capture_output=True,
                          text=True, cwd=tmp_path, env=_clean_env(), timeout=60)
    assert done.returncode == 2, done
    assert done.stdout == ""
    [line] = done.stderr.splitlines()  # one line: no traceback
    assert "checkout" in line and "make run" in line, line


def _events(path: Path, count: int, timeout: float = 20.0) -> list[dict[str, object]]:
    """The JSONL sink's events, once there are `count` (or whatever came by `timeout`)."""
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            break
        time.sleep(0.1)
    time.sleep(0.5)  # a duplicate would come in the same flush: give it the chance
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(ln) for ln in lines]
