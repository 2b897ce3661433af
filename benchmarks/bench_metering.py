"""What metering costs a streaming client: TTFT and inter-token latency through Envoy with
the sidecar (ext_authz + ext_proc FULL_DUPLEX_STREAMED, spool, Kafka) vs plain Envoy.

    .venv/bin/python benchmarks/bench_metering.py [--quick] [--out benchmarks/results/metering.json]
        [--baseline REV]

Two paths to one mock engine, measured in one run:
* `metered`: the whole spoke (devspoke.stack.Spoke: Redis, Tansu, mock engine, sidecar,
  Envoy from gateway.envoyconf.bootstrap.render);
* `plain`: a second Envoy rendered from the same config with the ext_authz and ext_proc
  http_filters deleted;
* with --baseline REV, a third, `baseline`: a whole second spoke (its own Redis, Tansu and
  mock engine) whose sidecar and Envoy bootstrap come from git revision REV (common.
  baseline_tree: `git archive` of REV; the sidecar runs with PYTHONPATH=that tree, and the
  bootstrap is printed by that tree's own `gateway envoy-config`), in the same rounds; the
  table adds current/baseline ratios ("ratio m/b"). A baseline without the Messages API
  (no "/v1/messages" in its gateway/endpoints.py) runs the chat phases only.

Workload: streaming chat completions (`api` chat), max_tokens 64 (--quick 12), the engine paced
per request by x-mock-ttft-ms (50) and x-mock-tokens-per-s (200), closed loop, in three scenarios:
`1` (one client), `16` (16 clients that start together, so requests arrive in waves of 16:
the worst case for a single-threaded sidecar) and `16s` (16 clients whose starts are spread
over one request's duration, so arrivals are spread out). The same through Anthropic's
Messages API (`api` messages: POST /v1/messages, x-api-key, the same prompt and max_tokens)
as further phases of the same rounds, in the `16` scenario only by default
(--messages-concurrency). Rounds alternate the order of the paths (A B, B A, ...) after a
warm-up of each. A content event is a chat chunk with delta content, or a
content_block_delta with text. The client (aiohttp on uvloop, in this
process) timestamps every read of the response body and splits it into SSE events:
TTFT = first event with delta content - request sent; ITL = the gaps between successive
content events; `hdr` = response headers received - request sent.

Table: p50 = median over rounds of each round's p50; p99 = over all rounds' samples pooled
(a round has too few TTFTs for its own p99). Ratios are metered / plain of those numbers.
CPU: utime+stime from /proc/<pid>/stat over the phases of each path (the snapshot is taken
after 0.2 s of settling so the shipper's Kafka sends are included), per SSE event the client
received (the sidecar also sees one more per request: the usage chunk it hides) and per
request. To split the sidecar's CPU into per-request and per-chunk parts, each scenario is
also run once through the metered path with max_tokens 1 (schedstat, ns resolution); and
the sidecar's own Python per chunk (RequestStream.handle with protobuf parse/serialize, no
gRPC) is timed in-process on the engine's real SSE bytes.

Checks: every request must answer 200 with 64 content events and its end marker ([DONE]
and no usage chunk, which the client did not ask for; message_stop for Messages streams),
and every metered request's x-request-id must be on the Kafka topic exactly once (read back
at the end), completed, with completion tokens equal to the content events its client
received (the baseline's on its own topic, likewise); the sidecar log is scanned for
tracebacks.

CPU placement (2+ CPUs, unless --no-pin): the gateway (the Envoys and the sidecars) on CPU 0;
the client, mock engines, Redis and Tansu (what would be elsewhere in production) on CPU 1.
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
import urllib.request
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from common import (
    Baseline,
    baseline_tree,
    git_state,
    markdown_table,
    pin,
    proc_cpu_s,
    scan_log,
    sched_ns,
)
from streaming import Api, Sample, Workload, closed_loop, pct, serve_one_key

from devspoke.procs import Service, free_port
from devspoke.stack import Spoke
from devspoke.usage_topic import read_topic
from gateway.envoyconf.bootstrap import EnvoyPorts
from gateway.policy import secrets
from testkit.envoys import WITHOUT_GATEWAY, envoy_without

HERE = Path(__file__).resolve().parent
LOOP = "127.0.0.1"
METERED, PLAIN, BASELINE = "metered", "plain", "baseline"
SIDECAR = {METERED: "sidecar", BASELINE: "baseline.sidecar"}  # the processes, per path
ENVOY = {METERED: "envoy", PLAIN: "envoy-plain", BASELINE: "baseline.envoy"}
APIS: tuple[Api, ...] = ("chat", "messages")
GATEWAY_CPU, OTHER_CPU = 0, 1
TARGET_RATIO = 1.02
REQUEST_TIMEOUT_S = 30.0


async def read_back(bootstrap: str, metered: dict[str, int], plain: set[str], timeout_s: float,
                    ) -> dict[str, Any]:
    """Every metered request id (-> the content events its client received) on the topic
    exactly once, completed, with as many completion tokens; no plain request id at all."""
    counts: dict[str, int] = {}
    bad: list[str] = []

    def keep(m: Any) -> bool:
        ev = orjson.loads(m.value or b"{}")
        rid = ev.get("event_id", "")
        counts[rid] = counts.get(rid, 0) + 1
        if rid in metered and (ev.get("outcome") != "completed" or int(
                (ev.get("usage") or {}).get("completion_tokens", 0)) != metered[rid]):
            bad.append(f"{rid}: {ev.get('outcome')} {ev.get('usage')}, client saw "
                       f"{metered[rid]} content events")
        return True

    await read_topic(bootstrap, keep, lambda: metered.keys() <= counts.keys(),
                     timeout=timeout_s)
    missing = metered.keys() - counts.keys()
    dups = sum(n - 1 for rid, n in counts.items() if rid in metered and n > 1)
    return {"metered_requests": len(metered), "events_found": len(metered) - len(missing),
            "missing": len(missing), "missing_sample": sorted(missing)[:5],
            "duplicates": dups, "plain_ids_metered": len(plain & counts.keys()),
            "bad_events": len(bad), "bad_sample": bad[:5], "events_on_topic": sum(counts.values()),
            "ok": bool(metered) and not missing and not dups and not bad
            and not plain & counts.keys()}


def engine_chunks(engine_url: str, wl: Workload) -> list[bytes]:
    """The SSE events the engine writes for one metered request (include_usage injected)."""
    doc = orjson.loads(wl.body())
    doc["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(f"{engine_url}{wl.path}", data=orjson.dumps(doc),
                                 headers={**wl.headers(""), "x-mock-ttft-ms": "0",
                                          "x-mock-tokens-per-s": "0"})
    with urllib.request.urlopen(req, timeout=10) as r:
        raw = r.read()
    return [ev + b"\n\n" for ev in raw.split(b"\n\n") if ev.strip()]


def inprocess_chunk_cost(chunks: list[bytes], repeats: int = 200) -> dict[str, float]:
    """The sidecar's own Python per response-body chunk, without gRPC: parse the
    ProcessingRequest, RequestStream.handle (SSE decode, meter, hide the usage chunk, echo),
    serialize the answer; then what it bills (billing.settle). Median over `repeats` streams."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from gateway.metering.billing import settle
    from gateway.metering.handoff import RequestFacts
    from gateway.metering.meter import Injected, Meter
    from gateway.server.extproc_service import RequestStream

    wire = [ep.ProcessingRequest(response_body=ep.HttpBody(
        body=c, end_of_stream=i == len(chunks) - 1)).SerializeToString()
        for i, c in enumerate(chunks)]
    endpoint = "/v1/chat/completions"
    per: list[float] = []
    out_bytes = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        rs = RequestStream()
        rs.facts = RequestFacts(request_id="r", key_id="k", model="mock-model",
                                endpoint=endpoint, stream=True)
        rs.meter = Meter(endpoint=endpoint, stream=True, injected=Injected(include_usage=True))
        rs.meter.response_headers(200, "text/event-stream")
        out_bytes = 0
        for w in wire:
            out_bytes += len(rs.handle(ep.ProcessingRequest.FromString(w)).SerializeToString())
        settle(rs.facts, rs.response())
        per.append((time.perf_counter() - t0) / len(wire) * 1e6)
    return {"us_per_chunk": statistics.median(per), "us_per_chunk_min": min(per),
            "chunks_per_stream": len(wire),
            "usage_hidden": rs.meter.reported is not None and out_bytes > 0}


# --------------------------------------------------------------------------- stats


def phase_stats(samples: list[Sample]) -> dict[str, Any]:
    ok = [s for s in samples if s.status == 200 and not s.error]
    ttft = [s.ttft_s * 1000 for s in ok if s.content_events]
    itl = [g * 1000 for s in ok for g in s.itl_s]
    hdr = [s.hdr_s * 1000 for s in ok]
    return {
        "requests": len(samples), "ok": len(ok),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
        "itl_mean_ms": statistics.fmean(itl) if itl else float("nan"),
        "hdr_p50_ms": pct(hdr, 50),
        "events": sum(s.events for s in samples), "reads": sum(s.reads for s in samples),
        "content_events": sum(s.content_events for s in samples),
    }


# --------------------------------------------------------------------------- the run


@dataclass
class Phase:
    round: int
    path: str
    concurrency: str  # scenario label: clients, 's' = staggered
    api: Api
    wall_s: float
    stats: dict[str, Any]
    cpu_s: dict[str, float]
    samples: list[Sample]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.wl = Workload(args.max_tokens, args.tokens_per_s, args.ttft_ms)
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-metering-"))
        self.spoke: Spoke | None = None
        self.plain: Service | None = None
        self.base_spoke: Spoke | None = None
        self.baseline: Baseline | None = None
        self.baseline_messages = False  # the baseline revision serves /v1/messages
        self.secret = secrets.new_secret("bench")
        cpus = os.sched_getaffinity(0)
        self.pinned = not args.no_pin and {GATEWAY_CPU, OTHER_CPU} <= cpus
        self.phases: list[Phase] = []
        self.fixed: list[Phase] = []  # max_tokens 1: the per-request part of the sidecar's CPU
        self.problems: dict[str, int] = {}
        self.problem_sample: list[str] = []
        self.log_start: dict[str, int] = {}

    @property
    def paths(self) -> tuple[str, ...]:
        return (METERED, PLAIN, BASELINE) if self.args.baseline else (METERED, PLAIN)

    def apis(self, conc: str) -> tuple[Api, ...]:
        return APIS if conc in self.args.messages_concurrency else ("chat",)

    def paths_for(self, api: Api) -> tuple[str, ...]:
        if api == "messages" and not self.baseline_messages:
            return tuple(p for p in self.paths if p != BASELINE)
        return self.paths

    def workload(self, api: Api) -> Workload:
        return self.wl if api == "chat" else replace(self.wl, api=api)

    # -- setup / teardown

    def start(self) -> None:
        env = dict(kv.split("=", 1) for kv in self.args.sidecar_env)
        self.spoke = Spoke(workdir=self.workdir / "spoke", listen_port=free_port(),
                           sidecar_env=env, metering="ext_proc")  # this harness: ext_proc's cost
        self.spoke.start()
        serve_one_key(self.spoke, self.secret, self.wl.model)
        self.plain = envoy_without(WITHOUT_GATEWAY, self.spoke["sidecar"].address,
                                   self.spoke["engine"].address, self.workdir / "spoke",
                                   "envoy-plain").start()
        if self.args.baseline:
            self.start_baseline(env)
        if self.pinned:
            os.sched_setaffinity(0, {OTHER_CPU})
            for name, svc in self.procs().items():
                pin(svc.pid, {GATEWAY_CPU} if name in (*SIDECAR.values(), *ENVOY.values())
                    else {OTHER_CPU})
        for name in SIDECAR.values():
            with contextlib.suppress(OSError, KeyError, AssertionError):
                self.log_start[name] = self.procs()[name].log_path.stat().st_size

    def start_baseline(self, env: dict[str, str]) -> None:
        """A whole second spoke whose sidecar and Envoy bootstrap are the baseline's code."""
        base = self.baseline = baseline_tree(self.args.baseline, self.workdir / "baseline-tree")
        endpoints = base.tree / "gateway" / "endpoints.py"
        self.baseline_messages = endpoints.exists() and '"/v1/messages"' in endpoints.read_text()

        def render(ports: EnvoyPorts, metering: str) -> str:
            # the baseline's own render, through its CLI (the flags it has at 2b80943)
            return base.gateway("envoy-config", "--listen", ports.listen, "--sidecar",
                                ports.sidecar, "--engine", ports.engine, "--admin", ports.admin,
                                "--metering", metering)

        self.base_spoke = Spoke(workdir=self.workdir / "baseline", listen_port=free_port(),
                                sidecar_env={**env, **base.env}, metering="ext_proc",
                                envoy_config=render)
        self.base_spoke.start()
        serve_one_key(self.base_spoke, self.secret, self.wl.model)
        print(f"baseline {base.rev} = {base.describe} (Messages API: "
              f"{'yes' if self.baseline_messages else 'no, chat phases only'})", flush=True)

    def stop(self) -> None:
        if self.base_spoke is not None:
            self.base_spoke.stop()
        if self.plain is not None:
            self.plain.stop()
        if self.spoke is not None:
            self.spoke.stop()

    def procs(self) -> dict[str, Service]:
        assert self.spoke is not None and self.plain is not None
        base = ({f"baseline.{k}": v for k, v in self.base_spoke.services.items()}
                if self.base_spoke is not None else {})
        return {**self.spoke.services, "envoy-plain": self.plain, **base}

    def url(self, path: str) -> str:
        """Scheme, host and port of a path's Envoy (closed_loop adds the API's path)."""
        assert self.spoke is not None and self.plain is not None
        port = {METERED: self.spoke.listen_port, PLAIN: self.plain.port,
                BASELINE: self.base_spoke.listen_port if self.base_spoke else 0}[path]
        return f"http://{LOOP}:{port}"

    def cpu(self) -> dict[str, float | None]:
        procs = self.procs()
        snap = {name: proc_cpu_s(svc.pid) for name, svc in procs.items()}
        snap["client"] = time.process_time()
        for name in (*SIDECAR.values(), *ENVOY.values()):
            sched = sched_ns(procs[name].pid) if name in procs else None
            if sched is not None:
                snap[f"{name}.sched_run"] = sched[0] / 1e9
                snap[f"{name}.sched_wait"] = sched[1] / 1e9
                snap[f"{name}.sched_wait_main"] = sched[2] / 1e9
        return snap

    # -- measuring

    async def run_phase(self, sessions: dict[str, aiohttp.ClientSession], rnd: int, path: str,
                        conc: str, per_worker: int, wl: Workload, record: bool = True,
                        fixed: bool = False, settle: bool = True) -> None:
        before, t0 = self.cpu(), time.perf_counter()
        samples = await closed_loop(sessions[path], self.url(path), wl, self.secret, conc,
                                    per_worker, self.args.phase_timeout)
        wall = time.perf_counter() - t0
        if settle:  # let the sidecar's shipper send this phase's events (--quick: less)
            await asyncio.sleep(0.05 if self.args.quick else 0.2)
        after = self.cpu()
        for s in samples:
            p = s.problem(wl.max_tokens)
            if p:
                key = f"{path} {wl.api}: {p.split(':')[0]}"
                self.problems[key] = self.problems.get(key, 0) + 1
                if len(self.problem_sample) < 5:
                    self.problem_sample.append(f"{path} {wl.api} c={conc}: {p}")
        if not record:
            return
        cpu = {k: a - b for k, b in before.items()
               if (a := after.get(k)) is not None and b is not None}
        phase = Phase(rnd, path, conc, wl.api, wall, phase_stats(samples), cpu, samples)
        (self.fixed if fixed else self.phases).append(phase)

    async def measure(self) -> None:
        a = self.args
        conn = {p: aiohttp.TCPConnector(limit=0, force_close=False) for p in self.paths}
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        sessions = {p: aiohttp.ClientSession(connector=conn[p], timeout=timeout,
                                             auto_decompress=False) for p in self.paths}
        try:
            for path in self.paths:  # warm-up: connections, pools, gRPC streams, Kafka producer
                for conc in a.concurrency:
                    for api in self.apis(conc):
                        if path in self.paths_for(api):
                            # --quick: the warm-up settles once, at its end
                            await self.run_phase(sessions, -1, path, conc, 1,
                                                 self.workload(api), record=False,
                                                 settle=not a.quick)
            if a.quick:
                await asyncio.sleep(0.05)
            for rnd in range(a.rounds):
                for conc in a.concurrency:
                    for api in self.apis(conc):
                        paths = self.paths_for(api)
                        for path in paths if rnd % 2 == 0 else paths[::-1]:
                            per = a.requests_c1 if conc == "1" else a.waves
                            await self.run_phase(sessions, rnd, path, conc, per,
                                                 self.workload(api))
                        last = self.phases[-len(paths):]
                        print(f"  round {rnd} c={conc} {api}: " + "; ".join(
                            f"{p.path} ttft p50 {p.stats['ttft_p50_ms']:.2f} ms, "
                            f"itl p50 {p.stats['itl_p50_ms']:.2f} p99 "
                            f"{p.stats['itl_p99_ms']:.2f} ms" for p in last), flush=True)
            # the sidecar paths with max_tokens 1 (4 SSE events): the sidecar's CPU per
            # request apart from the chunks, so that the per-chunk part can be told apart
            one = Workload(1, self.wl.tokens_per_s, self.wl.ttft_ms, self.wl.model)
            for conc in a.concurrency:
                per = a.requests_c1 if conc == "1" else a.waves
                for path in (p for p in self.paths if p in SIDECAR):
                    await self.run_phase(sessions, 0, path, conc, 1, one, record=False)
                    await self.run_phase(sessions, 0, path, conc, per, one, fixed=True)
        finally:
            for s in sessions.values():
                await s.close()

    def request_ids(self, path: str) -> dict[str, int]:
        """A path's request ids -> the content events their clients received."""
        return {s.request_id: s.content_events for p in self.phases if p.path == path
                for s in p.samples if s.request_id}

    # -- results

    def summary(self) -> list[dict[str, Any]]:
        rows = []
        for conc in self.args.concurrency:
            for api in self.apis(conc):
                for path in self.paths_for(api):
                    ph = [p for p in self.phases
                          if p.path == path and p.concurrency == conc and p.api == api]
                    if ph:
                        rows.append(self.row(path, conc, api, ph))
        return rows

    def row(self, path: str, conc: str, api: Api, ph: list[Phase]) -> dict[str, Any]:
        pooled = phase_stats([s for p in ph for s in p.samples])
        med = {k: statistics.median(p.stats[k] for p in ph)
               for k in ("ttft_p50_ms", "itl_p50_ms", "hdr_p50_ms", "itl_mean_ms")}
        events = sum(p.stats["events"] for p in ph)
        requests = sum(p.stats["requests"] for p in ph)
        cpu: dict[str, float] = {}
        for p in ph:
            for k, v in p.cpu_s.items():
                cpu[k] = cpu.get(k, 0.0) + v
        wall = sum(p.wall_s for p in ph)
        marginal = None
        fx = [p for p in self.fixed if p.path == path and p.concurrency == conc]
        run_key = f"{SIDECAR.get(path)}.sched_run"
        if api == "chat" and fx and run_key in cpu:
            f_req = sum(p.stats["requests"] for p in fx)
            f_ev = sum(p.stats["events"] for p in fx)
            f_run = sum(p.cpu_s.get(run_key, 0.0) for p in fx)
            per_req, f_per_req = cpu[run_key] / requests, f_run / f_req
            ev_diff = events / requests - f_ev / f_req
            marginal = {
                "requests_max_tokens_1": f_req,
                "sidecar_us_per_request_max_tokens_1": f_per_req * 1e6,
                "sidecar_us_per_request": per_req * 1e6,
                "sidecar_us_per_extra_event": (per_req - f_per_req) / ev_diff * 1e6
                if ev_diff > 0 else float("nan"),
            }
        return {
            "path": path, "concurrency": conc, "api": api, "rounds": len(ph),
            "sidecar_split": marginal,
            "requests": requests, "ok": pooled["ok"], "events": events,
            "reads": sum(p.stats["reads"] for p in ph),
            "ttft_p50_ms": med["ttft_p50_ms"], "ttft_p99_ms": pooled["ttft_p99_ms"],
            "itl_p50_ms": med["itl_p50_ms"], "itl_p99_ms": pooled["itl_p99_ms"],
            "itl_mean_ms": med["itl_mean_ms"], "hdr_p50_ms": med["hdr_p50_ms"],
            "pooled": pooled, "wall_s": wall, "cpu_s": cpu,
            "cpu_pct": {k: v / wall * 100 for k, v in cpu.items()},
            "cpu_us_per_event": {k: v / events * 1e6 for k, v in cpu.items()},
            "cpu_us_per_request": {k: v / requests * 1e6 for k, v in cpu.items()},
            "per_round": [{"round": p.round, **p.stats, "cpu_s": p.cpu_s} for p in ph],
        }

    def ratios(self, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per scenario and API ("c16 messages"): metered / plain, and metered / baseline
        (under "vs_baseline", with the sidecar's CPU per event and per request too)."""
        out: dict[str, dict[str, Any]] = {}
        for conc in self.args.concurrency:
            for api in self.apis(conc):
                by = {r["path"]: r for r in rows if r["concurrency"] == conc and r["api"] == api}
                if METERED not in by or PLAIN not in by:
                    continue
                d = pair_ratios(by[METERED], by[PLAIN])
                if BASELINE in by:
                    m, b = by[METERED], by[BASELINE]
                    vb = pair_ratios(m, b)
                    for per in ("cpu_us_per_event", "cpu_us_per_request"):
                        mine, theirs = m[per].get("sidecar"), b[per].get("baseline.sidecar")
                        vb[f"sidecar_{per}"] = mine / theirs if mine and theirs else float("nan")
                    d["vs_baseline"] = vb
                out[f"c{conc} {api}"] = d
        return out


def pair_ratios(m: dict[str, Any], p: dict[str, Any]) -> dict[str, Any]:
    """Row m / row p: the latencies' ratios and differences, and per-round ratios of p50s."""
    d: dict[str, Any] = {}
    for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_mean_ms",
              "hdr_p50_ms"):
        d[k] = m[k] / p[k] if p[k] else float("nan")
        d[k.replace("_ms", "_delta_ms")] = m[k] - p[k]
    # per-round ratios of p50s (same round: the fairest pairs on a noisy machine)
    pairs = {}
    for r in m["per_round"]:
        q = next((x for x in p["per_round"] if x["round"] == r["round"]), None)
        if q:
            pairs[r["round"]] = (r, q)
    for k in ("ttft_p50_ms", "itl_p50_ms"):
        d[f"{k}_round_ratios"] = [a[k] / b[k] for a, b in pairs.values() if b[k]]
    return d


# --------------------------------------------------------------------------- output


def render_table(rows: list[dict[str, Any]], ratios: dict[str, dict[str, Any]]) -> str:
    head = ("path", "c", "api", "req", "ok", "hdr p50", "TTFT p50", "TTFT p99", "ITL p50",
            "ITL p99", "ITL mean", "sidecar µs/ev", "sidecar µs/req", "sidecar cpu%",
            "loop runq ms/req", "envoy µs/ev", "envoy cpu%")
    body: list[tuple[str, ...]] = []
    for r in rows:
        sc, envoy = SIDECAR.get(r["path"]), ENVOY[r["path"]]
        per_ev, per_req, pct_ = r["cpu_us_per_event"], r["cpu_us_per_request"], r["cpu_pct"]
        body.append((
            r["path"], str(r["concurrency"]), r["api"], str(r["requests"]), str(r["ok"]),
            f"{r['hdr_p50_ms']:.2f}", f"{r['ttft_p50_ms']:.2f}", f"{r['ttft_p99_ms']:.2f}",
            f"{r['itl_p50_ms']:.3f}", f"{r['itl_p99_ms']:.2f}", f"{r['itl_mean_ms']:.3f}",
            f"{per_ev.get(sc, 0.0):.0f}" if sc else "-",
            f"{per_req.get(sc, 0.0):,.0f}" if sc else "-",
            f"{pct_.get(sc, 0.0):.0f}" if sc else "-",
            f"{per_req.get(f'{sc}.sched_wait_main', 0.0) / 1000:.2f}" if sc else "-",
            f"{per_ev.get(envoy, 0.0):.0f}", f"{pct_.get(envoy, 0.0):.0f}"))
    for key, d in ratios.items():
        conc, api = key[1:].split(" ")
        for label, x in (("ratio m/p", d), ("ratio m/b", d.get("vs_baseline"))):
            if x is None:
                continue
            side = (f"{x['sidecar_cpu_us_per_event']:.3f}", f"{x['sidecar_cpu_us_per_request']:.3f}"
                    ) if "sidecar_cpu_us_per_event" in x else ("", "")
            body.append((
                label, conc, api, "", "", f"{x['hdr_p50_ms']:.3f}", f"{x['ttft_p50_ms']:.3f}",
                f"{x['ttft_p99_ms']:.3f}", f"{x['itl_p50_ms']:.3f}", f"{x['itl_p99_ms']:.3f}",
                f"{x['itl_mean_ms']:.3f}", *side, "", "", "", ""))
    out = markdown_table(head, body)
    out.append("times in ms; p50 = median of per-round p50s, p99 = pooled over rounds; "
               "µs/ev, µs/req = CPU (/proc stat) per SSE event received by the client and per "
               "request; loop runq = time the sidecar's event-loop thread waited for a CPU "
               "(schedstat); m/p = metered / plain, m/b = metered / baseline")
    for r in rows:
        sp = r.get("sidecar_split")
        if sp:
            out.append(
                f"{r['path']} c={r['concurrency']}: sidecar CPU (schedstat) "
                f"{sp['sidecar_us_per_request']:,.0f} µs/request = "
                f"{sp['sidecar_us_per_request_max_tokens_1']:,.0f} µs for a "
                f"max_tokens-1 request (4 SSE events; Check, ext_proc stream, event; "
                f"{sp['requests_max_tokens_1']} requests) + "
                f"{sp['sidecar_us_per_extra_event']:.0f} µs per further SSE event")
    for key, d in ratios.items():
        rr = d["ttft_p50_ms_round_ratios"]
        ri = d["itl_p50_ms_round_ratios"]
        out.append(
            f"c={key[1:]}: metered - plain: TTFT p50 {d['ttft_p50_delta_ms']:+.2f} ms "
            f"(p99 {d['ttft_p99_delta_ms']:+.2f}), headers p50 {d['hdr_p50_delta_ms']:+.2f} ms,"
            f" ITL p50 {d['itl_p50_delta_ms'] * 1000:+.0f} µs "
            f"(p99 {d['itl_p99_delta_ms']:+.2f} ms); per-round TTFT p50 ratios "
            f"{min(rr, default=0):.3f}..{max(rr, default=0):.3f}, ITL p50 ratios "
            f"{min(ri, default=0):.3f}..{max(ri, default=0):.3f}")
    by = {(r["path"], r["concurrency"], r["api"]): r for r in rows}
    for conc in dict.fromkeys(r["concurrency"] for r in rows):
        chat, msg = by.get((METERED, conc, "chat")), by.get((METERED, conc, "messages"))
        dc, dm = ratios.get(f"c{conc} chat"), ratios.get(f"c{conc} messages")
        if chat and msg and dc and dm:
            out.append(
                f"c={conc}: messages vs chat, metered: sidecar µs/ev "
                f"{msg['cpu_us_per_event'].get('sidecar', 0):.0f} vs "
                f"{chat['cpu_us_per_event'].get('sidecar', 0):.0f}, µs/req "
                f"{msg['cpu_us_per_request'].get('sidecar', 0):,.0f} vs "
                f"{chat['cpu_us_per_request'].get('sidecar', 0):,.0f} "
                f"({msg['events'] / msg['requests']:.0f} vs "
                f"{chat['events'] / chat['requests']:.0f} SSE events per request); m/p TTFT p50 "
                f"{dm['ttft_p50_ms']:.3f} vs {dc['ttft_p50_ms']:.3f}, ITL p50 "
                f"{dm['itl_p50_ms']:.3f} vs {dc['itl_p50_ms']:.3f}")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test, under a minute")
    parser.add_argument("--out", default=str(HERE / "results" / "metering.json"))
    parser.add_argument("--rounds", type=int, default=None, help="quick 1, full 6")
    parser.add_argument("--requests-c1", type=int, default=None,
                        help="requests per path per round at c=1 (quick 3, full 20)")
    parser.add_argument("--waves", type=int, default=None,
                        help="requests per client per path per round at c=16 (quick 2, full 6)")
    parser.add_argument("--concurrency", nargs="+", default=["1", "16", "16s"],
                        help="clients per scenario; a trailing s staggers their starts")
    parser.add_argument("--messages-concurrency", nargs="*", default=["16"],
                        help="the scenarios that also run the Messages API (default: 16)")
    parser.add_argument("--baseline", metavar="REV",
                        help="a third path: a whole spoke whose sidecar and Envoy config are "
                             "git revision REV's, in the same rounds (ratios m/b)")
    parser.add_argument("--max-tokens", type=int, default=None, help="quick 12, full 64")
    parser.add_argument("--tokens-per-s", type=float, default=200.0)
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--phase-timeout", type=float, default=60.0)
    parser.add_argument("--sidecar-env", action="append", default=[], metavar="K=V",
                        help="extra sidecar environment, e.g. PYTHONOPTIMIZE=1")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--keep-workdir", action="store_true")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 6)
    args.requests_c1 = args.requests_c1 or (3 if args.quick else 20)
    args.waves = args.waves or (2 if args.quick else 6)
    args.max_tokens = args.max_tokens or (12 if args.quick else 64)

    import uvloop

    started = time.time()
    loadavg_start = os.getloadavg()
    bench = Bench(args)
    check: dict[str, Any] = {}
    base_check: dict[str, Any] = {}
    log: dict[str, Any] = {}
    base_log: dict[str, Any] = {}
    inproc: dict[str, float] = {}
    try:
        bench.start()
        assert bench.spoke is not None
        assert bench.plain is not None
        print(f"spoke up (metered :{bench.spoke.listen_port}, plain :{bench.plain.port}); "
              f"pinned={bench.pinned}; {args.rounds} rounds", flush=True)
        uvloop.run(bench.measure())
        plain = set(bench.request_ids(PLAIN))
        check = uvloop.run(read_back(bench.spoke.kafka_bootstrap, bench.request_ids(METERED),
                                     plain, 30.0))
        if bench.base_spoke is not None:
            base_check = uvloop.run(read_back(bench.base_spoke.kafka_bootstrap,
                                              bench.request_ids(BASELINE), plain, 30.0))
            base_log = scan_log(bench.base_spoke["sidecar"].log_path,
                                bench.log_start.get(SIDECAR[BASELINE], 0))
        inproc = inprocess_chunk_cost(engine_chunks(bench.spoke.engine_url, bench.wl))
        log = scan_log(bench.spoke["sidecar"].log_path, bench.log_start.get("sidecar", 0))
    finally:
        bench.stop()
        if not args.keep_workdir:
            shutil.rmtree(bench.workdir, ignore_errors=True)

    rows = bench.summary()
    ratios = bench.ratios(rows)
    print()
    print(render_table(rows, ratios))
    if inproc:
        print(f"in-process, no gRPC (parse ProcessingRequest, RequestStream.handle, serialize the "
              f"echo): {inproc['us_per_chunk']:.1f} µs per chunk "
              f"({inproc['chunks_per_stream']:.0f}-chunk stream, "
              f"min {inproc['us_per_chunk_min']:.1f}); the rest of the sidecar's µs per event "
              f"is gRPC, the event loop and thread hand-offs")
    total = sum(r["requests"] for r in rows)
    bad = sum(bench.problems.values())
    print(f"requests: {total}, errors/bad answers: {bad}"
          + (f" {bench.problems} e.g. {bench.problem_sample}" if bad else ""))
    for name, c in (("", check), ("baseline ", base_check)):
        if not c:
            continue
        print(f"{name}Kafka read-back: {'OK' if c.get('ok') else 'FAILED'}: "
              f"{c.get('events_found')}/{c.get('metered_requests')} metered request ids "
              f"found, {c.get('duplicates')} duplicates, {c.get('bad_events')} bad "
              f"(not completed, or completion tokens != content events), "
              f"{c.get('plain_ids_metered')} plain ids metered"
              + (f"; e.g. {c['bad_sample'][:2]}" if c.get("bad_events") else ""))
    for name, lg in (("sidecar", log), ("baseline sidecar", base_log)):
        if lg.get("tracebacks") or lg.get("error_lines"):
            print(f"{name} log: {lg['tracebacks']} tracebacks, {lg['error_lines']} error "
                  f"lines; first:\n{lg['first_traceback'][:1500]}")
    for key, d in ratios.items():
        for k in ("ttft_p50_ms", "itl_p50_ms"):
            verdict = "met" if d[k] <= TARGET_RATIO else "NOT met"
            print(f"target {k.split('_')[0].upper()} p50 change <= 2 % at c={key[1:]}: "
                  f"{verdict} ({(d[k] - 1) * 100:+.1f} %)")

    doc = {
        "bench": "metering", "mode": "quick" if args.quick else "full",
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "duration_s": time.time() - started,
        "workload": asdict(bench.wl), "rounds": args.rounds, "requests_c1": args.requests_c1,
        "waves_c16": args.waves, "target_ratio": TARGET_RATIO,
        "rows": rows, "ratios": ratios,
        "errors": bench.problems, "error_sample": bench.problem_sample,
        "kafka_check": check, "sidecar_log": log, "inprocess_chunk_cost": inproc,
        "messages_concurrency": args.messages_concurrency,
        "baseline": {"rev": args.baseline, "describe": bench.baseline.describe,
                     "messages_api": bench.baseline_messages, "kafka_check": base_check,
                     "sidecar_log": base_log} if bench.baseline else None,
        "sidecar_env": args.sidecar_env,
        "machine": {"nproc": os.cpu_count(), "python": sys.version.split()[0],
                    "platform": platform.platform(), "pinned": bench.pinned,
                    "gateway_cpu": GATEWAY_CPU if bench.pinned else None,
                    "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg()},
        "git": git_state(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0 if not bad and check.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
