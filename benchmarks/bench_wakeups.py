"""Where the sidecar's CPU per request goes at low and high rates, thread by thread.

    .venv/bin/python benchmarks/bench_wakeups.py [--rates 50,500] [--seconds 12] [--quick]
        [--out FILE]

The rate sweep (`bench_capacity.py --sweep`) shows the sidecar's CPU per request rising as
the rate falls. This says which threads it is and why: one spoke (the reference config,
the bench key admitted on three tiers in Redis, as bench_latency's), open-loop chat over
one keep-alive connection at each rate, and around each series every sidecar thread's
on-CPU time and wake-ups (/proc/PID/task/*/schedstat, the third field: how often the
thread was put on a CPU), per request. Python threads all show as `python`: the first is
the event loop, then the spool's disk thread and the default executor; `event_engine`
threads are gRPC's. µs per wake-up is each thread's CPU over its wake-ups: when it is the
same at every rate, the cost per request is the wake-ups per request, and those are what
batching (Envoy's records every 50 ms, group commits, settles) amortises.

Placement as bench_latency's: Envoy and the sidecar on CPU 0; the client, engine, Redis
and Tansu on CPU 1.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench_latency import request, round_trip, series, serve_keys, spoke_config
from common import git_state, machine_info, markdown_table, pin

from devspoke.procs import free_port
from devspoke.stack import Spoke
from gateway.policy import secrets


def threads(pid: int) -> dict[str, tuple[str, int, int]]:
    """tid -> (name, on-CPU ns, wake-ups)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns, _, wakeups = f.read().split()
        except OSError:
            continue  # ended meanwhile
        out[tid] = (comm, int(ns), int(wakeups))
    return out


def open_loop(address: str, raw: bytes, rate: float, seconds: float) -> int:
    """Requests at `rate` a second, one at a time, for `seconds`: how many were answered."""
    host, port = address.rsplit(":", 1)
    n, start = 0, time.monotonic()
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        due = start
        while time.monotonic() < start + seconds:
            round_trip(sock, raw)
            n += 1
            due += 1 / rate
            time.sleep(max(0.0, due - time.monotonic()))
    return n


def by_thread(pid: int, before: dict[str, tuple[str, int, int]], n: int
              ) -> list[dict[str, Any]]:
    after = threads(pid)
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    main_tid = str(pid)
    for tid, (comm, ns, wk) in after.items():
        ns0, wk0 = before[tid][1:] if tid in before else (0, 0)
        name = "python (event loop)" if tid == main_tid else comm
        rows[name][0] += ns - ns0
        rows[name][1] += wk - wk0
    return [{"thread": name, "us_per_req": ns / 1e3 / n, "wakeups_per_req": wk / n,
             "us_per_wakeup": ns / 1e3 / wk if wk else 0.0}
            for name, (ns, wk) in sorted(rows.items(), key=lambda r: -r[1][0]) if ns > 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="50,500", help="requests a second, comma-separated")
    ap.add_argument("--seconds", type=float, default=12.0, help="per rate")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 s a rate, shorter settles")
    a = ap.parse_args()
    if a.quick:
        a.seconds = 1.0
    rates = [float(x) for x in a.rates.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="bench-wakeups-"))
    secret, free_secret = secrets.new_secret("bench"), secrets.new_secret("free")
    spoke = Spoke(workdir=workdir / "spoke", listen_port=free_port(), metering="envoy",
                  envoy_config=spoke_config([])).start()
    results: dict[str, Any] = {}
    try:
        serve_keys(spoke, secret, free_secret, limited=True)
        if {0, 1} <= os.sched_getaffinity(0):
            os.sched_setaffinity(0, {1})
            for name, svc in spoke.services.items():
                pin(svc.pid, {0} if name in ("envoy", "sidecar") else {1})
        raw = request("/v1/chat/completions", {
            "content-type": "application/json", "authorization": f"Bearer {secret}",
            "x-mock-ttft-ms": "0", "x-mock-tokens-per-s": "0"})
        address = f"127.0.0.1:{spoke.listen_port}"
        series(address, raw, 200)  # warm-up
        pid = spoke["sidecar"].pid
        assert pid is not None
        for rate in rates:
            # the last series' records, settles and deliveries done: 1 s; --quick: until the
            # sidecar holds no admission and no undelivered event (at most 1 s), then 0.1 s
            settled_by = time.monotonic() + 1.0
            while a.quick and time.monotonic() < settled_by and (
                    spoke.metric("gateway_admissions_open"),
                    spoke.metric("gateway_usage_spool_depth")) != (0.0, 0.0):
                time.sleep(0.05)
            time.sleep(0.1 if a.quick else 1.0)
            before = threads(pid)
            n = open_loop(address, raw, rate, a.seconds)
            time.sleep(0.3)  # this series' last records batch and its delivery
            results[f"{rate:g}"] = {"requests": n, "threads": by_thread(pid, before, n)}
    finally:
        spoke.stop()
    body = []
    for rate, r in results.items():
        total_us = sum(t["us_per_req"] for t in r["threads"])
        total_wk = sum(t["wakeups_per_req"] for t in r["threads"])
        for t in r["threads"]:
            body.append((rate, t["thread"], f"{t['us_per_req']:.0f}",
                         f"{t['wakeups_per_req']:.2f}", f"{t['us_per_wakeup']:.0f}"))
        body.append((rate, "**all**", f"{total_us:.0f}", f"{total_wk:.2f}", ""))
    print("\n".join(markdown_table(("req/s", "sidecar thread", "µs/req", "wake-ups/req",
                                    "µs/wake-up"), body)))
    if a.out:
        a.out.write_text(json.dumps({"results": results, "seconds": a.seconds,
                                     "git": git_state(), "machine": machine_info()}, indent=2))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
