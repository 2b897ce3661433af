"""The two metering sources side by side: CPU per request and per chunk, TTFT, stream pace
and throughput of each, against an Envoy with no gateway at all.

    .venv/bin/python benchmarks/bench_sources.py [--quick] [--grpc-check] [--no-limits]
        [--admit-ahead-ms 250] [--records-flush-ms 50] [--envoy-workers 1]
        [--redis-with-gateway] [--door-times]
        [--out benchmarks/results/sources.json]

Three paths (four with --grpc-check), measured in one run against one workload:
* `plain`: the spoke's Envoy config with ext_authz and ext_proc deleted
  (testkit.envoys.envoy_without), to the ext_proc spoke's mock engine;
* `ext_proc`: a whole spoke (devspoke.stack.Spoke: Redis, Tansu, mock engine, sidecar,
  Envoy) with metering=ext_proc: every SSE chunk goes through the sidecar;
* `envoy`: a second spoke with metering=envoy: Envoy's Lua and
  json_to_metadata filters do the byte work, one OpenTelemetry access-log record per request
  goes to the sidecar, which builds the usage event; ext_authz reaches the sidecar through
  its HTTP door (as `gateway dev` runs it);
* with `--grpc-check`, `envoy_grpc_check`: a third spoke, the same with ext_authz's gRPC
  Check instead of the HTTP door: what the door saves, in the same run.

The bench key, its team and the model carry limits too high to trip (rps, concurrency,
tokens per minute), so every metered request is admitted through all three tiers in Redis
and settled after, as under a real policy; `--no-limits` measures a key with none (no Redis
admission: the Check answers from the policy alone; what this bench measured before
2026-12-06). `--admit-ahead-ms MS` sets GATEWAY_ADMIT_AHEAD_MS on every spoke's sidecar
(docs/admit-ahead.md). `--records-flush-ms MS`: every spoke's Envoy sends its records every
MS (`gateway envoy-config --records-flush-ms`). `--envoy-workers N`: every Envoy (plain and
the spokes') runs N worker threads (`--concurrency N`; default 1). The JSON records each
(`admission`, `spoke_admit_ahead_ms`, `spoke_records_flush_ms`, `envoy_workers`), and the
header line prints them.

Workload: streaming chat completions (`stream: true`, no stream_options), the engine paced by
x-mock-ttft-ms 20 and x-mock-tokens-per-s 1000 (content chunks 1 ms apart; see c8x4), max_tokens =
content chunks; closed loops of c clients starting together (bench_metering's SSE client:
aiohttp on uvloop in this process). After a warm-up of every path, each round runs three
phases, each through the three paths in turn (A B C, then C B A next round, ...):
* `c8x4`, `c8x64`: 8 clients, as many requests each, 4- and 64-chunk streams. On-CPU time
  (schedstat, every live thread) per request of the path's Envoy and of its sidecar, summed
  over rounds, gives per_chunk = (cpu64/req - cpu4/req) / 60 and fixed = cpu4/req -
  4 * per_chunk (for the sidecar: Check, record, event). The 4-chunk streams start their
  first chunk 60 ms later (x-mock-ttft-ms 80), so both last ~83 ms and come at the same
  rate: what the sidecar batches (Redis admissions, the records Envoy flushes every 50 ms,
  Kafka sends) costs the same per request in both, and the split measures chunks, not a
  rate effect (with equal TTFTs the 4-chunk requests came ~5x as often, which the split
  counted as per-chunk cost). TTFT = first content event - request sent, from c8x64:
  p50 = median of the rounds' p50s, p99 pooled, +p50 = minus plain's. Where the added TTFT
  goes: each Envoy's access log gives `to_engine_us` per request (its first byte to the
  first byte sent to the engine: the Check and the Lua splice), printed as p50/p99.
* `c32x64`: 32 clients, 64-chunk streams: throughput = requests / wall time of the phases,
  pace = each stream's mean gap between content events, averaged over streams; both also
  relative to plain.
CPU is read 0.3 s after a phase's last answer, so the envoy source's records (flushed every
50 ms) and both sidecars' Kafka sends count in their phase. Background CPU when idle (timers,
policy re-checks) is measured once after the warm-up (JSON `idle_us_per_s`): the table keeps
it, the notes under it show the split with it subtracted.

Checks (exit 1 if any fails): every request answers 200 with the right number of content
events, `[DONE]` and no usage chunk (the client did not ask for one); the x-request-id of
every metered request answered 200 (warm-up included) is on its spoke's topic llm.usage.v1
exactly once, outcome completed, usage_source reported, completion_tokens = its chunks; no
plain request id on either topic; no traceback in the sidecars' logs. For each request not
answered 200 the Envoy access-log line (status, flags, details, ext_authz time) is printed.

`--door-times`: the `envoy` spoke's sidecar loads benchmarks/door_timing (as
bench_latency.py --door-times does: its docstring has the lines), which logs inside it each
Check's read-to-write µs and the wall time of its read, each records Export, settle and
renewal, and each admission call (admit.lua, a batch). After the run, for the c8x64
phases' Checks (joined by request id): read-to-write p50/p90; bursts (Checks each read
within 1 ms of the one before) and, by position in a burst, read-to-write, `to_engine_us`
and sent-to-read (the client's send, time.time(), to the door's read: the client, the
loopback and Envoy before the Check reached the door); how many Checks' read-to-write
windows overlap an Export's reading (the loop held) or a settle/renewal; for admitted
Checks, the admission call that answered each (the last to start after its read and end
before its answer): µs before it, in it, after it, and its size. Printed and in the JSON
(`door_times`). The sidecar's own work for those lines adds a few µs per Check. With
GATEWAY_BENCH_DOOR_AFTER=1 in the environment too, each admitted Check's time after its call
is split (`after_split`: the reply read, the call's Task resumed, this Check's Task resumed,
its answer built, encoded, written; and whether the sidecar was off CPU meanwhile), for the
first Check a call answers and for the others; this costs a few µs more per Check.

CPU placement (2+ CPUs, unless --no-pin): each path's Envoy and sidecar on CPU 0; the client,
engines, Redis and Tansu on CPU 1 (`--redis-with-gateway`: both spokes' Redis on CPU 0 with
the gateways instead; JSON `redis_cpu`, and the header line prints it). `cpu0 %`/`cpu1 %`: how
busy the path's gateway and CPU 1's processes were at c=32; with cpu1 near 100 % the client
side, not the gateway, bounds throughput and pace. The issue's targets are printed beside the
numbers, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from common import (
    envoy_flags,
    git_state,
    markdown_table,
    pin,
    proc_cpu_s,
    scan_log,
    sched_ns,
    together,
)
from streaming import Sample, Workload, closed_loop, pct, serve_one_key

from devspoke.procs import Service, free_port
from devspoke.stack import Spoke
from devspoke.usage_topic import read_topic
from gateway.policy import secrets
from gateway.settings import Metering
from testkit.envoys import WITHOUT_GATEWAY, envoy_without

HERE = Path(__file__).resolve().parent
LOOP = "127.0.0.1"
PLAIN, EXT_PROC, ENVOY = "plain", "ext_proc", "envoy"
ENVOY_GRPC = "envoy_grpc_check"  # --grpc-check: the envoy source with the gRPC Check
# each metered path's spoke: (metering source, Check through the HTTP door? None: default)
SPOKES: dict[str, tuple[Metering, bool | None]] = {
    EXT_PROC: ("ext_proc", None), ENVOY: ("envoy", None), ENVOY_GRPC: ("envoy", False)}
PATHS = (PLAIN, EXT_PROC, ENVOY)
GATEWAY_CPU, OTHER_CPU = 0, 1
SHORT, LONG = 4, 64
TTFT_MS, TOKENS_PER_S = 20.0, 1000.0  # the engine's pace: first chunk at 20 ms, then 1 ms apart
PHASES = {"c8x4": ("8", SHORT), "c8x64": ("8", LONG), "c32x64": ("32", LONG)}
SETTLE_S, PHASE_TIMEOUT_S = 0.3, 60.0
QUICK_SETTLE_S = 0.1  # --quick: its CPU figures are not judged, only that it all answers
CLK = os.sysconf("SC_CLK_TCK")
# For the envoy source: row key -> (what, <= or >=, limit, unit). The Envoy-native design's
# targets, but the TTFT's: issue 26's (the design's was 1.5 ms).
TARGETS = {
    "sidecar_us_per_chunk": ("sidecar per additional chunk", "<=", 5.0, "µs"),
    "sidecar_fixed_us": ("sidecar fixed per request", "<=", 800.0, "µs"),
    "envoy_chunk_x_plain": ("Envoy per chunk vs plain Envoy's", "<=", 2.0, "x"),
    "ttft_added_p50_ms": ("TTFT p50 added at c=8", "<=", 1.0, "ms"),
    "throughput_x_plain": ("throughput at c=32 vs plain", ">=", 0.95, "x"),
    "pace_x_plain": ("stream pace at c=32 vs plain", "<=", 1.05, "x")}


@dataclass
class Phase:
    round: int
    path: str
    kind: str
    wall_s: float
    span_s: float  # between the CPU snapshots (wall + settling)
    cpu_s: dict[str, float]  # process name -> on-CPU seconds during the phase
    samples: list[Sample]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-sources-"))
        self.secret = secrets.new_secret("bench")
        self.spokes: dict[str, Spoke] = {}
        self.plain: Service | None = None
        self.pinned = not args.no_pin and {GATEWAY_CPU, OTHER_CPU} <= os.sched_getaffinity(0)
        self.phases: list[Phase] = []
        self.paths = PATHS + ((ENVOY_GRPC,) if args.grpc_check else ())
        self.sent: dict[str, dict[str, int]] = {p: {} for p in self.paths}  # rid -> chunks
        self.problems: Counter[str] = Counter()
        self.problem_sample: list[str] = []
        self.refused: dict[str, int] = {}  # rid -> chunks, requests answered other than 200
        self.idle: dict[str, float] = {}
        self.held: dict[str, dict[str, int]] = {}  # path -> request id -> to_engine_us
        # processes pinned with the gateways on CPU 0 (by name suffix); the rest go on CPU 1
        self.on_gateway = (".envoy", ".sidecar") + ((".redis",) if args.redis_with_gateway
                                                    else ())

    def start(self) -> None:
        ahead = ({"GATEWAY_ADMIT_AHEAD_MS": f"{self.args.admit_ahead_ms:g}"}
                 if self.args.admit_ahead_ms else {})
        for source in self.paths[1:]:
            metering, door = SPOKES[source]
            env = ahead | (self.door_env() if source == ENVOY and self.args.door_times
                           else {})
            self.spokes[source] = Spoke(
                workdir=self.workdir / source, listen_port=free_port(), metering=metering,
                authz_http=door, sidecar_env=env, engine_ttft_ms=TTFT_MS,
                engine_tokens_per_s=TOKENS_PER_S,
                records_flush_s=self.args.records_flush_ms / 1e3,
                envoy_workers=self.args.envoy_workers)
        # the spokes start together: each start waits for its ports, and the waits overlap
        together(*(spoke.start for spoke in self.spokes.values()))
        for spoke in self.spokes.values():
            serve_one_key(spoke, self.secret, limited=not self.args.no_limits)
        ext_proc = self.spokes[EXT_PROC]
        self.plain = envoy_without(WITHOUT_GATEWAY, ext_proc["sidecar"].address,
                                   ext_proc["engine"].address, self.workdir / PLAIN,
                                   "envoy-plain", self.args.envoy_workers).start()
        if self.pinned:
            os.sched_setaffinity(0, {OTHER_CPU})
            for name, svc in self.procs().items():
                pin(svc.pid, {GATEWAY_CPU} if name.endswith(self.on_gateway) else {OTHER_CPU})

    def door_env(self) -> dict[str, str]:
        """--door-times: the envoy spoke's sidecar loads benchmarks/door_timing."""
        return {"PYTHONPATH": os.pathsep.join([str(HERE / "door_timing"),
                                               os.environ.get("PYTHONPATH", "")]),
                "GATEWAY_BENCH_DOOR_TIMES": str(self.workdir / "door-times")}

    def door_times(self) -> dict[str, Any]:
        """--door-times: the c8x64 Checks of the envoy path, as the sidecar saw them."""
        lines: dict[str, list[list[str]]] = {}
        with contextlib.suppress(OSError):
            for line in (self.workdir / "door-times").read_text().splitlines():
                kind, *rest = line.split()
                lines.setdefault(kind, []).append(rest)
        sent = {s.request_id: s.sent_at for p in self.phases
                if p.path == ENVOY and p.kind == "c8x64" for s in p.samples}
        checks = sorted((float(wall), float(us), rid) for _, _, us, wall, rid
                        in lines.get("check", []) if rid in sent)
        if not checks:
            return {}
        held = self.held.get(ENVOY, {})
        exports = [(float(w), float(w) + float(h) / 1e6) for _, h, _, w in lines.get("export", [])]
        store = [(float(w), float(w) + float(us) / 1e6)
                 for kind in ("settle", "renew") for _, us, w in lines.get(kind, [])]

        def overlaps(spans: list[tuple[float, float]], a: float, b: float) -> bool:
            return any(s < b and e > a for s, e in spans)

        by_pos: dict[int, list[tuple[float, int | None, float]]] = {}
        sizes: Counter[int] = Counter()
        pos, prev = 0, -1.0
        burst: list[int] = []
        met_export = met_store = 0
        admits = sorted((float(w), float(w) + float(us) / 1e6, int(n))
                        for n, us, w in lines.get("admit", []))
        calls: list[tuple[float, float, float, int]] = []  # wait, call, after (µs), size
        for wall, us, _ in checks:  # its call: the last to start after the read, end before
            end = wall + us / 1e6
            mine = [a for a in admits if a[0] >= wall and a[1] <= end]
            if mine:
                s0, e0, n = mine[-1]
                calls.append(((s0 - wall) * 1e6, (e0 - s0) * 1e6, (end - e0) * 1e6, n))
        for i, (wall, us, rid) in enumerate(checks):
            pos = pos + 1 if wall - prev < 0.001 else 1
            prev = wall
            if pos == 1 and burst:
                sizes[len(burst)] += 1
                burst = []
            burst.append(i)
            by_pos.setdefault(min(pos, 8), []).append(
                (us, held.get(rid), (wall - sent[rid]) * 1e6))
            met_export += overlaps(exports, wall, wall + us / 1e6)
            met_store += overlaps(store, wall, wall + us / 1e6)
        sizes[len(burst)] += 1
        us_all = [c[1] for c in checks]
        eng = [held[c[2]] for c in checks if c[2] in held]

        def q(v: list[float], p: int) -> float:
            return pct(v, p) if v else float("nan")

        return {
            "checks": len(checks), "read_to_write_p50_us": q(us_all, 50),
            "read_to_write_p90_us": q(us_all, 90), "to_engine_p50_us": q(eng, 50),
            "outside_door_p50_us": q([held[r] - u for _, u, r in checks if r in held], 50),
            "sent_to_read_p50_us": q([(w - sent[r]) * 1e6 for w, _, r in checks], 50),
            "burst_sizes": dict(sorted(sizes.items())),
            "in_bursts": sum(n * k for k, n in sizes.items() if k > 1),
            "by_position": {k: {"n": len(v), "read_to_write_p50_us": q([u for u, _, _ in v], 50),
                                "sent_to_read_p50_us": q([r for _, _, r in v], 50),
                                "to_engine_p50_us": q([e for _, e, _ in v if e is not None], 50)}
                            for k, v in sorted(by_pos.items())},
            "admitted_checks_joined": len(calls),
            "before_call_p50_us": q([c[0] for c in calls], 50),
            "before_call_p90_us": q([c[0] for c in calls], 90),
            "call_p50_us": q([c[1] for c in calls], 50),
            "call_p90_us": q([c[1] for c in calls], 90),
            "after_call_p50_us": q([c[2] for c in calls], 50),
            "call_sizes": dict(sorted(Counter(c[3] for c in calls).items())),
            "overlap_export": met_export, "overlap_settle_renew": met_store,
            "exports": len(exports), "settles_renews": len(store),
            **_after_split(lines.get("after", []), set(sent), q)}

    def stop(self) -> None:
        for svc in (self.plain, *self.spokes.values()):
            if svc is not None:
                svc.stop()

    def procs(self) -> dict[str, Service]:
        assert self.plain is not None
        out = {f"{PLAIN}.envoy": self.plain}
        for source, spoke in self.spokes.items():
            out |= {f"{source}.{name}": svc for name, svc in spoke.services.items()}
        return out

    def url(self, path: str) -> str:
        assert self.plain is not None
        port = self.plain.port if path == PLAIN else self.spokes[path].listen_port
        return f"http://{LOOP}:{port}"  # closed_loop adds the workload's API path

    def cpu(self) -> dict[str, float]:
        """On-CPU seconds: schedstat (ns) for every process, /proc stat ticks as a fallback."""
        snap = {"client": time.process_time()}
        with open("/proc/stat", "rb") as f:  # busy seconds of CPU 0 and CPU 1, anyone's
            for line in f.read().splitlines()[1:3]:
                cols = [int(x) for x in line.split()[1:8]]
                snap[line.split()[0].decode()] = (sum(cols) - cols[3] - cols[4]) / CLK
        for name, svc in self.procs().items():
            sched, ticks = sched_ns(svc.pid), proc_cpu_s(svc.pid)
            if (cpu := sched[0] / 1e9 if sched else ticks) is not None:
                snap[name] = cpu
        return snap

    async def phase(self, sessions: dict[str, aiohttp.ClientSession], rnd: int, path: str,
                    kind: str, per_worker: int) -> None:
        conc, chunks = PHASES[kind]
        wl = Workload(chunks, TOKENS_PER_S, TTFT_MS + (LONG - chunks) * 1000 / TOKENS_PER_S)
        before, t0 = self.cpu(), time.perf_counter()
        samples = await closed_loop(sessions[path], self.url(path), wl, self.secret, conc,
                                       per_worker, PHASE_TIMEOUT_S)
        wall = time.perf_counter() - t0
        if rnd >= 0 or not self.args.quick:  # --quick: the warm-up settles once, at its end
            await asyncio.sleep(QUICK_SETTLE_S if self.args.quick else SETTLE_S)
        after, span = self.cpu(), time.perf_counter() - t0
        for s in samples:
            if s.request_id:  # an answer other than 200 is not metered: its id is kept apart
                (self.sent[path] if s.status == 200 else self.refused)[s.request_id] = chunks
            if p := s.problem(chunks):
                self.problems[f"{path}: {p.split(':')[0]}"] += 1
                if len(self.problem_sample) < 5:
                    self.problem_sample.append(f"{path} {kind} round {rnd}: {p}")
        if rnd >= 0:
            cpu = {k: after[k] - v for k, v in before.items() if k in after}
            self.phases.append(Phase(rnd, path, kind, wall, span, cpu, samples))

    async def measure(self) -> None:
        a = self.args
        sessions = {p: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=30.0)) for p in self.paths}
        try:
            for path in self.paths:  # warm-up: connections, gRPC streams, Kafka producers, Lua
                for kind in PHASES:
                    await self.phase(sessions, -1, path, kind, 1)
            if a.quick:
                await asyncio.sleep(QUICK_SETTLE_S)
            before, t0 = self.cpu(), time.perf_counter()
            await asyncio.sleep(a.idle_s)
            after, wall = self.cpu(), time.perf_counter() - t0
            self.idle = {k: (after[k] - v) / wall * 1e6 for k, v in before.items() if k in after}
            for rnd in range(a.rounds):
                order = self.paths if rnd % 2 == 0 else self.paths[::-1]
                for kind in PHASES:
                    per = a.per_worker_c32 if kind == "c32x64" else a.per_worker_c8
                    for path in order:
                        await self.phase(sessions, rnd, path, kind, per)
                print(f"  round {rnd} ({' '.join(order)}): " + "; ".join(
                    f"{p.path} {p.kind} {len(p.samples) / p.wall_s:.0f} req/s"
                    for p in self.phases[-len(self.paths):]), flush=True)
        finally:
            for s in sessions.values():
                await s.close()

    def row(self, path: str) -> dict[str, Any]:
        ph = {k: [p for p in self.phases if p.path == path and p.kind == k] for k in PHASES}
        ours = [k for k in self.phases[0].cpu_s if not k.startswith("cpu")]
        side = [k for k in ours if k == "client" or (
            k.endswith((".engine", ".redis", ".kafka")) and not k.endswith(self.on_gateway))]
        gw_all = [k for k in ours if k.endswith(self.on_gateway)]  # CPU 0's

        def per_req(kind: str, proc: str, idle: float = 0.0) -> float:  # µs
            cpu = sum(p.cpu_s.get(proc, 0.0) - idle / 1e6 * p.span_s for p in ph[kind])
            return cpu / sum(len(p.samples) for p in ph[kind]) * 1e6

        def solve(short: float, long_: float) -> tuple[float, float]:  # per chunk, fixed
            chunk = (long_ - short) / (LONG - SHORT)
            return chunk, short - SHORT * chunk

        def load(kind: str, procs: list[str]) -> float:  # % of one CPU
            return sum(p.cpu_s.get(k, 0.0) for p in ph[kind] for k in procs) / sum(
                p.span_s for p in ph[kind]) * 100

        r: dict[str, Any] = {"path": path, "rounds": len(ph["c8x64"])}
        for part in ("envoy", "sidecar") if path != PLAIN else ("envoy",):
            proc, idle = f"{path}.{part}", self.idle.get(f"{path}.{part}", 0.0)
            short, long_ = per_req("c8x4", proc), per_req("c8x64", proc)
            r[f"{part}_us_per_req_4_64"] = (short, long_)
            r[f"{part}_us_per_chunk"], r[f"{part}_fixed_us"] = solve(short, long_)
            r[f"{part}_idle_subtracted"] = solve(per_req("c8x4", proc, idle),
                                                 per_req("c8x64", proc, idle))
            r[f"{part}_us_per_chunk_rounds"] = [  # each round alone: how noisy it is
                solve(a.cpu_s.get(proc, 0.0) / len(a.samples) * 1e6,
                      b.cpu_s.get(proc, 0.0) / len(b.samples) * 1e6)[0]
                for a, b in zip(ph["c8x4"], ph["c8x64"], strict=False)]
        every = [s for v in ph.values() for p in v for s in p.samples]
        held = self.held.get(path, {})
        to_engine = [held[s.request_id] / 1000 for p in ph["c8x64"] for s in p.samples
                     if s.request_id in held]
        ttft = [[s.ttft_s * 1000 for s in p.samples if s.content_events] for p in ph["c8x64"]]
        c8, c32 = ([s for p in ph[k] for s in p.samples if s.itl_s] for k in ("c8x64", "c32x64"))
        pace = [statistics.fmean(s.itl_s) * 1000 for s in c32]
        gateway = [f"{path}.envoy", f"{path}.sidecar"]
        return r | {
            "requests": {k: sum(len(p.samples) for p in v) for k, v in ph.items()},
            "requests_total": len(every),
            "ok": sum(1 for s in every if s.status == 200 and not s.error),
            "ttft_p50_ms": statistics.median(pct(t, 50) for t in ttft),
            "ttft_p99_ms": pct([x for t in ttft for x in t], 99),
            "ttft_round_p50s_ms": [pct(t, 50) for t in ttft],
            "to_engine_p50_ms": pct(to_engine, 50) if to_engine else None,
            "to_engine_p99_ms": pct(to_engine, 99) if to_engine else None,
            "c8_pace_ms": statistics.fmean(statistics.fmean(s.itl_s) * 1000 for s in c8),
            "c8_reads_per_stream": statistics.fmean(s.reads for s in c8),
            "c8_gateway_cpu_pct": load("c8x64", gateway), "c8_cpu1_pct": load("c8x64", side),
            "c32_rps": len(c32) / sum(p.wall_s for p in ph["c32x64"]),
            "c32_pace_ms": statistics.fmean(pace),
            "c32_ttft_p50_ms": pct([s.ttft_s * 1000 for s in c32], 50),
            "c32_reads_per_stream": statistics.fmean(s.reads for s in c32),
            "c32_gateway_cpu_pct": load("c32x64", gateway), "c32_cpu1_pct": load("c32x64", side),
            "others_cpu_pct": {k: (load(k, ["cpu0"]) - load(k, gw_all),  # (CPU 0, CPU 1)
                                   load(k, ["cpu1"]) - load(k, side)) for k in PHASES},
            "per_phase": [{"round": p.round, "kind": p.kind, "wall_s": p.wall_s,
                           "span_s": p.span_s, "requests": len(p.samples), "cpu_s": {
                               k: v for k, v in p.cpu_s.items() if k.startswith((path, "cpu"))
                               or k in side or k.endswith(".redis")}}
                          for v in ph.values() for p in v],
        }

    def read_access_logs(self) -> None:
        """Per path, request id -> `to_engine_us` from its Envoy's access log (read once the
        Envoys stopped, so flushed): how long Envoy held each request (its filters: the
        Check, the splice) before the engine saw its first byte. Where the TTFT a gateway
        adds is spent, apart from the engine and the client."""
        for path in self.paths:
            svc = self.plain if path == PLAIN else self.spokes[path]["envoy"]
            out = self.held[path] = {}
            if svc is None:
                continue
            with contextlib.suppress(OSError, ValueError):  # a line cut short ends the scan
                for line in svc.log_path.read_text(errors="replace").splitlines():
                    d = orjson.loads(line) if line.startswith("{") else {}
                    if isinstance(d.get("to_engine_us"), int):
                        out[d["request_id"]] = d["to_engine_us"]

    def summary(self) -> list[dict[str, Any]]:
        rows = [self.row(p) for p in self.paths]
        base = rows[0]
        for r in rows:
            r["ttft_added_p50_ms"] = r["ttft_p50_ms"] - base["ttft_p50_ms"]
            r["throughput_x_plain"] = r["c32_rps"] / base["c32_rps"]
            r["pace_x_plain"] = r["c32_pace_ms"] / base["c32_pace_ms"]
            r["envoy_chunk_x_plain"] = r["envoy_us_per_chunk"] / base["envoy_us_per_chunk"]
        return rows


async def check_topic(bootstrap: str, want: dict[str, int], foreign: set[str], refused: set[str],
                      timeout_s: float) -> dict[str, Any]:
    """Every wanted id once, outcome completed, usage_source reported, the right tokens; no
    foreign (plain) id. Refused ids (answered other than 200) found are only counted."""
    counts: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    bad: list[str] = []

    def keep(m: Any) -> bool:
        ev = orjson.loads(m.value or b"{}")
        rid = ev.get("event_id", "")
        src = ev.get("usage_source", "")
        counts[rid] += 1
        sources[src] += 1
        tokens = int((ev.get("usage") or {}).get("completion_tokens", -1))
        if rid in want and (ev.get("outcome") != "completed" or src != "reported"
                            or tokens != want[rid]):
            bad.append(f"{rid}: outcome {ev.get('outcome')}, usage_source {src!r}, "
                       f"completion_tokens {tokens} (want {want[rid]})")
        return True

    await read_topic(bootstrap, keep, lambda: want.keys() <= counts.keys(), timeout=timeout_s)
    missing, plain = want.keys() - counts.keys(), foreign & counts.keys()
    dups = sum(n - 1 for rid, n in counts.items() if rid in want and n > 1)
    return {"requests": len(want), "found": len(want) - len(missing), "missing": len(missing),
            "missing_sample": sorted(missing)[:5], "duplicates": dups, "bad": len(bad),
            "bad_sample": bad[:5], "usage_sources": dict(sources), "on_topic": counts.total(),
            "unknown_ids": len(counts.keys() - want.keys()), "plain_ids": len(plain),
            "refused_ids_on_topic": len(refused & counts.keys()),
            "ok": not missing and not dups and not bad and not plain}


# --------------------------------------------------------------------------- output


COLUMNS = (  # header, row key, format
    ("path", "path", ""), ("req", "requests_total", ""), ("ok", "ok", ""),
    ("envoy fixed µs/req", "envoy_fixed_us", ",.0f"),
    ("envoy µs/chunk", "envoy_us_per_chunk", ".1f"), ("x plain", "envoy_chunk_x_plain", ".2f"),
    ("sidecar fixed µs/req", "sidecar_fixed_us", ",.0f"),
    ("sidecar µs/chunk", "sidecar_us_per_chunk", ".1f"),
    ("TTFT p50", "ttft_p50_ms", ".2f"), ("TTFT p99", "ttft_p99_ms", ".2f"),
    ("+p50 ms", "ttft_added_p50_ms", "+.2f"), ("c32 req/s", "c32_rps", ".0f"),
    ("x plain", "throughput_x_plain", ".3f"), ("pace ms", "c32_pace_ms", ".3f"),
    ("x plain", "pace_x_plain", ".3f"), ("cpu0 %", "c32_gateway_cpu_pct", ".0f"),
    ("cpu1 %", "c32_cpu1_pct", ".0f"))


def render_table(rows: list[dict[str, Any]]) -> str:
    head = tuple(c[0] for c in COLUMNS)
    body = [tuple("-" if r.get(k) is None else format(r[k], f) for _, k, f in COLUMNS)
            for r in rows]
    out = markdown_table(head, body)
    out.append(
        "CPU split (schedstat, c=8, same requests at 4 and 64 chunks): µs/chunk = (cpu64/req - "
        "cpu4/req)/60, fixed = cpu4/req - 4·µs/chunk; TTFT ms at c=8 with 64 chunks (p50 = "
        "median of round p50s, p99 pooled, +p50 = minus plain's); c=32 with 64 chunks: req/s, "
        "pace = mean gap between content events per stream (mean over streams), cpu0 % = the "
        "path's Envoy + sidecar, cpu1 % = client + engines + Redis (unless --redis-with-gateway) "
        "+ Tansu")
    for r in rows:
        for part in ("envoy", "sidecar") if r["path"] != PLAIN else ("envoy",):
            (short, long_), rr = r[f"{part}_us_per_req_4_64"], r[f"{part}_us_per_chunk_rounds"]
            bg_chunk, bg_fixed = r[f"{part}_idle_subtracted"]
            out.append(f"{r['path']} {part}: {short:,.0f} µs/req at 4 chunks, {long_:,.0f} at "
                       f"64; µs/chunk per round {min(rr, default=0):.1f}..{max(rr, default=0):.1f}"
                       f"; idle CPU subtracted: {bg_chunk:.1f} µs/chunk, {bg_fixed:,.0f} fixed")
        out.append(f"{r['path']}: c=8 pace {r['c8_pace_ms']:.3f} ms, "
                   f"{r['c8_reads_per_stream']:.1f} reads/stream, cpu0 "
                   f"{r['c8_gateway_cpu_pct']:.0f} %, cpu1 {r['c8_cpu1_pct']:.0f} %; c=32 "
                   f"{r['c32_reads_per_stream']:.1f} reads/stream, TTFT p50 "
                   f"{r['c32_ttft_p50_ms']:.1f} ms; CPU % not ours (other programs, kernel) on "
                   "CPU 0/1: " + ", ".join(f"{k} {a:.0f}/{b:.0f}"
                                           for k, (a, b) in r["others_cpu_pct"].items()))
        if r["to_engine_p50_ms"] is not None:
            out.append(f"{r['path']}: Envoy held a request before the engine saw it (access "
                       f"log to_engine_us, c=8 x 64): p50 {r['to_engine_p50_ms']:.3f} ms, p99 "
                       f"{r['to_engine_p99_ms']:.3f} ms")
    return "\n".join(out)


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    r = next(x for x in rows if x["path"] == ENVOY)
    out = []
    for key, (what, op, limit, unit) in TARGETS.items():
        v = r[key]
        met = v >= limit if op == ">=" else v <= limit
        out.append(f"target (envoy source) {what} {op} {limit:g} {unit}: "
                   f"{'met' if met else 'NOT met'} ({v:.2f} {unit})")
    return out


def explain(bench: Bench) -> list[str]:
    """What the Envoys' access logs say about the requests that did not answer 200."""
    out = []
    for name, svc in bench.procs().items() if bench.refused else ():
        with contextlib.suppress(OSError, ValueError):  # a log cut mid-line ends the scan
            for line in svc.log_path.read_text(errors="replace").splitlines():
                d = orjson.loads(line) if line.startswith("{") else {}
                if d.get("request_id") in bench.refused:
                    out.append(f"{name} log: {d['request_id']} status {d.get('status')} flags "
                               f"{d.get('flags')} details {d.get('details')} duration_ms "
                               f"{d.get('duration_ms')} ext_authz_duration "
                               f"{(d.get('authz') or {}).get('ext_authz_duration')}")
    return out


def report(bench: Bench, checks: dict[str, dict[str, Any]], logs: dict[str, dict[str, Any]],
           ) -> bool:
    bad = sum(bench.problems.values())
    total = sum(map(len, bench.sent.values())) + len(bench.refused)
    print(f"requests: {total} (warm-up included), errors/bad answers: {bad}"
          + (f" {dict(bench.problems)}, e.g.\n  " + "\n  ".join(bench.problem_sample)
             if bad else ""))
    if bench.args.quick:
        # The smoke run judges the harness, not the machine: on a slow or busy one the
        # ext_proc path at c=32 can saturate its core, and Envoy gives up on a Check
        # (fail-closed 503). A few of those pass; anything else still fails the run.
        overload = sum(v for k, v in bench.problems.items() if k.endswith(": status 503"))
        if overload and overload <= max(2, total // 50):
            print(f"quick mode: {overload} fail-closed 503s (an overloaded machine) tolerated")
            bad -= overload
    ok = not bad and len(checks) == len(bench.spokes)
    for source, c in checks.items():
        lg = logs.get(source) or {}
        ok = ok and c["ok"] and not lg.get("tracebacks")
        print(f"Kafka read-back ({source}): {'OK' if c['ok'] else 'FAILED'}: {c['found']}/"
              f"{c['requests']} request ids found, {c['duplicates']} duplicates, {c['bad']} bad"
              f" {c['bad_sample'][:2]}, usage_source {c['usage_sources']}, {c['plain_ids']} "
              f"plain ids, {c['refused_ids_on_topic']} of the refused requests' ids"
              + (f", missing e.g. {c['missing_sample'][:3]}" if c["missing"] else ""))
        if lg.get("tracebacks") or lg.get("error_lines"):
            print(f"sidecar log ({source}): {lg['tracebacks']} tracebacks, {lg['error_lines']} "
                  f"error lines; first:\n{lg['first_traceback'][:1500] or lg['error_sample']}")
    return ok


def _after_split(after: list[list[str]], ids: set[str], q: Any) -> dict[str, Any]:
    """With GATEWAY_BENCH_DOOR_AFTER=1 (benchmarks/door_timing: `after` lines): the c8x64
    Checks' time from their admission call's reply to their answer written, p50 µs of each
    part, for the first Check a call answers and for the others (its 2nd, 3rd, ...), and
    how often the sidecar was off CPU (preempted) in that window."""
    rows = [(int(r[3]), [float(v) for v in r[4:]]) for r in after if r[0] in ids]
    if not rows:
        return {}
    parts = ("read_to_call_resumes", "call_resumes_to_check_resumes", "check_resumes_to_write",
             "encode", "write", "call_resumes_to_written", "off_cpu_window", "off_cpu_write")

    def split(sel: list[list[float]]) -> dict[str, Any]:
        return {"n": len(sel), **{k: q([v[i] for v in sel], 50) for i, k in enumerate(parts)},
                "off_cpu_over_20us": sum(v[6] > 20 for v in sel),
                "preempted_in_write": sum(v[7] > 20 for v in sel)}

    return {"after_split": {"first": split([v for pos, v in rows if pos == 1]),
                            "later": split([v for pos, v in rows if pos > 1]),
                            "by_position_written_p50_us": {
                                p: q([v[5] for pos, v in rows if min(pos, 8) == p], 50)
                                for p in sorted({min(pos, 8) for pos, _ in rows})}}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test, well under 90 s")
    parser.add_argument("--out", default=str(HERE / "results" / "sources.json"))
    parser.add_argument("--rounds", type=int, default=None, help="quick 1, full 8")
    parser.add_argument("--per-worker-c8", type=int, default=None,
                        help="requests per client per path per round at c=8 (quick 3, full 20)")
    parser.add_argument("--per-worker-c32", type=int, default=None,
                        help="requests per client per path per round at c=32 (quick 1, full 8)")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--grpc-check", action="store_true",
                        help=f"also the envoy source with ext_authz's gRPC Check instead of "
                             f"the sidecar's HTTP door (path {ENVOY_GRPC})")
    parser.add_argument("--no-limits", dest="no_limits", action="store_true",
                        help="the key, its team and the model carry no limits: no admission in "
                             "Redis (default: limits too high to trip on all three tiers)")
    parser.add_argument("--admit-ahead-ms", type=float, default=0.0,
                        help="every spoke's GATEWAY_ADMIT_AHEAD_MS (docs/admit-ahead.md)")
    envoy_flags(parser)
    parser.add_argument("--redis-with-gateway", action="store_true",
                        help="pin both spokes' Redis to CPU 0 with the Envoys and sidecars "
                             "(default: CPU 1, with the client, the engines and Tansu)")
    parser.add_argument("--door-times", action="store_true",
                        help="the envoy spoke's sidecar logs each Check's time in it "
                             "(benchmarks/door_timing; see the docstring)")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 8)
    args.per_worker_c8 = args.per_worker_c8 or (3 if args.quick else 20)
    args.per_worker_c32 = args.per_worker_c32 or (1 if args.quick else 8)
    args.idle_s = 0.2 if args.quick else 3.0
    admission = ("none (--no-limits)" if args.no_limits
                 else "three tiers, limits too high to trip")

    import uvloop

    started, loadavg_start = time.time(), os.getloadavg()
    bench = Bench(args)
    redis_cpu = (GATEWAY_CPU if args.redis_with_gateway else OTHER_CPU) if bench.pinned else None
    redis_at = f"Redis on CPU {redis_cpu}" if bench.pinned else "not pinned"
    checks: dict[str, dict[str, Any]] = {}
    logs: dict[str, dict[str, Any]] = {}
    try:
        bench.start()
        print(f"up: {', '.join(f'{p} {bench.url(p)}' for p in bench.paths)}; "
              f"pinned={bench.pinned}; {args.rounds} rounds; admission: {admission}; "
              f"admit-ahead {args.admit_ahead_ms:g} ms; records flushed every "
              f"{args.records_flush_ms:g} ms; {args.envoy_workers} Envoy worker(s) each; "
              f"{redis_at}", flush=True)
        uvloop.run(bench.measure())

        async def read_backs() -> list[dict[str, Any]]:  # each spoke's topic, at once
            return await asyncio.gather(*(
                check_topic(spoke.kafka_bootstrap, bench.sent[source], set(bench.sent[PLAIN]),
                            set(bench.refused), 30.0) for source, spoke in bench.spokes.items()))

        checks = dict(zip(bench.spokes, uvloop.run(read_backs()), strict=True))
        for source, spoke in bench.spokes.items():
            logs[source] = scan_log(spoke["sidecar"].log_path, 0)
        bench.problem_sample += explain(bench)[:10]
    finally:
        bench.stop()
        bench.read_access_logs()
        door = bench.door_times() if args.door_times else {}
        if args.keep_workdir:
            print(f"workdir kept: {bench.workdir}")
        else:
            shutil.rmtree(bench.workdir, ignore_errors=True)

    rows = bench.summary()
    print(f"\nadmission: {admission}; admit-ahead {args.admit_ahead_ms:g} ms; records flushed "
          f"every {args.records_flush_ms:g} ms; {args.envoy_workers} Envoy worker(s) each; "
          f"{redis_at}\n"
          + render_table(rows))
    print("\n".join(target_lines(rows)))
    if door:
        print("door times (envoy path, c8x64, inside the sidecar):", json.dumps(door))
    ok = report(bench, checks, logs)
    print(f"checks: {'passed' if ok else 'FAILED'}; {time.time() - started:.0f} s")
    doc = {
        "bench": "sources", "mode": "quick" if args.quick else "full",
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "duration_s": time.time() - started, "checks_passed": ok,
        "admission": admission, "spoke_admit_ahead_ms": args.admit_ahead_ms,
        "spoke_records_flush_ms": args.records_flush_ms, "envoy_workers": args.envoy_workers,
        "redis_cpu": redis_cpu,
        "workload": {"ttft_ms": TTFT_MS, "tokens_per_s": TOKENS_PER_S,
                     "phases": {k: {"concurrency": int(c), "chunks": n}
                                for k, (c, n) in PHASES.items()},
                     "per_worker_c8": args.per_worker_c8, "per_worker_c32": args.per_worker_c32},
        "rounds": args.rounds, "targets": TARGETS, "rows": rows, "idle_us_per_s": bench.idle,
        "errors": bench.problems, "error_sample": bench.problem_sample,
        "kafka_check": checks, "sidecar_log": logs, "door_times": door,
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                    "platform": platform.platform(), "pinned": bench.pinned,
                    "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg()},
        "git": git_state(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
