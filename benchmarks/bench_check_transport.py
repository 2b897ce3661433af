"""What the Check's transport costs Envoy: ext_authz `http_service` over HTTP/1.1 (today's
door: one upstream connection per concurrent Check) against the same over h2c (every Check
a stream on one HTTP/2 connection), Envoy side only, without an h2c door.

    .venv/bin/python benchmarks/bench_check_transport.py [--rounds 5] [--requests 1600]
        [--requests-c1 300] [--levels c32,c1,r800] [--seconds 2] [--quick] [--no-pin]

The answerer: a second Envoy whose listener (codec AUTO: HTTP/1.1 or h2c prior knowledge)
answers every Check with a constant 200 carrying a set of headers like the door's allowed
answer (the context headers, the headers to remove, x-ratelimit-*, the metadata; ANSWER), by
a direct_response route behind a buffer filter (the whole Check read first, as the door
does: an HTTP/1.1 answer before the body's end makes Envoy close the connection). No Python
answers a Check.

Envoys under test, each bench_latency's `floor` config (the reference config's ext_authz and
router, no records, no Lua, no json_to_metadata), one worker, to the same answerer and mock
engine: `h1` (the reference config's authz cluster, HTTP/1.1), `h2c` (that cluster with
`typed_extension_protocol_options` HttpProtocolOptions explicit_http_config
http2_protocol_options, as gateway/envoyconf/clusters.py's `http2_cluster`), `h1_b` (a
second `h1`: the noise floor) and `no_authz` (no ext_authz filter: what the whole Check
costs on this floor).

Workload: bench_capacity's short non-streamed chat at each of `--levels`: `cN` a closed
loop of N clients, `rR` an open loop at R req/s for `--seconds` (the same load on every
Envoy; its batching per wake-up depends on the rate: 800/s is about what the whole spoke
serves at c=32, where the sidecar is the bottleneck). Each round runs every Envoy once per
level, in order, reversed every other round (A B C D, D C B A) so drift cancels. CPU per
request: schedstat of the Envoy under test (every thread) over the phase and 0.1 s after,
less its idle rate. Reported per level:
the median over rounds of µs/request, of h1 minus h2c in the same round (and h1 minus
h1_b), latency p50/p99 (aiohttp, client side), and the authz cluster's counters from
Envoy's admin: connections opened since the start (upstream_cx_total, _http1_total,
_http2_total; warm-up included), open at the level's end (upstream_cx_active), Checks sent
in the level (upstream_rq_total); the answerer's downstream_cx_http1/http2_total likewise.

CPU placement (2+ CPUs, unless --no-pin): the Envoys under test and the answerer on CPU 0
(as the sidecar's door shares the spoke's core); the client and the engine on CPU 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from bench_capacity import WORKLOADS, closed_loop, open_loop
from bench_latency import floor_config, pct
from common import envoy_stats, git_state, machine_info, markdown_table, pin, sched_ns

from devspoke.envoy_proc import envoy_service
from devspoke.procs import Service, free_port
from devspoke.stack import engine_service
from gateway.envoyconf.bootstrap import EnvoyPorts
from gateway.envoyconf.filters import AUTHZ_HTTP_CLUSTER

HERE = Path(__file__).resolve().parent
LOOP = "127.0.0.1"
GATEWAY_CPU, OTHER_CPU = 0, 1
SETTLE_S, IDLE_S, REQUEST_TIMEOUT_S = 0.1, 2.0, 30.0
AUTHZ = "envoy.filters.http.ext_authz"
H2_OPTIONS = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "explicit_http_config": {"http2_protocol_options": {}}}}
# An allowed Check's answer, as gateway/server/check_http.py shapes it: the context headers
# to the engine, the headers to remove, the client's rate-limit headers, the metadata.
ANSWER = [
    ("x-gateway-request-id", "0b6a9a48-cd1b-4bb4-9a1c-6d1d9a1f0e11"),
    ("x-gateway-key-id", "k_3f9a2c"), ("x-gateway-team", "bench"),
    ("x-gateway-model", "mock-model"),
    ("x-envoy-auth-headers-to-remove", "authorization,x-api-key"),
    ("x-ratelimit-limit-requests", "1000000"), ("x-ratelimit-remaining-requests", "999998"),
    ("x-ratelimit-reset-requests", "1m"), ("x-ratelimit-limit-tokens", "100000000"),
    ("x-ratelimit-remaining-tokens", "99999900"), ("x-ratelimit-reset-tokens", "1m"),
    ("request_id", "0b6a9a48-cd1b-4bb4-9a1c-6d1d9a1f0e11"), ("reserved", "32"),
    ("prompt_estimate", "12"), ("key_id", "k_3f9a2c"), ("team", "bench"),
    ("model", "mock-model"), ("stream", "false"), ("leased", "true"),
    ("endpoint", "chat"), ("status", "allowed"),
]
VARIANTS = {  # name -> what it is
    "h1": "ext_authz http_service over HTTP/1.1 (the reference config)",
    "h2c": "the same over h2c (http2_protocol_options on the authz cluster)",
    "h1_b": "h1 again, its own Envoy (noise)",
    "no_authz": "no ext_authz filter (the whole Check's cost on this floor)",
}


def answerer_config(port: int, admin: int) -> str:
    route = {"match": {"prefix": "/"}, "direct_response": {"status": 200},
             "response_headers_to_add": [
                 {"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                 for k, v in ANSWER]}
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network."
                    "http_connection_manager.v3.HttpConnectionManager",
           "stat_prefix": "answerer", "codec_type": "AUTO",
           "server_header_transformation": "PASS_THROUGH",
           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                                               "routes": [route]}]},
           "http_filters": [
               {"name": "envoy.filters.http.buffer", "typed_config": {
                   "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                   "max_request_bytes": 8388608}},
               {"name": "envoy.filters.http.router", "typed_config": {
                   "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3"
                            ".Router"}}]}
    doc = {"admin": {"address": {"socket_address": {"address": LOOP, "port_value": admin}}},
           "static_resources": {"listeners": [{
               "name": "answerer",
               "address": {"socket_address": {"address": LOOP, "port_value": port}},
               "filter_chains": [{"filters": [{
                   "name": "envoy.filters.network.http_connection_manager",
                   "typed_config": hcm}]}]}]}}
    return yaml.safe_dump(doc, sort_keys=False)


def under_test(name: str, engine: str, answerer_port: int) -> tuple[str, int, int]:
    port, admin = free_port(), free_port()
    ports = EnvoyPorts(listen=f"{LOOP}:{port}", engine=engine, admin=f"{LOOP}:{admin}")
    doc = yaml.safe_load(floor_config(ports, answerer_port, ()))
    tc = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    if name == "h2c":
        cluster = next(c for c in doc["static_resources"]["clusters"]
                       if c["name"] == AUTHZ_HTTP_CLUSTER)
        cluster["typed_extension_protocol_options"] = copy.deepcopy(H2_OPTIONS)
    elif name == "no_authz":
        tc["http_filters"] = [f for f in tc["http_filters"] if f["name"] != AUTHZ]
    return yaml.safe_dump(doc, sort_keys=False), port, admin


def cluster_counters(admin: int) -> dict[str, int]:
    stats = envoy_stats(admin, f"cluster.{AUTHZ_HTTP_CLUSTER}.")
    return {k: stats.get(k, 0) for k in (
        "upstream_cx_total", "upstream_cx_http1_total", "upstream_cx_http2_total",
        "upstream_cx_active", "upstream_rq_total", "upstream_cx_destroy")}


def answerer_counters(admin: int) -> dict[str, int]:
    stats = envoy_stats(admin, "http.answerer.")
    return {k: stats.get(k, 0) for k in (
        "downstream_cx_http1_total", "downstream_cx_http2_total", "downstream_rq_total")}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-check-transport-"))
        self.pinned = not args.no_pin and {GATEWAY_CPU, OTHER_CPU} <= os.sched_getaffinity(0)
        self.engine: Service | None = None
        self.answerer: Service | None = None
        self.answerer_admin = 0
        self.envoys: dict[str, tuple[Service, int]] = {}  # name -> (service, admin port)
        self.idle: dict[str, float] = {}
        # (level, round, variant) -> phase
        self.results: dict[tuple[str, int, str], dict[str, Any]] = {}
        self.counters: dict[str, dict[str, dict[str, int]]] = {}  # level -> ...

    def start(self) -> None:
        self.engine = engine_service(free_port(), self.workdir, ttft_ms=0).start()
        port, self.answerer_admin = free_port(), free_port()
        svc = envoy_service(answerer_config(port, self.answerer_admin), self.answerer_admin,
                            port, self.workdir / "answerer")
        svc.name = "envoy-answerer"
        self.answerer = svc.start()
        for name in self.args.variants:
            config, listen, admin = under_test(name, self.engine.address, port)
            svc = envoy_service(config, admin, listen, self.workdir / name)
            svc.name = f"envoy-{name}"
            self.envoys[name] = (svc.start(), admin)
        if self.pinned:
            os.sched_setaffinity(0, {OTHER_CPU})
            pin(self.engine.pid, {OTHER_CPU})
            for s in (self.answerer, *(s for s, _ in self.envoys.values())):
                pin(s.pid, {GATEWAY_CPU})

    def stop(self) -> None:
        for svc in (*(s for s, _ in self.envoys.values()), self.answerer, self.engine):
            if svc is not None:
                with contextlib.suppress(Exception):
                    svc.stop()

    def cpu(self) -> dict[str, float]:
        out = {}
        for name, (svc, _) in self.envoys.items():
            if (s := sched_ns(svc.pid)) is not None:
                out[name] = s[0] / 1e9
        return out

    async def phase(self, session: aiohttp.ClientSession, name: str, level: str,
                    requests: int) -> dict[str, Any]:
        path, body = WORKLOADS["chat"]
        headers = {"authorization": "Bearer bench", "content-type": "application/json",
                   "x-mock-ttft-ms": "0", "x-mock-tokens-per-s": "0"}
        url = f"http://{LOOP}:{self.envoys[name][0].port}{path}"
        gc.collect()
        gc.disable()
        try:
            before, t0 = self.cpu(), time.perf_counter()
            n = int(level[1:])
            answers = await (open_loop(session, url, body, headers, n, self.args.seconds)
                             if level[0] == "r" else
                             closed_loop(session, url, body, headers, n, max(1, requests // n)))
            wall = time.perf_counter() - t0
            await asyncio.sleep(SETTLE_S)
            after, span = self.cpu(), time.perf_counter() - t0
        finally:
            gc.enable()
        n = len(answers)
        lat = [a.latency_s * 1e3 for a in answers if a.status == 200] or [0.0]
        return {"envoy_us": (after[name] - before[name] - self.idle.get(name, 0.0) * span)
                / n * 1e6, "rps": n / wall, "p50_ms": statistics.median(lat),
                "p99_ms": pct(lat, 0.99), "errors": sum(a.status != 200 for a in answers)}

    async def measure(self) -> None:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
            names = list(self.envoys)
            for name in names:  # warm-up
                await self.phase(session, name, "c32", 64)
            before, t0 = self.cpu(), time.perf_counter()
            await asyncio.sleep(self.args.idle_s)
            after, wall = self.cpu(), time.perf_counter() - t0
            self.idle = {k: (after[k] - v) / wall for k, v in before.items()}
            for conc in self.args.levels:
                start = {n: cluster_counters(a) for n, (_, a) in self.envoys.items()}
                ans0 = answerer_counters(self.answerer_admin)
                requests = self.args.requests_c1 if conc == "c1" else self.args.requests
                for rnd in range(self.args.rounds):
                    for name in (names if rnd % 2 == 0 else names[::-1]):
                        self.results[(conc, rnd, name)] = await self.phase(
                            session, name, conc, requests)
                    r = {n: self.results[(conc, rnd, n)] for n in names}
                    print(f"  {conc} round {rnd}: " + ", ".join(
                        f"{n} {x['envoy_us']:.0f} µs p50 {x['p50_ms']:.2f} ms"
                        for n, x in r.items()), flush=True)
                end = {n: cluster_counters(a) for n, (_, a) in self.envoys.items()}
                ans1 = answerer_counters(self.answerer_admin)
                # per Envoy: the level's new connections and requests, and since its start
                self.counters[conc] = {
                    **{n: {**{k: end[n][k] - start[n][k] for k in end[n]
                              if k != "upstream_cx_active"},
                           "upstream_cx_active": end[n]["upstream_cx_active"],
                           **{f"{k}_since_start": end[n][k] for k in (
                               "upstream_cx_total", "upstream_cx_http1_total",
                               "upstream_cx_http2_total", "upstream_rq_total")}}
                       for n in names},
                    "answerer": {**{k: ans1[k] - ans0[k] for k in ans1},
                                 **{f"{k}_since_start": v for k, v in ans1.items()}}}

    def rows(self) -> list[dict[str, Any]]:
        out = []
        rounds = range(self.args.rounds)
        for conc in self.args.levels:
            for name in self.envoys:
                r = [self.results[(conc, i, name)] for i in rounds]
                h1 = [self.results[(conc, i, "h1")] for i in rounds] \
                    if "h1" in self.envoys else None
                saved = ([a["envoy_us"] - b["envoy_us"] for a, b in zip(h1, r, strict=True)]
                         if h1 else [])
                out.append({
                    "level": conc, "variant": name, "what": VARIANTS[name],
                    "envoy_us": statistics.median(x["envoy_us"] for x in r),
                    "envoy_us_rounds": [x["envoy_us"] for x in r],
                    "saved_vs_h1_us": statistics.median(saved) if saved else None,
                    "saved_vs_h1_us_rounds": saved,
                    "p50_ms": statistics.median(x["p50_ms"] for x in r),
                    "p99_ms": statistics.median(x["p99_ms"] for x in r),
                    "rps": statistics.median(x["rps"] for x in r),
                    "errors": sum(int(x["errors"]) for x in r),
                    "authz_cluster": self.counters[conc][name]})
        return out


def render_table(rows: list[dict[str, Any]]) -> str:
    head = ("level", "variant", "Envoy µs/req", "h1 - this, µs (rounds)", "p50 ms", "p99 ms",
            "req/s", "errors", "authz cluster: cx since start (h1, h2) / active / rq")
    body: list[tuple[str, ...]] = []
    for r in rows:
        c = r["authz_cluster"]
        body.append((r["level"], r["variant"], f"{r['envoy_us']:.0f}",
                     "-" if r["saved_vs_h1_us"] is None or r["variant"] == "h1" else
                     f"{r['saved_vs_h1_us']:+.0f} (" + " ".join(
                         f"{s:+.0f}" for s in r["saved_vs_h1_us_rounds"]) + ")",
                     f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['rps']:,.0f}",
                     str(r["errors"]),
                     f"{c['upstream_cx_total_since_start']} "
                     f"({c['upstream_cx_http1_total_since_start']}, "
                     f"{c['upstream_cx_http2_total_since_start']}) / "
                     f"{c['upstream_cx_active']} / {c['upstream_rq_total']}"))
    return "\n".join(markdown_table(head, body))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1600,
                        help="requests a phase at c>1 (default: %(default)s)")
    parser.add_argument("--requests-c1", type=int, default=300,
                        help="requests a phase at c=1 (default: %(default)s)")
    parser.add_argument("--levels", default="c32,c1,r800",
                        help="cN: closed loop, N clients; rR: open loop, R req/s "
                             "(default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="an open-loop phase's length (default: %(default)s)")
    parser.add_argument("--idle-s", type=float, default=IDLE_S,
                        help="seconds of idle CPU measured after the warm-up (default: "
                             "%(default)s; --quick 0.5)")
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 128 (c>1) and 32 (c=1) requests, idle over 0.5 s: "
                             "the harness runs")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results" / "check_transport.json"))
    args = parser.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants: {sorted(unknown)}")
    args.levels = [v for v in args.levels.split(",") if v]
    if bad := [v for v in args.levels if v[:1] not in ("c", "r") or not v[1:].isdigit()]:
        parser.error(f"bad levels: {bad}")
    if args.quick:
        args.rounds, args.requests, args.requests_c1, args.seconds = 2, 128, 32, 0.2
        args.idle_s = 0.5

    import uvloop

    started, loadavg_start = time.time(), os.getloadavg()
    bench = Bench(args)
    try:
        bench.start()
        print(f"up: {', '.join(bench.envoys)}; pinned={bench.pinned}", flush=True)
        uvloop.run(bench.measure())
    finally:
        bench.stop()
        shutil.rmtree(bench.workdir, ignore_errors=True)
    rows = bench.rows()
    print("\n" + render_table(rows))
    print(f"Envoy CPU per request: schedstat over the phase + {SETTLE_S} s, less idle; median "
          f"of {args.rounds} rounds; chat; authz cluster counters over the "
          "whole level")
    for conc, c in bench.counters.items():
        print(f"{conc} answerer: {c['answerer']}")
    errors = sum(r["errors"] for r in rows)
    loadavg_end = os.getloadavg()
    doc = {"bench": "check_transport",
           "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
           "duration_s": time.time() - started, "rounds": args.rounds,
           "requests": args.requests, "requests_c1": args.requests_c1,
           "levels": args.levels, "seconds": args.seconds, "answer_headers": ANSWER, "rows": rows,
           "counters": bench.counters,
           "machine": machine_info(pinned=bench.pinned, loadavg_start=loadavg_start,
                                   loadavg_end=loadavg_end), "git": git_state()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {args.out}; errors {errors}; {time.time() - started:.0f} s")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
