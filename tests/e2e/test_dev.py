"""`gateway dev` (= `make run`): the whole local spoke comes up, serves the demo key, shows
the demo request's usage event, and Ctrl-C stops everything."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gateway.dev.procs import free_port, port_open


def test_gateway_dev_runs_the_tour(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "dev", "--port", str(port), "--workdir",
         str(tmp_path / "dev")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        while '"outcome": "completed"' not in out and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out += line
        assert '"outcome": "completed"' in out, out
        secret = next(ln.split()[-1] for ln in out.splitlines() if "demo key:" in ln)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       headers={"authorization": f"Bearer {secret}"},
                       json={"model": "mock-model", "messages": [], "max_tokens": 2})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert not port_open(port)  # Envoy is gone, and with it the rest
