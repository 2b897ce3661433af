"""bench_latency.py and bench_sources.py --door-times: where the sidecar's time goes around
each Check, appended to $GATEWAY_BENCH_DOOR_TIMES, one line per event (wall times from
time.time(), to be set beside Envoy's access log):

    check <x-bench header or envoy> <leased 0/1> <µs read to write> <wall of the read> <request id>
    export <records> <µs until its first wait> <µs in all> <wall of its start>
    settle <endings> <µs> <wall of its start>       (the ledger's end_many: one or more scripts)
    renew <ids> <µs> <wall of its start>
    admit <requests> <µs> <wall of its start>     (one admission call: admit.lua, a batch)
    gc <generation> <µs> <wall of its start> <objects collected>   (a cyclic collection)
    after <request id> <call> <size> <position> <µs reply read to the call's resume>
          <µs call's resume to this Check's resume> <µs resume to its _write> <µs encode>
          <µs write> <µs call's resume to written> <µs off CPU in that window>
          <µs off CPU in the write>

`after` (only with GATEWAY_BENCH_DOOR_AFTER=1 too; an admitted Check that waited on an
admission call): where the time from the call's reply to this Check's answer goes. The reply
is read (the Redis connection's data_received), the call's Task resumes (the batch's
verdicts, one future each), this Check's Task resumes (its position among the batch's Checks
resumed so far, from 1), its decision and answer are built, encoded and written
(transport.write: the send syscall). "Off CPU": wall time minus the thread's CPU time
(time.thread_time) over the window: the sidecar preempted, e.g. by Envoy on the same CPU
woken by an earlier write.

`export`'s first figure is how long the batch's records were read (each parsed, its event
into the spool) before it waited for the spool: read whole, it held the event loop that
long, and a Check whose request arrived then was read only after it; read in slices
(records_service.SLICE_S), the loop ran between them.

Loaded as `sitecustomize` by every Python process of the run (this directory first on
PYTHONPATH); it patches the modules when, and only if, a process imports them. Not part of
the gateway: a measurement."""

from __future__ import annotations

import atexit
import gc
import importlib.abc
import importlib.util
import os
import sys
import time
from typing import Any

OUT = os.environ.get("GATEWAY_BENCH_DOOR_TIMES")
AFTER = os.environ.get("GATEWAY_BENCH_DOOR_AFTER") == "1"  # `after` lines too
_lines: list[str] = []
_first_wait = [0.0]  # perf_counter of the latest spool wait (an Export's first wait)
_reply = [0.0]  # perf_counter of the latest Redis read (data_received)
# the latest admission call's resume: number, size, µs from its reply read, perf, thread CPU,
# Checks resumed since
_call: list[Any] = [0, 0, 0.0, 0.0, 0.0, 0]
_resumed = [0.0]  # perf_counter of the latest resume of a Check's Task
_encode = [0.0]  # µs the latest encode took


def _flush() -> None:
    with open(OUT, "a") as f:  # type: ignore[arg-type]
        f.writelines(_lines)
    _lines.clear()


def _add(line: str) -> None:
    _lines.append(line)
    if len(_lines) >= 100:
        _flush()


atexit.register(_flush)  # the sidecar exits normally on SIGTERM


def _patch_door(mod: Any) -> None:
    conn = mod._Connection
    received, write = conn.data_received, conn._write
    encode = mod.check_http.encode

    def data_received(self: Any, data: bytes) -> None:
        self._bench_t = time.perf_counter(), time.time()
        received(self, data)

    def timed_encode(answer: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return encode(answer)
        finally:
            _encode[0] = (time.perf_counter() - t0) * 1e6

    if AFTER:
        mod.check_http.encode = timed_encode

    class Started(mod._Started):  # type: ignore[misc,name-defined]
        __slots__ = ()

        def __await__(self) -> Any:
            inner = super().__await__()
            waiting = next(inner)
            while True:
                try:
                    sent = yield waiting
                except BaseException as exc:
                    try:
                        waiting = inner.throw(exc)
                    except StopIteration as done:
                        return done.value
                    continue
                _resumed[0] = time.perf_counter()
                _call[5] += 1
                try:
                    waiting = inner.send(sent)
                except StopIteration as done:
                    return done.value

    if AFTER:
        mod._Started = Started

    def _write(self: Any, req: Any, answer: Any) -> None:
        if not AFTER:
            write(self, req, answer)
        else:
            _after(self, req, answer)
        t, wall = getattr(self, "_bench_t", (time.perf_counter(), time.time()))
        _add(f"check {req.headers.get('x-bench', 'envoy')} "
             f"{int(getattr(answer, 'leased', False))} {(time.perf_counter() - t) * 1e6:.1f} "
             f"{wall:.6f} {req.request_id or '-'}\n")

    def _after(self: Any, req: Any, answer: Any) -> None:
        w0, c0 = time.perf_counter(), time.thread_time()
        resumed = _resumed[0]
        write(self, req, answer)
        w1, c1 = time.perf_counter(), time.thread_time()
        if resumed > _call[3] and resumed > self._bench_t[0]:  # it waited on that call
            n, size, read_us, p0, cpu0, pos = _call
            _add(f"after {req.request_id or '-'} {n} {size} {pos} {read_us:.1f} "
                 f"{(resumed - p0) * 1e6:.1f} {(w0 - resumed) * 1e6:.1f} {_encode[0]:.1f} "
                 f"{(w1 - w0) * 1e6 - _encode[0]:.1f} {(w1 - p0) * 1e6:.1f} "
                 f"{((w1 - p0) - (c1 - cpu0)) * 1e6:.1f} {((w1 - w0) - (c1 - c0)) * 1e6:.1f}\n")

    conn.data_received, conn._write = data_received, _write
    _time_gc()  # in the sidecar only (the process with the door)


def _time_gc() -> None:
    started = [0.0, 0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[:] = time.perf_counter(), time.time()
        else:
            _add(f"gc {info['generation']} {(time.perf_counter() - started[0]) * 1e6:.1f} "
                 f"{started[1]:.6f} {info['collected']}\n")

    gc.callbacks.append(timed)


def _patch_records(mod: Any) -> None:
    export = mod.RecordsService.export

    async def timed(self: Any, request: Any) -> None:
        wall, t0 = time.time(), time.perf_counter()
        n = sum(len(sl.log_records) for rl in request.resource_logs for sl in rl.scope_logs)
        await export(self, request)
        t1 = time.perf_counter()
        first = _first_wait[0] if _first_wait[0] > t0 else t1
        _add(f"export {n} {(first - t0) * 1e6:.1f} {(t1 - t0) * 1e6:.1f} {wall:.6f}\n")

    mod.RecordsService.export = timed


def _patch_spool(mod: Any) -> None:
    until = mod.Spool.until_durable

    async def timed(self: Any, seq: int) -> None:
        _first_wait[0] = time.perf_counter()
        await until(self, seq)

    mod.Spool.until_durable = timed


def _patch_store(mod: Any) -> None:
    cls = mod.RedisLimiter
    init = cls.__init__

    def timed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        script = self._admit

        async def timed(*call: Any) -> Any:  # call[7]: how many requests (_args)
            wall, t0 = time.time(), time.perf_counter()
            try:
                return await script(*call)
            finally:
                t1 = time.perf_counter()
                if AFTER:
                    _call[:] = (_call[0] + 1, call[7], (t1 - _reply[0]) * 1e6, t1,
                                time.thread_time(), 0)
                _add(f"admit {call[7]} {(t1 - t0) * 1e6:.1f} {wall:.6f}\n")

        self._admit = timed

    cls.__init__ = timed_init
    for name, kind in (("end_many", "settle"), ("renew", "renew")):
        orig = getattr(cls, name)

        def wrap(orig: Any, kind: str) -> Any:
            async def timed(self: Any, first: Any, *args: Any) -> Any:
                wall, t0 = time.time(), time.perf_counter()
                try:
                    return await orig(self, first, *args)
                finally:
                    _add(f"{kind} {len(first)} {(time.perf_counter() - t0) * 1e6:.1f} "
                         f"{wall:.6f}\n")
            return timed

        setattr(cls, name, wrap(orig, kind))


def _patch_resp(mod: Any) -> None:
    received = mod._Connection.data_received

    def data_received(self: Any, data: bytes) -> None:
        _reply[0] = time.perf_counter()
        received(self, data)

    mod._Connection.data_received = data_received


PATCHES = {"gateway.server.authz_http": _patch_door,
           "gateway.server.records_service": _patch_records,
           "gateway.sinks.spool": _patch_spool,
           "gateway.limits.redis_store": _patch_store}
if AFTER:
    PATCHES["gateway.limits.resp"] = _patch_resp


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(fullname)
        if patch is None:
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
            patch(module)

        spec.loader.exec_module = patched  # type: ignore[method-assign]
        return spec


if OUT:
    sys.meta_path.insert(0, _Finder())
