"""GATEWAY_WORKERS processes sharing one port (SO_REUSEPORT), each its own instance.

The parent only supervises: it restarts a worker that dies and serves /metrics (merged
across workers with prometheus' multiprocess mode), /healthz and /readyz.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import socket
import tempfile
from multiprocessing.synchronize import Event as MpEvent

from gateway.log import configure, log
from gateway.settings import Settings


def _worker(settings: Settings, index: int, ready: MpEvent) -> None:
    import uvloop

    from gateway.server.app import App

    configure(settings.log_level)

    async def main() -> None:
        base = settings.instance_id or socket.gethostname()
        app = App(settings, f"{base}-w{index}")  # stable: a restarted worker keeps its seq
        await app.start(serve_http_endpoints=False)
        if app.holder.policy is not None:
            ready.set()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        while not stop.is_set():
            with_policy = app.holder.policy is not None
            (ready.set if with_policy else ready.clear)()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        await app.stop()

    uvloop.run(main())


def run_workers(settings: Settings) -> None:
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="gateway-prom-"))
    ctx = mp.get_context("spawn")
    procs: dict[int, tuple[mp.process.BaseProcess, MpEvent]] = {}

    def spawn(i: int) -> None:
        ready = ctx.Event()
        p = ctx.Process(target=_worker, args=(settings, i, ready), name=f"gateway-w{i}")
        p.start()
        procs[i] = (p, ready)

    for i in range(settings.workers):
        spawn(i)

    async def supervise() -> None:
        from gateway.addresses import split_hostport
        from gateway.ops_http import healthz, metrics_handler, serve_http

        async def readyz() -> tuple[int, str, bytes]:
            ok = all(p.is_alive() and r.is_set() for p, r in procs.values())
            return (200 if ok else 503), "text/plain", b"ready\n" if ok else b"not ready\n"

        host, port = split_hostport(settings.metrics_listen, "GATEWAY_METRICS_LISTEN")
        server = await serve_http(host, port, {
            "/metrics": metrics_handler, "/healthz": healthz, "/readyz": readyz})
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        while not stop.is_set():
            for i, (p, _) in list(procs.items()):
                if not p.is_alive():
                    log.error("worker_died", worker=i, exitcode=p.exitcode)
                    spawn(i)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        server.close()
        for p, _ in procs.values():
            p.terminate()
        for p, _ in procs.values():
            p.join(5)

    asyncio.run(supervise())
