"""What Envoy's CPU per request is made of, in the reference config: one element at a time
taken out, changed or multiplied, priced by A/B against the reference config in the same run.

    .venv/bin/python benchmarks/bench_envoy_cost.py [--variants a,b,...] [--rounds 3]
        [--requests 1600] [--concurrency 32] [--rate R --seconds S] [--list]

One whole spoke (devspoke.stack.Spoke, Envoy-fed metering, the HTTP door) gives the sidecar,
engine, Redis and Kafka. Beside it, one Envoy per variant plus `ref` (the reference config
as rendered for the spoke), all to the same sidecar (door and records) and engine, each with
one worker like the spoke's own; a variant is that render with one change (VARIANTS, or
`--list`). `ref_b` is a second, unchanged copy: the noise floor (it moved ±50 µs a median on
a shared 2-core machine). `_x5` variants add four copies of one element (a dose: four times
its cost, out of the noise).

Workload: bench_capacity's short non-streamed chat (the engine answers at once),
`--concurrency` closed-loop clients, `--requests` a phase; `--rate`: open loop at a fixed
rate instead (the same load on every Envoy: its batching per wake-up depends on the rate).
Each round runs ref, v1, ref, v2, ..., ref (the variants reversed every other round), and a
variant is compared with the mean of the ref phases either side of it, so drift cancels.
CPU per request: schedstat of the Envoy (every thread) over the phase and 0.3 s after (the
records flush every 50 ms), less its idle rate; the sidecar's the same way. Reported: the
median over rounds of the µs saved against ref, and against ref_b in the same round.

Many variants break a contract (no record, no Check, no json_to_metadata): they price an
element, they are not proposals; VARIANTS says which. Requests through a variant without
the record leave their admissions open in Redis (limits too high to trip: harmless here);
no Kafka read-back is done.

CPU placement (2+ CPUs, unless --no-pin): Envoys and the sidecar on CPU 0; the client,
engine, Redis and Tansu on CPU 1, as bench_capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from bench_capacity import WORKLOADS, closed_loop, open_loop
from common import git_state, machine_info, markdown_table, pin, sched_ns
from streaming import serve_one_key

from devspoke.envoy_proc import envoy_service
from devspoke.procs import Service, free_port
from devspoke.stack import Spoke
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from gateway.policy import secrets
from gateway.settings import Metering

HERE = Path(__file__).resolve().parent
LOOP = "127.0.0.1"
GATEWAY_CPU, OTHER_CPU = 0, 1
SETTLE_S, REQUEST_TIMEOUT_S, IDLE_S = 0.3, 30.0, 2.0
MODEL = "mock-model"
AUTHZ, LUA = "envoy.filters.http.ext_authz", "envoy.filters.http.lua"
J2M, OTLP = "envoy.filters.http.json_to_metadata", "envoy.access_loggers.open_telemetry"
STDOUT = "envoy.access_loggers.stdout"
REF = "ref"

Config = dict[str, Any]


def hcm(config: Config) -> Config:
    hcm_: Config = config["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    return hcm_


def http_filter(config: Config, name: str) -> Config:
    return next(f["typed_config"] for f in hcm(config)["http_filters"] if f["name"] == name)


def drop_filter(name: str) -> Callable[[Config], None]:
    def f(config: Config) -> None:
        hcm(config)["http_filters"] = [x for x in hcm(config)["http_filters"]
                                       if x["name"] != name]
    return f


def drop_logger(name: str) -> Callable[[Config], None]:
    def f(config: Config) -> None:
        hcm(config)["access_log"] = [x for x in hcm(config)["access_log"] if x["name"] != name]
    return f


def file_log_fields(keep: Callable[[str], bool]) -> Callable[[Config], None]:
    def f(config: Config) -> None:
        log = next(x for x in hcm(config)["access_log"] if x["name"] == STDOUT)
        fmt = log["typed_config"]["log_format"]["json_format"]
        log["typed_config"]["log_format"]["json_format"] = {k: v for k, v in fmt.items()
                                                            if keep(k)}
    return f


def otlp_attributes(keep: Callable[[str], bool]) -> Callable[[Config], None]:
    def f(config: Config) -> None:
        log = next(x for x in hcm(config)["access_log"] if x["name"] == OTLP)
        attrs = log["typed_config"]["attributes"]["values"]
        log["typed_config"]["attributes"]["values"] = [a for a in attrs if keep(a["key"])]
    return f


def lua_without(function: str) -> Callable[[Config], None]:
    """The Lua script with `function` renamed: Envoy skips a direction whose function the
    script does not define (no coroutine, no metadata read)."""
    def f(config: Config) -> None:
        src = http_filter(config, LUA)["default_source_code"]
        assert f"function {function}(" in src["inline_string"]
        src["inline_string"] = src["inline_string"].replace(
            f"function {function}(", f"function unused_{function}(")
    return f


def authz(change: Callable[[Config], None]) -> Callable[[Config], None]:
    return lambda config: change(http_filter(config, AUTHZ))


def authz_metadata_headers(keep: set[str]) -> Callable[[Config], None]:
    def f(authz_: Config) -> None:
        resp = authz_["http_service"]["authorization_response"]
        pats = resp["dynamic_metadata_from_headers"]["patterns"]
        resp["dynamic_metadata_from_headers"]["patterns"] = [p for p in pats
                                                            if p.get("exact") in keep]
    return authz(f)


def dose(kind: str, copies: int) -> Callable[[Config], None]:
    """`copies` more of one element (a filter, a logger, a record attribute): the element's
    cost, multiplied out of the noise (a removal saves one of them)."""
    def f(config: Config) -> None:
        h = hcm(config)
        if kind in (LUA, J2M):
            at = next(i for i, x in enumerate(h["http_filters"]) if x["name"] == kind)
            h["http_filters"][at + 1:at + 1] = [
                {**copy.deepcopy(h["http_filters"][at]), "name": f"{kind}.{i}"}
                for i in range(copies)]
        elif kind == STDOUT:
            log = next(x for x in h["access_log"] if x["name"] == STDOUT)
            h["access_log"] += [copy.deepcopy(log) for _ in range(copies)]
        else:  # a record attribute
            log = next(x for x in h["access_log"] if x["name"] == OTLP)
            attrs = log["typed_config"]["attributes"]["values"]
            attr = next(a for a in attrs if a["key"] == kind)
            attrs += [{**copy.deepcopy(attr), "key": f"{kind}{i}"} for i in range(copies)]
    return f


def j2m_rules(keep: Callable[[list[str]], bool]) -> Callable[[Config], None]:
    def f(config: Config) -> None:
        rules = http_filter(config, J2M)["response_rules"]
        rules["rules"] = [r for r in rules["rules"]
                          if keep([x["key"] for x in r["selectors"]])]
        assert rules["rules"]
    return f


def skip_matcher(inner: Config) -> Config:
    """`inner` (an HTTP filter entry) inside an ExtensionWithMatcher that skips it unless the
    request carries x-gateway-lua (a header the Check could add for the requests that need
    the filter: the matcher sees headers ext_authz added, checked with a streamed request)."""
    skip = {"action": {"name": "skip", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3"
                 ".SkipFilter"}}}
    return {"name": inner["name"], "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
        "extension_config": inner,
        "xds_matcher": {"matcher_tree": {
            "input": {"name": "lua-switch", "typed_config": {
                "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput",
                "header_name": "x-gateway-lua"}},
            "exact_match_map": {"map": {"never": skip}}},
            "on_no_match": skip}}}


def lua_skipped(copies: int = 0) -> Callable[[Config], None]:
    """Every Lua filter (after `copies` more) behind skip_matcher: what the switch costs a
    request it skips."""
    def f(config: Config) -> None:
        if copies:
            dose(LUA, copies)(config)
        h = hcm(config)
        h["http_filters"] = [skip_matcher(x) if x["name"].startswith(LUA) else x
                             for x in h["http_filters"]]
    return f


def no_client_headers(authz_: Config) -> None:
    resp = authz_["http_service"]["authorization_response"]
    for key in ("allowed_client_headers", "allowed_client_headers_on_success"):
        resp.pop(key)


def no_stats(config: Config) -> None:
    config["stats_config"] = {"stats_matcher": {"reject_all": True}}


def hcm_set(**kv: Any) -> Callable[[Config], None]:
    return lambda config: hcm(config).update(kv)


# name -> (what it changes, contract it breaks or "" when it keeps every one, change)
VARIANTS: dict[str, tuple[str, str, Callable[[Config], None]]] = {
    "ref_b": ("the reference config again, in its own Envoy (noise)", "", lambda c: None),
    "no_file_log": ("no JSON access log to stdout", "", drop_logger(STDOUT)),
    "file_log_no_metadata": ("JSON access log without its authz and usage metadata", "",
                             file_log_fields(lambda k: k not in ("authz", "usage"))),
    "otlp_no_details": ("record without `details` (not read by the sidecar)", "",
                        otlp_attributes(lambda k: k != "details")),
    "otlp_no_durations": ("record without duration_us, total_ms, ttft_us, gen_us",
                          "the record's timings", otlp_attributes(
                              lambda k: k not in ("duration_us", "total_ms", "ttft_us",
                                                  "gen_us"))),
    "otlp_no_authz": ("record without the ext_authz metadata JSON", "the record's facts",
                      otlp_attributes(lambda k: k != "authz")),
    "otlp_no_metadata": ("record without authz, usage, counted (3 metadata JSONs)",
                         "the record's facts and usage",
                         otlp_attributes(lambda k: k not in ("authz", "usage", "counted"))),
    "otlp_rid_only": ("record with only rid", "the record",
                      otlp_attributes(lambda k: k == "rid")),
    "file_log_x5": ("4 more JSON access logs (dose: 4x one)", "", dose(STDOUT, 4)),
    "otlp_authz_x5": ("4 more copies of the record's authz attribute (dose)", "",
                      dose("authz", 4)),
    "otlp_details_x5": ("4 more copies of the record's details attribute (dose)", "",
                        dose("details", 4)),
    "lua_x5": ("4 more Lua filters, the same script (dose)", "", dose(LUA, 4)),
    "j2m_x5": ("4 more json_to_metadata filters (dose)", "", dose(J2M, 4)),
    "no_otlp": ("no OpenTelemetry access log at all", "the record (billing)",
                drop_logger(OTLP)),
    "j2m_1rule": ("json_to_metadata with one rule (usage.completion_tokens) of 22",
                  "the other APIs' usage", j2m_rules(lambda sel: sel == ["usage",
                                                                         "completion_tokens"])),
    "no_j2m": ("no json_to_metadata filter", "non-streamed usage", drop_filter(J2M)),
    "lua_no_request": ("Lua without envoy_on_request", "the splice (streams)",
                       lua_without("envoy_on_request")),
    "lua_no_response": ("Lua without envoy_on_response", "stream counting/usage",
                        lua_without("envoy_on_response")),
    "lua_skipped": ("the Lua filter behind a matcher that skips it (the request has no "
                    "x-gateway-lua header)", "as no_lua for this request", lua_skipped()),
    "lua_skipped_x5": ("lua_x5, every copy behind the skipping matcher (dose)",
                       "as no_lua for this request", lua_skipped(4)),
    "no_lua": ("no Lua filter", "splice, stream usage", drop_filter(LUA)),
    "authz_md_min": ("dynamic_metadata_from_headers: only request_id, key_id, team, model",
                     "the facts", authz_metadata_headers({"request_id", "key_id", "team",
                                                          "model"})),
    "authz_no_client_headers": ("no allowed_client_headers(_on_success) patterns",
                                "denials' and rate-limit headers", authz(no_client_headers)),
    "authz_no_cluster_stats": ("ext_authz charge_cluster_response_stats off", "",
                               authz(lambda a: a.update(charge_cluster_response_stats=False))),
    "authz_no_upstream_headers": ("no allowed_upstream_headers (the 4 x-gateway- headers)",
                                  "the engine's x-gateway- headers",
                                  authz(lambda a: a["http_service"]["authorization_response"]
                                        .pop("allowed_upstream_headers"))),
    "no_authz": ("no ext_authz filter", "the Check (fail closed)", drop_filter(AUTHZ)),
    "no_stats": ("stats_config reject_all (no stats at all)", "operability", no_stats),
    "no_normalize": ("normalize_path, merge_slashes off", "path normalisation",
                     hcm_set(normalize_path=False, merge_slashes=False,
                             path_with_escaped_slashes_action="KEEP_UNCHANGED")),
    "no_request_id_in_response": ("always_set_request_id_in_response off",
                                  "x-request-id answered", hcm_set(
                                      always_set_request_id_in_response=False)),
}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-envoy-cost-"))
        self.secret = secrets.new_secret("bench")
        self.spoke: Spoke | None = None
        self.envoys: dict[str, Service] = {}
        self.pinned = not args.no_pin and {GATEWAY_CPU, OTHER_CPU} <= os.sched_getaffinity(0)
        self.idle: dict[str, float] = {}  # envoy name -> idle CPU s per s
        # (round, variant) -> {"envoy": µs/req, "sidecar": µs/req, "rps": ..., "errors": n}
        self.results: dict[tuple[int, str], dict[str, float]] = {}
        # (round, variant) -> the ref phases either side of it, averaged
        self.paired: dict[tuple[int, str], dict[str, float]] = {}

    def start(self) -> None:
        ref: dict[str, Any] = {}

        def keep(ports: EnvoyPorts, metering: Metering) -> str:
            ref["ports"], ref["metering"] = ports, metering
            return render(ports, metering=metering)

        self.spoke = Spoke(workdir=self.workdir / "spoke", listen_port=free_port(),
                           metering="envoy", envoy_config=keep).start()
        serve_one_key(self.spoke, self.secret, MODEL, limited=True)
        for name in (REF, *self.args.variants):
            ports = dataclasses.replace(ref["ports"], listen=f"{LOOP}:{free_port()}",
                                        admin=f"{LOOP}:{free_port()}")
            config = yaml.safe_load(render(ports, metering=ref["metering"]))
            if name != REF:
                VARIANTS[name][2](config)
            port = int(ports.listen.rsplit(":", 1)[1])
            svc = envoy_service(yaml.safe_dump(config, sort_keys=False),
                                int(ports.admin.rsplit(":", 1)[1]), port,
                                self.workdir / name)
            svc.name = f"envoy-{name}"
            self.envoys[name] = svc.start()
        if self.pinned:
            os.sched_setaffinity(0, {OTHER_CPU})
            for name, svc in self.spoke.services.items():
                pin(svc.pid, {GATEWAY_CPU} if name in ("envoy", "sidecar") else {OTHER_CPU})
            for svc in self.envoys.values():
                pin(svc.pid, {GATEWAY_CPU})

    def stop(self) -> None:
        for svc in self.envoys.values():
            with contextlib.suppress(Exception):
                svc.stop()
        if self.spoke is not None:
            with contextlib.suppress(Exception):
                self.spoke.stop()

    def cpu(self) -> dict[str, float]:
        assert self.spoke is not None
        out = {}
        for name, svc in {**self.envoys, "sidecar": self.spoke["sidecar"]}.items():
            if (s := sched_ns(svc.pid)) is not None:
                out[name] = s[0] / 1e9
        return out

    def port(self, name: str) -> int:
        return self.envoys[name].port

    async def phase(self, session: aiohttp.ClientSession, rnd: int,
                    name: str) -> dict[str, float]:
        path, body = WORKLOADS["chat"]
        headers = {"authorization": f"Bearer {self.secret}", "content-type": "application/json",
                   "x-mock-ttft-ms": "0", "x-mock-tokens-per-s": "0"}
        url = f"http://{LOOP}:{self.port(name)}{path}"
        conc = self.args.concurrency
        per_worker = max(1, self.args.requests // conc) if rnd >= 0 else 3
        before, t0 = self.cpu(), time.perf_counter()
        answers = await (
            open_loop(session, url, body, headers, self.args.rate, self.args.seconds)
            if self.args.rate and rnd >= 0
            else closed_loop(session, url, body, headers, conc, per_worker))
        wall = time.perf_counter() - t0
        await asyncio.sleep(SETTLE_S)
        after, span = self.cpu(), time.perf_counter() - t0
        n = len(answers)
        envoy_s = after[name] - before[name] - self.idle.get(name, 0.0) * span
        return {
            "envoy_us": envoy_s / n * 1e6,
            "sidecar_us": (after["sidecar"] - before["sidecar"]) / n * 1e6,
            "rps": n / wall, "errors": sum(a.status != 200 for a in answers)}

    async def measure(self) -> None:
        """Each round: ref, v1, ref, v2, ..., ref (the variants' order reversed every other
        round); a variant is compared with the mean of the ref phases either side of it, so
        drift (other load on the machine, the sidecar's state) cancels."""
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
            names = list(self.envoys)
            for name in names:  # warm-up: connections, caches
                await self.phase(session, -1, name)
            before, t0 = self.cpu(), time.perf_counter()
            await asyncio.sleep(self.args.idle_s)
            after, wall = self.cpu(), time.perf_counter() - t0
            self.idle = {k: (after[k] - v) / wall for k, v in before.items() if k in names}
            variants = [n for n in names if n != REF]
            for rnd in range(self.args.rounds):
                order = variants if rnd % 2 == 0 else variants[::-1]
                refs = [await self.phase(session, rnd, REF)]
                for name in order:
                    self.results[(rnd, name)] = await self.phase(session, rnd, name)
                    refs.append(await self.phase(session, rnd, REF))
                    self.paired[(rnd, name)] = {
                        k: (refs[-2][k] + refs[-1][k]) / 2 for k in refs[-1]}
                self.results[(rnd, REF)] = {k: statistics.fmean(r[k] for r in refs)
                                            for k in refs[0]}
                self.paired[(rnd, REF)] = self.results[(rnd, REF)]
                saved = {n: self.paired[(rnd, n)]["envoy_us"] - self.results[(rnd, n)]["envoy_us"]
                         for n in variants}
                print(f"  round {rnd}: ref {self.results[(rnd, REF)]['envoy_us']:.0f} µs; saved "
                      + ", ".join(f"{n} {v:+.0f}" for n, v in saved.items()), flush=True)

    def rows(self) -> list[dict[str, Any]]:
        rounds = range(self.args.rounds)
        out = []
        for name in self.envoys:
            r = [self.results[(i, name)] for i in rounds]
            ref = [self.paired[(i, name)] for i in rounds]
            ratios = [a["envoy_us"] / b["envoy_us"] for a, b in zip(r, ref, strict=True)]
            saved = [b["envoy_us"] - a["envoy_us"] for a, b in zip(r, ref, strict=True)]
            sc_saved = [b["sidecar_us"] - a["sidecar_us"] for a, b in zip(r, ref, strict=True)]
            twin = [self.results.get((i, "ref_b")) for i in rounds]
            vs_twin = [b["envoy_us"] - a["envoy_us"] for a, b in zip(r, twin, strict=True)
                       if b is not None]
            what, breaks, _ = VARIANTS.get(name, ("the reference config", "", None))
            out.append({
                "variant": name, "what": what, "breaks": breaks,
                "envoy_us": statistics.median(x["envoy_us"] for x in r),
                "x_ref": statistics.median(ratios), "saved_us": statistics.median(saved),
                "saved_us_rounds": saved,
                "saved_vs_ref_b_us": statistics.median(vs_twin) if vs_twin else None,
                "sidecar_saved_us": statistics.median(sc_saved),
                "sidecar_us": statistics.median(x["sidecar_us"] for x in r),
                "rps": statistics.median(x["rps"] for x in r),
                "errors": sum(int(x["errors"]) for x in r),
                "idle_us_per_s": self.idle.get(name, 0.0) * 1e6})
        return out


def render_table(rows: list[dict[str, Any]]) -> str:
    head = ("variant", "Envoy µs/req", "x ref", "saved µs (rounds)", "vs ref_b", "sidecar µs/req",
            "sidecar saved", "req/s", "errors", "breaks")
    body = [(r["variant"], f"{r['envoy_us']:.0f}", f"{r['x_ref']:.3f}",
             f"{r['saved_us']:+.0f} (" + " ".join(f"{s:+.0f}" for s in r["saved_us_rounds"])
             + ")", "-" if r["saved_vs_ref_b_us"] is None else f"{r['saved_vs_ref_b_us']:+.0f}",
             f"{r['sidecar_us']:.0f}", f"{r['sidecar_saved_us']:+.0f}",
             f"{r['rps']:,.0f}", str(r["errors"]),
             r["breaks"] or "-") for r in rows]
    return "\n".join(markdown_table(head, body))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, from --list (default: all)")
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1600,
                        help="requests per Envoy per round (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate", type=int, default=0,
                        help="open loop at this many req/s instead (the same load on every "
                             "Envoy: its batching per wake-up depends on the rate)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="with --rate: seconds a phase (default: %(default)s)")
    parser.add_argument("--idle-s", type=float, default=IDLE_S,
                        help="seconds of idle CPU measured after the warm-up (default: "
                             "%(default)s)")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results" / "envoy_cost.json"))
    args = parser.parse_args()
    if args.list:
        for name, (what, breaks, _) in VARIANTS.items():
            print(f"{name:28} {what}" + (f" [breaks: {breaks}]" if breaks else ""))
        return 0
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants: {sorted(unknown)}")

    import uvloop

    started, loadavg_start = time.time(), os.getloadavg()
    bench = Bench(args)
    try:
        bench.start()
        print(f"up: ref + {len(args.variants)} variants; pinned={bench.pinned}", flush=True)
        uvloop.run(bench.measure())
    finally:
        bench.stop()
        shutil.rmtree(bench.workdir, ignore_errors=True)
    rows = bench.rows()
    print("\n" + render_table(rows))
    print(f"Envoy CPU per request: schedstat over the phase + {SETTLE_S} s, less idle; saved = "
          f"the ref phases either side - variant, median of {args.rounds} rounds; "
          f"c={args.concurrency}, {args.requests} chat requests a phase")
    errors = sum(r["errors"] for r in rows)
    loadavg_end = os.getloadavg()
    doc = {"bench": "envoy_cost", "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
           "duration_s": time.time() - started, "rounds": args.rounds,
           "requests": args.requests, "concurrency": args.concurrency, "rows": rows,
           "machine": machine_info(pinned=bench.pinned, loadavg_start=loadavg_start,
                                   loadavg_end=loadavg_end), "git": git_state()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {args.out}; errors {errors}; {time.time() - started:.0f} s")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
