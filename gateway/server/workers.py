"""GATEWAY_WORKERS processes sharing one port (SO_REUSEPORT), each its own instance; with
GATEWAY_DOOR_WORKERS, that many more serving only the HTTP door (`<id>-d<i>`), the others
then everything but the door (app.Role).

The parent only supervises: it restarts a worker that dies and serves /metrics (merged
across workers with prometheus' multiprocess mode), /healthz and /readyz (every worker alive,
holding a policy, its limiter store answering). A worker whose parent is gone (killed with
SIGKILL) stops within a second: nobody would restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing as mp
import os
import socket
import sys
import tempfile
from multiprocessing.synchronize import Event as MpEvent
from typing import TYPE_CHECKING, Any

from gateway.errors import ListenError
from gateway.log import configure, log
from gateway.settings import Settings
from gateway.tasks import stop_on_signals

if TYPE_CHECKING:
    from gateway.server.app import Role

CANNOT_LISTEN = 3  # a worker's exit code: its address is taken, so restarting it is futile


def _worker(settings: Settings, name: str, role: Role, ready: MpEvent, parent: int,
            spool_flags: Any = None, index: int = -1) -> None:
    import uvloop

    from gateway.server.app import App
    from gateway.server.gc_tuning import tune_gc_after_startup
    from gateway.server.shared_gate import SharedGate

    configure(settings.log_level)

    async def main() -> None:
        base = settings.instance_id or socket.gethostname()
        app = App(settings, f"{base}-{name}", role)  # stable: a restart keeps its spool
        if spool_flags is not None:
            app.shared_gate = SharedGate(spool_flags, index)
        try:
            await app.start(serve_http_endpoints=False)
        except ListenError as exc:  # a restart would fail the same: the supervisor stops
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(CANNOT_LISTEN)
        tune_gc_after_startup()
        stop = stop_on_signals()
        while not stop.is_set() and os.getppid() == parent:
            # Ready as `App.readyz` is: a policy held, usage writable and the limiter store
            # answering (as the watch loop last saw it, every second); else every admission
            # fails closed.
            ok = app.holder.policy is not None and not app.gate.closed and app.store_up
            (ready.set if ok else ready.clear)()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        await app.stop()

    uvloop.run(main())


def run_workers(settings: Settings) -> int:
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="gateway-prom-"))
    ctx = mp.get_context("spawn")
    roles = workers_of(settings)
    procs: dict[str, tuple[mp.process.BaseProcess, MpEvent]] = {}
    # With door processes: one byte per records process, 1 while its spool cannot write,
    # which the door processes follow (they have no spool; gateway/server/shared_gate.py)
    records = [name for name, role in roles.items() if role == "records"]
    spool_flags = ctx.RawArray(ctypes.c_ubyte, len(records)) if settings.door_workers else None

    def spawn(name: str) -> None:
        ready = ctx.Event()
        index = records.index(name) if name in records else -1
        p = ctx.Process(target=_worker, args=(settings, name, roles[name], ready, os.getpid(),
                                              spool_flags, index),
                        name=f"gateway-{name}")
        p.start()
        procs[name] = (p, ready)

    async def supervise() -> int:
        from prometheus_client import multiprocess

        from gateway.addresses import binding, can_bind
        from gateway.ops_http import healthz, metrics_handler, serve_http

        async def readyz() -> tuple[int, str, bytes]:
            ok = all(p.is_alive() and r.is_set() for p, r in procs.values())
            return (200 if ok else 503), "text/plain", b"ready\n" if ok else b"not ready\n"

        # before any worker: a taken port is said once, and no worker starts for nothing
        with binding(settings.metrics_listen, "GATEWAY_METRICS_LISTEN") as (host, port):
            server = await serve_http(host, port, {
                "/metrics": metrics_handler, "/healthz": healthz, "/readyz": readyz})
        # the workers' shared ports, tried once here: a taken one would be said by each
        for address, setting in ((settings.listen, "GATEWAY_LISTEN"),
                                 (settings.authz_http_listen, "GATEWAY_AUTHZ_HTTP_LISTEN"),
                                 (settings.records_http_listen, "GATEWAY_RECORDS_HTTP_LISTEN")):
            if address:
                with binding(address, setting) as (host, port):
                    can_bind(host, port)
        for name in roles:
            spawn(name)
        stop = stop_on_signals()
        code = 0
        while not stop.is_set():
            for name, (p, _) in list(procs.items()):
                if p.exitcode == CANNOT_LISTEN:  # it said why on stderr
                    code = 1
                    stop.set()
                elif not p.is_alive():
                    log.error("worker_died", worker=name, exitcode=p.exitcode)
                    # Its live gauges (spool depth, ready) would otherwise stay summed
                    # into /metrics beside its successor's.
                    multiprocess.mark_process_dead(p.pid)
                    spawn(name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        server.close()
        for p, _ in procs.values():
            p.terminate()
        for p, _ in procs.values():
            p.join(5)
        return code

    return asyncio.run(supervise())


def workers_of(settings: Settings) -> dict[str, Role]:
    """Each worker's name (its instance id's suffix) and what it serves."""
    if not settings.door_workers:
        return {f"w{i}": "all" for i in range(settings.workers)}
    return {**{f"w{i}": "records" for i in range(settings.workers)},
            **{f"d{i}": "door" for i in range(settings.door_workers)}}
