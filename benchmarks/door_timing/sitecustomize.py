"""bench_latency.py --door-times: the HTTP door's own time per Check, from the read that
completed its request to the write of its answer, appended to $GATEWAY_BENCH_DOOR_TIMES as
"<x-bench header or envoy> <leased 0/1> <µs>" lines. Loaded as `sitecustomize` by every
Python process of the run (this directory first on PYTHONPATH); it patches the door's
module when, and only if, a process imports it. Not part of the gateway: a measurement."""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import sys
import time
from typing import Any

OUT = os.environ.get("GATEWAY_BENCH_DOOR_TIMES")


def _patch(mod: Any) -> None:
    conn = mod._Connection
    received, write = conn.data_received, conn._write
    lines: list[str] = []

    def flush() -> None:
        with open(OUT, "a") as f:  # type: ignore[arg-type]
            f.writelines(lines)
        lines.clear()

    atexit.register(flush)  # the sidecar exits normally on SIGTERM

    def data_received(self: Any, data: bytes) -> None:
        self._bench_t = time.perf_counter()
        received(self, data)

    def _write(self: Any, req: Any, answer: Any) -> None:
        write(self, req, answer)
        us = (time.perf_counter() - getattr(self, "_bench_t", time.perf_counter())) * 1e6
        lines.append(f"{req.headers.get('x-bench', 'envoy')} "
                     f"{int(getattr(answer, 'leased', False))} {us:.1f}\n")
        if len(lines) >= 100:
            flush()

    conn.data_received, conn._write = data_received, _write


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "gateway.server.authz_http":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        assert spec is not None and spec.loader is not None
        exec_module = spec.loader.exec_module

        def patched(module: Any) -> None:
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = patched  # type: ignore[method-assign]
        return spec


if OUT:
    sys.meta_path.insert(0, _Finder())
