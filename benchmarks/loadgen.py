"""Load-generator worker for bench_authz.py: a separate process, driven over stdin/stdout.

Each line on stdin is one JSON job; each answer is one JSON line on stdout. Jobs:

* ``{"kind": "grpc", ...}``: ext_authz Check calls (grpc.aio) with `concurrency` calls in
  flight. The CheckRequest arrives pre-serialized (``template_b64``) with a 36-character
  ``marker`` where the x-request-id goes; each call swaps in a fresh id of the same length,
  so the protobuf framing is unchanged and the client spends no time building messages.
* ``{"kind": "http", ...}``: HTTP/1.1 keep-alive POSTs over raw asyncio sockets (the
  fallback when `wrk` is not installed).
* ``{"kind": "quit"}``.

Every job has a warm-up (``warmup_s``), then a measured phase that stops at ``max_calls``
calls or ``duration_s`` seconds, whichever comes first. Around the measured phase the
worker samples /proc/<pid>/stat of the processes named in ``cpu_pids`` and its own CPU time.
All traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from collections import Counter
from typing import Any

from common import proc_cpu_s

CHECK_METHOD = "/envoy.service.auth.v3.Authorization/Check"
CALL_TIMEOUT_S = 5.0
MAX_MESSAGE = 64 * 1024 * 1024


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float | None]:
    return {name: proc_cpu_s(pid) for name, pid in pids.items()}


def cpu_delta(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float]:
    out = {}
    for name, b in before.items():
        a = after.get(name)
        if a is not None and b is not None:
            out[name] = a - b
    return out


def summarize(lat_ns: list[int]) -> dict[str, float]:
    """Nearest-rank percentiles, in milliseconds."""
    if not lat_ns:
        return {}
    s = sorted(lat_ns)
    n = len(s)

    def pct(p: float) -> float:
        return s[min(n - 1, max(0, int(p / 100 * n + 0.999999) - 1))] / 1e6

    return {"p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "max_ms": s[-1] / 1e6,
            "mean_ms": sum(s) / n / 1e6, "min_ms": s[0] / 1e6}


class Phase:
    """Shared budget of one phase: stop after `max_calls` issued or at `deadline`."""

    def __init__(self, max_calls: int, duration_s: float) -> None:
        self.max_calls = max_calls
        self.deadline = time.perf_counter() + duration_s
        self.issued = 0
        self.lat_ns: list[int] = []
        self.errors: Counter[str] = Counter()
        self.first_error = ""

    def take(self) -> bool:
        if self.issued >= self.max_calls or time.perf_counter() >= self.deadline:
            return False
        self.issued += 1
        return True

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        if not self.first_error:
            self.first_error = f"{kind}: {detail}"[:500]


async def run_phases(job: dict[str, Any], worker_factory: Any) -> dict[str, Any]:
    """Warm-up, then the measured phase with CPU sampling around it."""
    conc = int(job["concurrency"])
    warm = Phase(10**9, float(job["warmup_s"]))
    await asyncio.gather(*(worker_factory(warm, i) for i in range(conc)))
    pids = {k: int(v) for k, v in job.get("cpu_pids", {}).items()}
    cpu0, self0 = cpu_snapshot(pids), time.process_time()
    t0 = time.perf_counter()
    phase = Phase(int(job["max_calls"]), float(job["duration_s"]))
    await asyncio.gather(*(worker_factory(phase, i) for i in range(conc)))
    elapsed = time.perf_counter() - t0
    cpu1, self1 = cpu_snapshot(pids), time.process_time()
    calls = len(phase.lat_ns)
    return {
        "calls": calls,
        "elapsed_s": elapsed,
        "rps": calls / elapsed if elapsed > 0 else 0.0,
        "errors": sum(phase.errors.values()),
        "error_kinds": dict(phase.errors),
        "first_error": phase.first_error,
        "warmup_calls": len(warm.lat_ns),
        "warmup_errors": sum(warm.errors.values()),
        "warmup_first_error": warm.first_error,
        "latency": summarize(phase.lat_ns),
        "cpu_s": cpu_delta(cpu0, cpu1),
        "loadgen_cpu_s": self1 - self0,
        "capped": phase.issued >= phase.max_calls,
    }


async def grpc_job(job: dict[str, Any]) -> dict[str, Any]:
    import grpc
    from envoy.service.auth.v3 import external_auth_pb2 as pb

    template = base64.b64decode(job["template_b64"])
    marker = job["marker"].encode()
    if template.count(marker) != 1:
        raise ValueError("the request-id marker must occur exactly once in the template")
    head, tail = template.split(marker)
    prefix = os.urandom(6).hex() + "-bench-"
    width = len(marker) - len(prefix)
    parse = pb.CheckResponse.FromString
    opts = [("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE)]
    counter = 0
    async with grpc.aio.insecure_channel(job["target"], options=opts) as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        check = channel.unary_unary(CHECK_METHOD)  # no (de)serializers: bytes in, bytes out

        async def worker(phase: Phase, _: int) -> None:
            nonlocal counter
            while phase.take():
                counter += 1
                rid = f"{prefix}{counter:0{width}x}".encode()
                t = time.perf_counter_ns()
                try:
                    raw = await check(head + rid + tail, timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    phase.lat_ns.append(time.perf_counter_ns() - t)
                    phase.error(f"grpc:{exc.code().name}", exc.details() or "")
                    continue
                phase.lat_ns.append(time.perf_counter_ns() - t)
                resp = parse(raw)
                if resp.status.code != 0:
                    http = resp.denied_response.status.code
                    phase.error(f"denied:{http}", resp.denied_response.body)

        return await run_phases(job, worker)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """One HTTP/1.1 response: (status, keep_alive). Content-Length or chunked bodies."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length, chunked, keep = 0, False, True
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value:
            chunked = True
        elif name == "connection" and value == "close":
            keep = False
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status, keep


async def http_job(job: dict[str, Any]) -> dict[str, Any]:
    host, port = job["host"], int(job["port"])
    request = base64.b64decode(job["request_b64"])
    conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def worker(phase: Phase, i: int) -> None:
        while phase.take():
            t = time.perf_counter_ns()
            try:
                if i not in conns:
                    conns[i] = await asyncio.open_connection(host, port)
                reader, writer = conns[i]
                writer.write(request)
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    status, keep = await _read_response(reader)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                    TimeoutError, ValueError, IndexError) as exc:
                phase.lat_ns.append(time.perf_counter_ns() - t)
                phase.error(f"http:{exc.__class__.__name__}", str(exc))
                _close(conns.pop(i, None))
                continue
            phase.lat_ns.append(time.perf_counter_ns() - t)
            if not 200 <= status < 300:
                phase.error(f"status:{status}", "")
            if not keep:
                _close(conns.pop(i, None))

    try:
        return await run_phases(job, worker)
    finally:
        for pair in conns.values():
            _close(pair)


def _close(pair: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
    if pair is not None:
        pair[1].close()


async def serve() -> None:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        job = json.loads(line)
        if job["kind"] == "quit":
            return
        try:
            if job["kind"] == "grpc":
                result = await grpc_job(job)
            elif job["kind"] == "http":
                result = await http_job(job)
            else:
                raise ValueError(f"unknown job kind {job['kind']!r}")
        except Exception as exc:  # report it; the parent decides what to do
            result = {"fatal": f"{exc.__class__.__name__}: {exc}"}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cpus", default="", help="pin to these CPUs, e.g. '1' or '1,2'")
    args = parser.parse_args()
    if args.cpus:  # before grpc starts its threads, so they inherit the affinity
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


if __name__ == "__main__":
    main()
