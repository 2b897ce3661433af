"""deploy/envoy-prestop.sh, the Envoy container's preStop hook, against a real Envoy: the
requests in flight finish (up to DRAIN_S) and their records reach the sidecar before it
returns; a stream longer than the bound does not hold the pod's stop beyond it."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from devspoke.envoy_proc import EnvoyService
from devspoke.stack import Spoke
from testkit.spoke import read_events, start_spoke

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "envoy-prestop.sh"


@pytest.fixture
def spoke_keys(tmp_path: Path) -> Iterator[tuple[Spoke, dict[str, str]]]:
    spoke, keys = start_spoke(tmp_path / "spoke", metering="envoy")
    yield spoke, keys
    spoke.stop()


def _stream(spoke: Spoke, key: str, tokens: int, rid: list[str]) -> threading.Thread:
    def run() -> None:
        body = {"model": "mock-model", "max_tokens": tokens, "stream": True,
                "messages": [{"role": "user", "content": "go"}]}
        headers = {"authorization": f"Bearer {key}", "x-mock-tokens-per-s": "50"}
        with contextlib.suppress(httpx.HTTPError), httpx.stream(  # cut when the test ends
                "POST", f"{spoke.base_url}/chat/completions", timeout=60, headers=headers,
                json=body) as r:
            rid.append(r.headers["x-request-id"])
            for _ in r.iter_raw():
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not rid and time.monotonic() < deadline:
        time.sleep(0.05)
    return t


def _prestop(spoke: Spoke, drain_s: float) -> tuple[str, float]:
    envoy = spoke["envoy"]
    assert isinstance(envoy, EnvoyService)
    t0 = time.monotonic()
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         env={"ENVOY_ADMIN": f"127.0.0.1:{envoy.admin_port}",
                              "DRAIN_S": str(drain_s), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout, time.monotonic() - t0


def test_prestop_lets_the_stream_in_flight_finish_and_its_record_arrive(
        spoke_keys: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = spoke_keys
    rid: list[str] = []
    t = _stream(spoke, keys["good"], 100, rid)  # ~2 s
    out, took = _prestop(spoke, 20)
    assert "0 requests still in flight" in out and took < 10, (out, took)
    t.join(5)
    # The record reached the sidecar: only it makes a "completed" event of 100 tokens (the
    # orphan sweep would bill a checkpoint). Reading Kafka is a wait, not part of the claim:
    # Envoy lives on after the hook here, so a 5 s read told nothing a 30 s one does not.
    [event] = read_events(spoke.kafka_bootstrap, set(rid), timeout=30)
    assert event["outcome"] == "completed" and event["usage"]["completion_tokens"] == "100"


def test_prestop_returns_at_its_bound(spoke_keys: tuple[Spoke, dict[str, str]]) -> None:
    spoke, keys = spoke_keys
    rid: list[str] = []
    _stream(spoke, keys["good"], 1000, rid)  # ~20 s
    out, took = _prestop(spoke, 1)
    assert "1 requests still in flight" in out and 1 <= took < 5, (out, took)
