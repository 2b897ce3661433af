"""Envoys beside a spoke's own, for comparison: the spoke's rendered bootstrap with some of
its HTTP filters taken out (plain Envoy, or ext_authz alone), and what their access logs say."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import yaml

from devspoke.envoy_proc import envoy_service
from devspoke.procs import LOOPBACK, Service, free_port
from gateway.envoyconf.bootstrap import EXT_AUTHZ, EXT_PROC, EnvoyPorts, render

WITHOUT_GATEWAY = (EXT_AUTHZ, EXT_PROC)  # plain Envoy: straight to the engine
WITHOUT_EXT_PROC = (EXT_PROC,)  # the Check alone, no ext_proc stream


def envoy_without(drop: tuple[str, ...], sidecar: str, engine: str, workdir: Path,
                  name: str, workers: int = 1) -> Service:
    """An Envoy (not started) on a free port, rendered as the ext_proc spoke's (the gRPC
    Check) but without the `drop` filters, to the same sidecar and engine addresses, with
    `workers` worker threads (--concurrency). Its port is `.port`."""
    port, admin = free_port(), free_port()
    config = yaml.safe_load(render(EnvoyPorts(
        listen=f"{LOOPBACK}:{port}", sidecar=sidecar, engine=engine,
        admin=f"{LOOPBACK}:{admin}", authz_http=None), metering="ext_proc"))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    hcm["typed_config"]["http_filters"] = [f for f in filters if f["name"] not in drop]
    assert len(hcm["typed_config"]["http_filters"]) == len(filters) - len(drop)
    svc = envoy_service(yaml.safe_dump(config, sort_keys=False), admin, port, workdir,
                        concurrency=workers)
    svc.name = name
    return svc


def access_log_outcomes(path: Path) -> dict[str, int]:
    """Envoy's JSON access log, counted by "status flags details" (warm-ups included)."""
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            key = f"{d.get('status')} {d.get('flags')} {d.get('details')}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def access_log_entry(log: Path, field: str, value: str, timeout: float = 5.0) -> dict[str, Any]:
    """The first JSON access-log entry whose `field` is `value` (Envoy's own log lines are not
    JSON), waiting up to `timeout` for Envoy to write and flush it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and value in line:
                entry: dict[str, Any] = json.loads(line)
                if entry.get(field) == value:
                    return entry
        time.sleep(0.05)
    raise AssertionError(f"no access log entry with {field} {value!r} in {log}:\n"
                         f"{log.read_text(errors='replace')[-2000:]}")
