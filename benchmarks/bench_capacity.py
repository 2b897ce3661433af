"""Capacity for short, non-streamed requests: what the sidecar's fixed cost per request
allows, through the reference config, against an Envoy with no gateway at all.

    .venv/bin/python benchmarks/bench_capacity.py [--quick] [--baseline REV]
        [--out benchmarks/results/capacity.json]

Paths, measured in one run against one workload:
* `plain`: the spoke's Envoy config with ext_authz and ext_proc deleted
  (testkit.envoys.envoy_without), to the spoke's mock engine;
* `spoke`: a whole spoke (devspoke.stack.Spoke: Redis, Tansu, mock engine, sidecar,
  Envoy) with the reference config: Envoy-fed metering, the Check through the HTTP door;
* with `--baseline REV`, `baseline`: a second whole spoke whose sidecar and Envoy bootstrap
  are REV's code (`git archive`), its reference config as REV renders it by default.

The bench key, its team and the model carry limits too high to trip (rps, concurrency,
tokens per minute), so every request is admitted through all three tiers in Redis and
settled after, as under a real policy; `--no-limits` measures a key with none (no Redis
admission: the Check answers from the policy alone).

`--records-flush-ms MS`: the spoke's Envoy sends its records every MS (default: `gateway
envoy-config`'s, 50 ms); a `--baseline` keeps its own (`--baseline HEAD
--records-flush-ms 10` is an A/B of the flush alone).

`--envoy-workers N`: every Envoy of the run (plain, the spoke's, a baseline's) runs N
worker threads (`--concurrency N`; default 1, what every run before measured; an Envoy
started as the README shows runs one per core).

`--records-http`: the spoke's Envoy sends its records over OTLP/HTTP (`gateway envoy-config
--records-http`); with `--baseline HEAD`, the same code's default gRPC records beside it.

Workloads (the engine answers at once: x-mock-ttft-ms 0, no token pacing): `chat`, a
non-streamed chat completion with max_tokens 8; `embeddings`, one short input. For each
round, workload and concurrency c in 1, 8, 32, every path in turn (A B C, then C B A next
round): c closed-loop clients (aiohttp on uvloop, in this process) send `per_worker`
requests each. Per phase: requests/s = answers / wall time; latency p50 (median of the
rounds' p50s) and p99 (pooled); added = minus plain's. CPU per request of each process
(schedstat, every live thread, read 0.3 s after the phase's last answer so the records
Envoy flushes every 50 ms and the Kafka sends count in their phase).

Checks (exit 1 if any fails): every request answers 200 with a usage object; every metered
request's x-request-id is on its spoke's topic llm.usage.v1 exactly once, outcome
completed, with the engine's completion tokens (chat); no plain request id on a topic; no
traceback in the sidecars' logs.

CPU placement (2+ CPUs, unless --no-pin): Envoys and sidecars on CPU 0; the client, engines,
Redis and Tansu on CPU 1. With CPU 1 near 100 % the client, not the gateway, bounds req/s.
The issue's targets are printed beside the numbers, not asserted.

`--sweep`: instead of the closed-loop phases, a rate sweep through plain Envoy and the
reference config: open-loop chat requests at fixed rates (`--rates`, default
50,100,200,500,1000 req/s, each for `--rate-s` seconds; every path in turn, order reversed
each round). Per rate: the achieved req/s, latency, and each process's CPU per request
(idle time included: a timer that polls shows at the low rates) with its ratio to that
process's best rate; the issue's target is the sidecar within 1.5x of its best at every
rate. Plain Envoy's own ratio, and the mock engine's (a Python process doing the same work
per request at every rate), are the floor: what fewer requests a second do to any
process's cost per request on this machine (cold caches, a wake-up per request). Wake-ups
per request (how often a process's threads were put on a CPU, from schedstat) show why. A
rate past what the machine serves is shed (503, counted as `shed_503`, not a failure);
achieved req/s then falls short of the rate.
The table is printed, the rows are the JSON's `sweep`.

`--py-spy BIN`: py-spy (`pip install --target DIR py-spy`; BIN is its binary) records the
spoke's sidecar through the measured rounds (`--py-spy-out`, collapsed stacks, the
flamegraph's input), and the hottest functions by own time are printed: where the fixed
cost goes. Sampling costs the sidecar CPU, so a profiled run's numbers are not its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from common import (
    DOOR_CPU,
    Baseline,
    baseline_tree,
    descendants,
    envoy_flags,
    git_state,
    machine_info,
    markdown_table,
    pin,
    pin_sidecar,
    proc_cpu_s,
    runs,
    scan_log,
    tree_sched_ns,
)
from streaming import pct, serve_one_key

from devspoke.procs import Service, free_port
from devspoke.stack import Spoke
from devspoke.usage_topic import read_topic
from gateway.envoyconf.bootstrap import EnvoyPorts
from gateway.policy import secrets
from testkit.envoys import WITHOUT_GATEWAY, envoy_without

HERE = Path(__file__).resolve().parent
LOOP = "127.0.0.1"
PLAIN, SPOKE, BASELINE = "plain", "spoke", "baseline"
GATEWAY_CPU, OTHER_CPU = 0, 1
MODEL, MAX_TOKENS = "mock-model", 8
CONCURRENCY = (1, 8, 32)
SETTLE_S, REQUEST_TIMEOUT_S = 0.3, 30.0
QUICK_SETTLE_S = 0.1  # --quick: its CPU figures are not judged, only that it all answers
WORKLOADS: dict[str, tuple[str, bytes]] = {  # name -> (API path, body)
    "chat": ("/v1/chat/completions", orjson.dumps({
        "model": MODEL, "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": "classify: the sky is blue"}]})),
    "embeddings": ("/v1/embeddings", orjson.dumps({"model": MODEL, "input": "the sky is blue"})),
}
TARGETS = {  # the issue's: what, <= or >=, limit, unit
    "sidecar_us_c32": ("sidecar CPU per request at c=32 (chat)", "<=", 300.0, "µs"),
    "rps_x_plain_c32": ("chat req/s at c=32 vs plain", ">=", 0.4, "x"),
    "rps_x_baseline_c32": ("chat req/s at c=32 vs the baseline", ">=", 2.0, "x"),
    "added_p50_c1": ("added p50 at c=1 (chat)", "<=", 0.5, "ms"),
    "added_p99_c1": ("added p99 at c=1 (chat)", "<=", 1.5, "ms"),
    "sweep_worst_x_best": ("sidecar CPU per request, worst rate vs best (sweep)", "<=", 1.5,
                           "x"),
}
RATES = (50, 100, 200, 500, 1000)


@dataclass
class Answer:
    status: int
    latency_s: float
    request_id: str
    completion_tokens: int
    error: str = ""
    sent_at: float = 0.0  # time.time() when sent (--answers-out)


@dataclass
class Phase:
    round: int
    path: str
    workload: str
    concurrency: int
    wall_s: float
    cpu_s: dict[str, float]  # process name -> on-CPU seconds during the phase
    answers: list[Answer]
    rate: int = 0  # open-loop req/s (the sweep); 0: closed loop
    wakeups: dict[str, int] = field(default_factory=dict)  # process name -> times on a CPU


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes,
                      headers: dict[str, str]) -> Answer:
    sent_at = time.time()
    answer = await _answer(session, url, body, headers)
    answer.sent_at = sent_at
    return answer


async def _answer(session: aiohttp.ClientSession, url: str, body: bytes,
                  headers: dict[str, str]) -> Answer:
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            raw = await resp.read()
            latency = time.perf_counter() - t0
            rid = resp.headers.get("x-request-id", "")
            if resp.status != 200:
                return Answer(resp.status, latency, rid, -1, f"status {resp.status}")
            usage = orjson.loads(raw).get("usage")
            if not isinstance(usage, dict):
                return Answer(resp.status, latency, rid, -1, "no usage in the answer")
            return Answer(200, latency, rid, int(usage.get("completion_tokens", 0)))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Answer(0, time.perf_counter() - t0, "", -1, f"{type(exc).__name__}: {exc}"[:200])


async def closed_loop(session: aiohttp.ClientSession, url: str, body: bytes,
                      headers: dict[str, str], concurrency: int,
                      per_worker: int) -> list[Answer]:
    out: list[Answer] = []

    async def worker() -> None:
        for _ in range(per_worker):
            out.append(await one_request(session, url, body, headers))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def open_loop(session: aiohttp.ClientSession, url: str, body: bytes,
                    headers: dict[str, str], rate: int, seconds: float) -> list[Answer]:
    """Request i is sent at i/rate s, whether or not earlier ones have answered (a client
    that fell behind sends at once, so the rate achieved is reported, not assumed)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    sent = []
    for i in range(max(1, round(rate * seconds))):
        if (delay := t0 + i / rate - loop.time()) > 0:
            await asyncio.sleep(delay)
        sent.append(asyncio.ensure_future(one_request(session, url, body, headers)))
    return list(await asyncio.gather(*sent))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
        self.secret = secrets.new_secret("bench")
        self.spokes: dict[str, Spoke] = {}
        self.plain: Service | None = None
        self.base: Baseline | None = None
        self.pinned = not args.no_pin and {GATEWAY_CPU, OTHER_CPU} <= os.sched_getaffinity(0)
        self.paths = (PLAIN, SPOKE, *((BASELINE,) if args.baseline else ()))
        self.phases: list[Phase] = []
        self.sent: dict[str, dict[str, int]] = {p: {} for p in self.paths}  # rid -> tokens
        self.problems: Counter[str] = Counter()
        self.problem_sample: list[str] = []
        self.idle: dict[str, float] = {}

    def start(self) -> None:
        ahead = ({"GATEWAY_ADMIT_AHEAD_MS": f"{self.args.admit_ahead_ms:g}"}
                 if self.args.admit_ahead_ms else {})
        if self.args.door_workers:
            ahead["GATEWAY_DOOR_WORKERS"] = str(self.args.door_workers)
        self.spokes[SPOKE] = Spoke(workdir=self.workdir / SPOKE, listen_port=free_port(),
                                   metering="envoy", records_http=self.args.records_http,
                                   records_flush_s=self.args.records_flush_ms / 1e3,
                                   envoy_workers=self.args.envoy_workers,
                                   sidecar_env=ahead).start()
        if self.args.baseline:
            self.spokes[BASELINE] = self.start_baseline().start()
        for spoke in self.spokes.values():
            serve_one_key(spoke, self.secret, MODEL, limited=not self.args.no_limits)
        spoke = self.spokes[SPOKE]
        self.plain = envoy_without(WITHOUT_GATEWAY, spoke["sidecar"].address,
                                   spoke["engine"].address, self.workdir / PLAIN,
                                   "envoy-plain", self.args.envoy_workers).start()
        if self.pinned:
            os.sched_setaffinity(0, {OTHER_CPU})
            for name, svc in self.procs().items():
                if name.endswith(".sidecar"):  # and its workers, with GATEWAY_DOOR_WORKERS
                    door = self.spokes[name.split(".")[0]].authz_http_address
                    pin_sidecar(svc.pid, {GATEWAY_CPU}, door, self.args.door_cpu, {OTHER_CPU})
                else:
                    pin(svc.pid, {GATEWAY_CPU} if name.endswith(".envoy") else {OTHER_CPU})

    def start_baseline(self) -> Spoke:
        """REV's sidecar and its default (reference) Envoy config: its HTTP door where REV
        renders one by default (it has --grpc-check), else its gRPC Check."""
        base = self.base = baseline_tree(self.args.baseline, self.workdir / "baseline-tree")
        door_default = "--grpc-check" in base.gateway("envoy-config", "--help")

        def render(ports: EnvoyPorts, metering: str) -> str:
            door = ["--authz-http", ports.authz_http] if door_default and ports.authz_http \
                else []
            return base.gateway("envoy-config", "--listen", ports.listen, "--sidecar",
                                ports.sidecar, "--engine", ports.engine, "--admin", ports.admin,
                                "--metering", metering, *door)

        print(f"baseline {base.rev} = {base.describe} (Check: "
              f"{'HTTP door' if door_default else 'gRPC'})", flush=True)
        return Spoke(workdir=self.workdir / BASELINE, listen_port=free_port(),
                     sidecar_env=base.env, metering="envoy", authz_http=door_default,
                     envoy_config=render, envoy_workers=self.args.envoy_workers)

    def stop(self) -> None:
        for svc in (self.plain, *self.spokes.values()):
            if svc is not None:
                with contextlib.suppress(Exception):
                    svc.stop()

    def procs(self) -> dict[str, Service]:
        assert self.plain is not None
        out = {f"{PLAIN}.envoy": self.plain}
        for path, spoke in self.spokes.items():
            out |= {f"{path}.{name}": svc for name, svc in spoke.services.items()}
        return out

    def url(self, path: str, workload: str) -> str:
        assert self.plain is not None
        port = self.plain.port if path == PLAIN else self.spokes[path].listen_port
        return f"http://{LOOP}:{port}{WORKLOADS[workload][0]}"

    def cpu(self) -> dict[str, float]:
        """On-CPU seconds: schedstat (ns) for every process, /proc stat ticks as a fallback."""
        snap = {"client": time.process_time()}
        for name, svc in self.procs().items():
            sched, ticks = tree_sched_ns(svc.pid), proc_cpu_s(svc.pid)
            if (cpu := sched[0] / 1e9 if sched else ticks) is not None:
                snap[name] = cpu
        return snap

    def wakeups(self) -> dict[str, int]:
        return {name: sum(filter(None, map(runs, descendants(svc.pid))))
                for name, svc in self.procs().items() if svc.pid is not None}

    async def phase(self, session: aiohttp.ClientSession, rnd: int, path: str, workload: str,
                    conc: int, per_worker: int, rate: int = 0) -> None:
        """`conc` closed-loop clients of `per_worker` requests each; with `rate`, open loop
        at `rate` req/s for --rate-s seconds instead."""
        headers = {"authorization": f"Bearer {self.secret}", "content-type": "application/json",
                   "x-mock-ttft-ms": "0", "x-mock-tokens-per-s": "0"}
        url, body = self.url(path, workload), WORKLOADS[workload][1]
        # The client's own collections are not the spoke's: with every answer kept, a full one
        # took 121-167 ms, all 32 requests in flight waiting on it (docs/benchmarks.md). So
        # the client collects between phases, never inside one.
        gc.collect()
        gc.disable()
        try:
            woke, before, t0 = self.wakeups(), self.cpu(), time.perf_counter()
            answers = await (open_loop(session, url, body, headers, rate, self.args.rate_s)
                             if rate else closed_loop(session, url, body, headers, conc,
                                                      per_worker))
            wall = time.perf_counter() - t0
        finally:
            gc.enable()
        if rnd >= 0 or not self.args.quick:  # --quick: the warm-up settles once, at its end
            await asyncio.sleep(QUICK_SETTLE_S if self.args.quick else SETTLE_S)
        after, woke_after = self.cpu(), self.wakeups()
        for a in answers:
            if a.request_id and a.status == 200:
                self.sent[path][a.request_id] = a.completion_tokens
            if a.error and not (rate and a.status == 503):  # open loop past capacity: shed
                self.problems[f"{path} {workload}: {a.error.split(':')[0]}"] += 1
                if len(self.problem_sample) < 5:
                    self.problem_sample.append(f"{path} {workload} c={conc} round {rnd}: "
                                               f"{a.error} ({a.request_id})")
        if rnd >= 0:
            self.phases.append(Phase(rnd, path, workload, conc, wall,
                                     {k: after[k] - v for k, v in before.items() if k in after},
                                     answers, rate,
                                     {k: woke_after[k] - v for k, v in woke.items()
                                      if k in woke_after}))

    def per_worker(self, conc: int) -> int:
        a = self.args
        return {1: a.requests_c1, 8: a.requests_c8 // 8, 32: a.requests_c32 // 32}[conc]

    async def measure(self) -> None:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
            for path in self.paths:  # warm-up: connections, Kafka producers, caches
                for workload in WORKLOADS:
                    await self.phase(session, -1, path, workload, 8, 3)
            if self.args.quick:
                await asyncio.sleep(QUICK_SETTLE_S)
            before, t0 = self.cpu(), time.perf_counter()
            await asyncio.sleep(self.args.idle_s)
            after, wall = self.cpu(), time.perf_counter() - t0
            self.idle = {k: (after[k] - v) / wall * 1e6 for k, v in before.items() if k in after}
            spy = self.start_py_spy()
            try:
                await (self.sweep_rounds(session) if self.args.sweep else self.rounds(session))
                if self.args.and_sweep:
                    await self.sweep_rounds(session)
            finally:
                if spy is not None:
                    spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
                    spy.wait(30)

    def start_py_spy(self) -> subprocess.Popen[bytes] | None:
        if not self.args.py_spy:
            return None
        pid = self.spokes[SPOKE]["sidecar"].pid
        return subprocess.Popen([self.args.py_spy, "record", "--pid", str(pid),
                                 "--rate", str(self.args.py_spy_rate), "--format", "raw",
                                 "--nonblocking", *self.args.py_spy_flags,
                                 "-o", self.args.py_spy_out], stdout=subprocess.DEVNULL)

    async def rounds(self, session: aiohttp.ClientSession) -> None:
        for rnd in range(self.args.rounds):
            order = self.paths if rnd % 2 == 0 else self.paths[::-1]
            for workload in WORKLOADS:
                for conc in self.args.concurrency:
                    for path in order:
                        await self.phase(session, rnd, path, workload, conc,
                                         self.per_worker(conc))
            print(f"  round {rnd} ({' '.join(order)}): " + "; ".join(
                f"{p.path} {p.workload} c{p.concurrency} "
                f"{len(p.answers) / p.wall_s:.0f} req/s"
                for p in self.phases if p.round == rnd
                and p.concurrency == self.args.concurrency[-1]), flush=True)

    async def sweep_rounds(self, session: aiohttp.ClientSession) -> None:
        for rnd in range(self.args.rounds):
            order = self.paths if rnd % 2 == 0 else self.paths[::-1]
            for rate in self.args.rates:
                for path in order:
                    await self.phase(session, rnd, path, "chat", 0, 0, rate)
            print(f"  round {rnd} ({' '.join(order)}), sidecar µs/req: " + "; ".join(
                f"{p.path} {p.rate}/s "
                f"{p.cpu_s.get(f'{p.path}.sidecar', 0) / len(p.answers) * 1e6:.0f}"
                for p in self.phases if p.round == rnd and p.rate), flush=True)

    def sweep_rows(self) -> list[dict[str, Any]]:
        """Per path and rate: CPU per request of each process, and each process's against
        its own best rate (`x_best`). Plain Envoy's rows (its Envoy, and the engine it
        shares with the spoke) are the floor: what the machine does to any process's cost
        per request as the rate falls, with no gateway at all."""
        rows = []
        for path in self.paths:
            # A plain phase's engine is the spoke's (plain Envoy forwards to it).
            names = {f"{path}.": ""} | ({f"{SPOKE}.engine": "engine"} if path == PLAIN else {})
            mine = []
            for rate in self.args.rates:
                ph = [p for p in self.phases if (p.path, p.rate) == (path, rate)]
                n = sum(len(p.answers) for p in ph)
                lat = [[a.latency_s * 1000 for a in p.answers if not a.error] for p in ph]
                cpu_us = {proc: sum(p.cpu_s.get(k, 0.0) for p in ph) / n * 1e6
                          for k, proc in _sweep_procs(ph, path, names).items()}
                mine.append({"path": path, "rate": rate, "requests": n,
                             "ok": sum(1 for p in ph for a in p.answers if not a.error),
                             "shed_503": sum(1 for p in ph for a in p.answers
                                             if a.status == 503),
                             "rps": n / sum(p.wall_s for p in ph),
                             "p50_ms": statistics.median(pct(x, 50) for x in lat),
                             "p99_ms": pct([v for x in lat for v in x], 99),
                             "cpu_us_per_req": cpu_us,
                             "wakeups_per_req": {
                                 proc: sum(p.wakeups.get(k, 0) for p in ph) / n
                                 for k, proc in _sweep_procs(ph, path, names).items()
                                 if k != "client"},
                             "sidecar_us_rounds": [p.cpu_s.get(f"{path}.sidecar", 0.0)
                                                   / len(p.answers) * 1e6 for p in ph]})
            for proc in {k for r in mine for k in r["cpu_us_per_req"]}:
                best = min(r["cpu_us_per_req"].get(proc, math.inf) for r in mine)
                for r in mine:
                    if proc in r["cpu_us_per_req"] and best > 0:
                        r.setdefault("x_best", {})[proc] = r["cpu_us_per_req"][proc] / best
            for r in mine:
                r["sidecar_x_best"] = r.get("x_best", {}).get("sidecar", math.nan)
            rows += mine
        return rows

    def row(self, path: str, workload: str, conc: int) -> dict[str, Any]:
        ph = [p for p in self.phases
              if (p.path, p.workload, p.concurrency) == (path, workload, conc)]
        n = sum(len(p.answers) for p in ph)
        lat = [[a.latency_s * 1000 for a in p.answers if not a.error] for p in ph]
        procs = sorted({k for p in ph for k in p.cpu_s if k.startswith(f"{path}.")} | {"client"})
        cpu_us = {k.split(".", 1)[-1]: sum(p.cpu_s.get(k, 0.0) for p in ph) / n * 1e6
                  for k in procs}
        return {"path": path, "workload": workload, "concurrency": conc, "requests": n,
                "ok": sum(1 for p in ph for a in p.answers if not a.error),
                "rps": n / sum(p.wall_s for p in ph),
                "rps_rounds": [len(p.answers) / p.wall_s for p in ph],
                "p50_ms": statistics.median(pct(x, 50) for x in lat),
                "p99_ms": pct([v for x in lat for v in x], 99),
                # in the JSON only: where a stall of the sidecar's loop (a full garbage
                # collection at c=32) shows, beyond the p99
                "p999_ms": pct([v for x in lat for v in x], 99.9),
                "max_ms": max((v for x in lat for v in x), default=math.nan),
                "cpu_us_per_req": cpu_us}

    def summary(self) -> list[dict[str, Any]]:
        if self.args.sweep:
            return []
        rows = []
        for workload in WORKLOADS:
            for conc in self.args.concurrency:
                plain = self.row(PLAIN, workload, conc)
                for path in self.paths:
                    r = plain if path == PLAIN else self.row(path, workload, conc)
                    r["added_p50_ms"] = r["p50_ms"] - plain["p50_ms"]
                    r["added_p99_ms"] = r["p99_ms"] - plain["p99_ms"]
                    r["rps_x_plain"] = r["rps"] / plain["rps"]
                    rows.append(r)
        if BASELINE in self.paths:
            by = {(r["path"], r["workload"], r["concurrency"]): r for r in rows}
            for (path, workload, conc), r in by.items():
                if path == SPOKE:
                    r["rps_x_baseline"] = r["rps"] / by[BASELINE, workload, conc]["rps"]
        return rows


async def check_topic(bootstrap: str, want: dict[str, int], foreign: set[str],
                      timeout_s: float) -> dict[str, Any]:
    """Every wanted id once, outcome completed, the engine's completion tokens; no foreign
    (plain) id."""
    counts: Counter[str] = Counter()
    bad: list[str] = []

    def keep(m: Any) -> bool:
        ev = orjson.loads(m.value or b"{}")
        rid = ev.get("event_id", "")
        counts[rid] += 1
        tokens = int((ev.get("usage") or {}).get("completion_tokens", 0))
        if rid in want and (ev.get("outcome") != "completed" or tokens != want[rid]):
            bad.append(f"{rid}: outcome {ev.get('outcome')}, completion_tokens {tokens} "
                       f"(want {want[rid]})")
        return True

    await read_topic(bootstrap, keep, lambda: want.keys() <= counts.keys(), timeout=timeout_s)
    missing = want.keys() - counts.keys()
    dups = sum(n - 1 for rid, n in counts.items() if rid in want and n > 1)
    plain = len(foreign & counts.keys())
    return {"requests": len(want), "found": len(want) - len(missing), "missing": len(missing),
            "missing_sample": sorted(missing)[:5], "duplicates": dups, "bad": len(bad),
            "bad_sample": bad[:5], "plain_ids": plain,
            "ok": not missing and not dups and not bad and not plain}


# --------------------------------------------------------------------------- output


def _sweep_procs(phases: list[Phase], path: str, names: dict[str, str]) -> dict[str, str]:
    """Phase CPU keys to process names for `path`'s rows ("spoke.sidecar" -> "sidecar")."""
    keys = {k for p in phases for k in p.cpu_s} | {"client"}
    out = {k: k.split(".", 1)[-1] for k in keys if k.startswith(f"{path}.") or k == "client"}
    return out | {k: v for k, v in names.items() if v and k in keys}


def render_table(rows: list[dict[str, Any]]) -> str:
    head = ("path", "workload", "c", "req", "req/s", "x plain", "x base", "p50 ms", "p99 ms",
            "+p50", "+p99", "envoy µs/req", "sidecar µs/req", "engine µs/req", "redis µs/req",
            "client µs/req")

    def us(r: dict[str, Any], proc: str) -> str:
        v = r["cpu_us_per_req"].get(proc)
        return "-" if v is None else f"{v:,.0f}"

    body = [(r["path"], r["workload"], str(r["concurrency"]), str(r["requests"]),
             f"{r['rps']:,.0f}", f"{r['rps_x_plain']:.2f}",
             f"{r['rps_x_baseline']:.2f}" if "rps_x_baseline" in r else "-",
             f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['added_p50_ms']:+.2f}",
             f"{r['added_p99_ms']:+.2f}", us(r, "envoy"), us(r, "sidecar"), us(r, "engine"),
             us(r, "redis"), us(r, "client")) for r in rows]
    return "\n".join(markdown_table(head, body))


def render_sweep(rows: list[dict[str, Any]]) -> str:
    """CPU per request of each process, and (x) against that process's best rate."""
    procs = ("sidecar", "envoy", "engine", "redis")
    head = ("path", "rate/s", "req", "503", "achieved/s", "p50 ms", "p99 ms",
            *(f"{p} µs/req (x best)" for p in procs), "sidecar wake-ups/req",
            "envoy wake-ups/req")

    def us(r: dict[str, Any], proc: str) -> str:
        v = r["cpu_us_per_req"].get(proc)
        x = r.get("x_best", {}).get(proc)
        return "-" if v is None else f"{v:,.0f} ({x:.2f})" if x else f"{v:,.0f}"

    body = [(r["path"], str(r["rate"]), str(r["requests"]), str(r["shed_503"]),
             f"{r['rps']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
             *(us(r, p) for p in procs),
             *(f"{r['wakeups_per_req'].get(p, 0):.1f}" if p in r["wakeups_per_req"] else "-"
               for p in ("sidecar", "envoy"))) for r in rows]
    return "\n".join(markdown_table(head, body))


def targets(rows: list[dict[str, Any]], sweep: list[dict[str, Any]]) -> dict[str, float]:
    by = {(r["path"], r["workload"], r["concurrency"]): r for r in rows}
    out: dict[str, float] = {}
    if ours := [r for r in sweep if r["path"] == SPOKE]:
        out["sweep_worst_x_best"] = max(r["sidecar_x_best"] for r in ours)
    if plain := [r for r in sweep if r["path"] == PLAIN]:  # the floor, not a target
        out["sweep_plain_envoy_worst_x_best"] = max(r["x_best"]["envoy"] for r in plain)
        out["sweep_engine_worst_x_best"] = max(r["x_best"].get("engine", 0) for r in plain)
    if chat32 := by.get((SPOKE, "chat", 32)):
        out |= {"sidecar_us_c32": chat32["cpu_us_per_req"].get("sidecar", float("nan")),
                "rps_x_plain_c32": chat32["rps_x_plain"]}
        if "rps_x_baseline" in chat32:
            out["rps_x_baseline_c32"] = chat32["rps_x_baseline"]
    if chat1 := by.get((SPOKE, "chat", 1)):
        out |= {"added_p50_c1": chat1["added_p50_ms"], "added_p99_c1": chat1["added_p99_ms"]}
    return out


def target_lines(values: dict[str, float]) -> list[str]:
    out = []
    for key, (what, op, limit, unit) in TARGETS.items():
        if key not in values:
            continue
        v = values[key]
        met = v >= limit if op == ">=" else v <= limit
        out.append(f"target {what} {op} {limit:g} {unit}: {'met' if met else 'NOT met'} "
                   f"({v:.2f} {unit})")
    return out


def hottest(collapsed: Path, top: int = 25) -> list[str]:
    """The functions with the most samples on top of the stack (own time), and by inclusive
    time, from py-spy's collapsed stacks ("frame;frame;... count" lines)."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    with contextlib.suppress(OSError):
        for line in collapsed.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            frames = stack.split(";")
            total += int(n)
            own[frames[-1]] += int(n)
            for f in set(frames):
                incl[f] += int(n)
    out = [f"py-spy: {total} samples of the sidecar ({collapsed}); own time:"]
    out += [f"  {n / total:6.1%}  {f}" for f, n in own.most_common(top)] if total else []
    out.append("inclusive:")
    out += [f"  {n / total:6.1%}  {f}" for f, n in incl.most_common(top * 2)] if total else []
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test, about a minute")
    parser.add_argument("--out", default=str(HERE / "results" / "capacity.json"))
    parser.add_argument("--baseline", metavar="REV", default=None,
                        help="also a whole spoke running REV's sidecar and reference config")
    parser.add_argument("--rounds", type=int, default=None, help="quick 1, full 5")
    parser.add_argument("--requests-c1", type=int, default=None,
                        help="requests per path per round at c=1 (quick 10, full 200)")
    parser.add_argument("--requests-c8", type=int, default=None,
                        help="... at c=8 (quick 40, full 800)")
    parser.add_argument("--requests-c32", type=int, default=None,
                        help="... at c=32 (quick 64, full 1600)")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        help="closed-loop clients per phase, comma-separated (default: "
                             "%(default)s)")
    parser.add_argument("--sweep", action="store_true",
                        help="the rate sweep (open loop, chat) instead of the closed-loop phases")
    parser.add_argument("--and-sweep", dest="and_sweep", action="store_true",
                        help="the closed-loop phases, then the rate sweep, on the same spokes "
                             "(the smoke test's one start for both)")
    parser.add_argument("--rates", default=",".join(map(str, RATES)),
                        help="the sweep's req/s, comma-separated (default: %(default)s)")
    parser.add_argument("--rate-s", type=float, default=None,
                        help="seconds at each rate (quick 0.3, full 6)")
    parser.add_argument("--records-http", dest="records_http", action="store_true",
                        help="the spoke's Envoy sends its records over OTLP/HTTP (with "
                             "--baseline HEAD: the same code's gRPC records beside it)")
    envoy_flags(parser, "; a --baseline keeps its own")
    parser.add_argument("--admit-ahead-ms", type=float, default=0.0,
                        help="the spoke's GATEWAY_ADMIT_AHEAD_MS (docs/admit-ahead.md); with "
                             "--baseline HEAD, the same code without it beside it")
    parser.add_argument("--door-workers", type=int, default=0,
                        help="the spoke's GATEWAY_DOOR_WORKERS (with --baseline HEAD, the same "
                             "code without them beside it)")
    parser.add_argument("--door-cpu", choices=DOOR_CPU, default="free",
                        help="where the door workers run (common.pin_sidecar)")
    parser.add_argument("--no-limits", dest="no_limits", action="store_true",
                        help="the key, its team and the model carry no limits: no admission in "
                             "Redis (default: limits too high to trip on all three tiers)")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--answers-out", metavar="FILE", default=None,
                        help="every measured request as a JSON line: path, workload, c, round, "
                             "sent_at (time.time()), latency_ms, status, x-request-id")
    parser.add_argument("--keep-workdir", action="store_true")
    parser.add_argument("--py-spy", metavar="BIN", default=None,
                        help="record the spoke's sidecar with this py-spy binary")
    parser.add_argument("--py-spy-flag", dest="py_spy_flags", action="append", default=[],
                        help="one more py-spy record flag, e.g. --py-spy-flag=--native")
    parser.add_argument("--py-spy-rate", type=int, default=250,
                        help="py-spy samples a second (default: %(default)s)")
    parser.add_argument("--py-spy-out", default=str(HERE / "results" / "capacity-sidecar.txt"),
                        help="py-spy's collapsed stacks (default: %(default)s)")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.rates = [int(r) for r in args.rates.split(",")]
    args.rate_s = args.rate_s or (0.3 if args.quick else 6.0)
    if not set(args.concurrency) <= set(CONCURRENCY):
        parser.error(f"--concurrency: each one of {CONCURRENCY}")
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.requests_c1 = args.requests_c1 or (10 if args.quick else 200)
    args.requests_c8 = args.requests_c8 or (40 if args.quick else 800)
    args.requests_c32 = args.requests_c32 or (64 if args.quick else 1600)
    args.idle_s = 0.2 if args.quick else 3.0

    import uvloop

    started, loadavg_start = time.time(), os.getloadavg()
    bench = Bench(args)
    checks: dict[str, dict[str, Any]] = {}
    logs: dict[str, dict[str, Any]] = {}
    try:
        bench.start()
        print(f"up: {', '.join(bench.paths)}; pinned={bench.pinned}; {args.rounds} rounds; "
              f"the spoke's records flushed every {args.records_flush_ms:g} ms; "
              f"{args.envoy_workers} Envoy worker(s) each", flush=True)
        uvloop.run(bench.measure())
        for path, spoke in bench.spokes.items():
            checks[path] = uvloop.run(check_topic(spoke.kafka_bootstrap, bench.sent[path],
                                                  set(bench.sent.get(PLAIN, {})), 30.0))
            logs[path] = scan_log(spoke["sidecar"].log_path, 0)
    finally:
        bench.stop()
        if args.keep_workdir:
            print(f"workdir kept: {bench.workdir}")
        else:
            shutil.rmtree(bench.workdir, ignore_errors=True)

    if args.py_spy:
        print("\n".join(hottest(Path(args.py_spy_out))))
    swept = args.sweep or args.and_sweep
    rows, sweep = bench.summary(), bench.sweep_rows() if swept else []
    values = targets(rows, sweep)
    print("\n" + "\n\n".join([*([render_table(rows)] if not args.sweep else []),
                               *([render_sweep(sweep)] if swept else [])]))
    print("CPU per request: schedstat of each process over the phase and 0.3 s after it, "
          "idle CPU included (idle µs/s: " + ", ".join(
              f"{k} {v:,.0f}" for k, v in sorted(bench.idle.items())
              if k.endswith(".sidecar")) + ")")
    print("\n".join(target_lines(values)))
    if "sweep_plain_envoy_worst_x_best" in values:
        print(f"floor (no gateway), worst rate vs best: plain Envoy's CPU per request "
              f"{values['sweep_plain_envoy_worst_x_best']:.2f} x, the engine's (Python) "
              f"{values['sweep_engine_worst_x_best']:.2f} x")
    bad = sum(bench.problems.values())
    ok = not bad and len(checks) == len(bench.spokes)
    if bad:
        print(f"errors: {dict(bench.problems)}, e.g.\n  " + "\n  ".join(bench.problem_sample))
    for path, c in checks.items():
        lg = logs.get(path) or {}
        ok = ok and c["ok"] and not lg.get("tracebacks")
        print(f"Kafka read-back ({path}): {'OK' if c['ok'] else 'FAILED'}: {c['found']}/"
              f"{c['requests']} request ids found, {c['duplicates']} duplicates, {c['bad']} bad"
              f" {c['bad_sample'][:2]}, {c['plain_ids']} plain ids"
              + (f", missing e.g. {c['missing_sample'][:3]}" if c["missing"] else ""))
        if lg.get("tracebacks"):
            print(f"sidecar log ({path}): {lg['tracebacks']} tracebacks; first:\n"
                  f"{lg['first_traceback'][:1500]}")
    loadavg_end = os.getloadavg()
    print(f"checks: {'passed' if ok else 'FAILED'}; load average {loadavg_start[0]:.1f} -> "
          f"{loadavg_end[0]:.1f}; {time.time() - started:.0f} s")
    doc = {
        "bench": "capacity", "mode": "quick" if args.quick else "full",
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "duration_s": time.time() - started, "checks_passed": ok,
        "baseline": bench.base.describe if bench.base else None,
        "spoke_records": "http" if args.records_http else "grpc",
        "spoke_records_flush_ms": args.records_flush_ms, "envoy_workers": args.envoy_workers,
        "spoke_admit_ahead_ms": args.admit_ahead_ms,
        "spoke_door_workers": args.door_workers, "door_cpu": args.door_cpu,
        "admission": "none (--no-limits)" if args.no_limits
        else "three tiers, limits too high to trip",
        "workload": {"max_tokens": MAX_TOKENS, "concurrency": args.concurrency,
                     "sweep": {"rates": args.rates, "seconds": args.rate_s} if swept
                     else None,
                     "requests": {"c1": args.requests_c1, "c8": args.requests_c8,
                                  "c32": args.requests_c32}},
        "rounds": args.rounds, "targets": TARGETS, "target_values": values, "rows": rows,
        "sweep": sweep,
        "idle_us_per_s": bench.idle, "errors": bench.problems,
        "error_sample": bench.problem_sample, "kafka_check": checks, "sidecar_log": logs,
        "machine": machine_info(pinned=bench.pinned, loadavg_start=loadavg_start,
                                loadavg_end=loadavg_end),
        "git": git_state(),
    }
    if args.answers_out:
        with open(args.answers_out, "wb") as f:
            for p in bench.phases:
                for a in p.answers:
                    f.write(orjson.dumps({"path": p.path, "workload": p.workload,
                                          "c": p.concurrency, "round": p.round,
                                          "sent_at": a.sent_at,
                                          "latency_ms": a.latency_s * 1000,
                                          "status": a.status, "rid": a.request_id}) + b"\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
