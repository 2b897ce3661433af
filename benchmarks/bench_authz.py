"""What the sidecar costs: direct ext_authz Checks, and a chat request through Envoy with and
without the sidecar, all measured in one run so the ratios are comparable on a noisy machine.

    .venv/bin/python benchmarks/bench_authz.py [--quick] [--out benchmarks/results/authz.json]

A) Direct gRPC Check against one sidecar process (Redis admission: model, team and key tiers
   with huge rps and tokens_per_day limits, so the Lua script runs for all three tiers on
   every Check), at 1 and 64 calls in flight, with a ~70 B and a ~16 KB chat body; and the
   same against a sidecar in embedded mode (policy file, in-process counters) as baseline;
   and the 70 B Check of a key whose team and key also carry global quotas (day and month:
   the spoke's allowance of each checked in the same Lua call), against the same sidecar in
   the same rounds: what a global limit in force costs the hot path.
B) POST /v1/chat/completions (non-stream, max_tokens 1) through plain Envoy -> mock engine
   and through Envoy + sidecar (ext_authz + ext_proc, Redis) -> mock engine, at 1 and 64
   connections, the two paths alternated in rounds; medians are reported.

The load generators are separate processes (benchmarks/loadgen.py for gRPC, `wrk` for HTTP
when installed, else loadgen.py's raw-socket client). With two or more CPUs, the servers are
pinned to the first CPU and the load generator to the second (in A, Redis shares the load
generator's CPU so the sidecar has its core to itself). Everything listens on 127.0.0.1,
and every process is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import common
import yaml
from common import Processes, baseline_tree, git_state, pin, split_cpus
from loadgen_client import LoadGen
from redis_probe import RedisProbe
from wrk import WRK_MAX_REQUESTS, WRK_SCRIPT, run_wrk, wrk_version

from devspoke.procs import Service, free_port, redis_service, sentinel_service
from devspoke.publish import publish
from devspoke.sentinels import SERVICE, sentinel_url, wait_sentinels
from devspoke.stack import Spoke, sidecar_service, wait_ready
from gateway.policy import secrets
from testkit.check_requests import check_request
from testkit.envoys import WITHOUT_EXT_PROC, WITHOUT_GATEWAY, access_log_outcomes, envoy_without
from testkit.otlp_receiver import Receiver, otlp_receiver

HERE = Path(__file__).resolve().parent
LOOP = "127.0.0.1"
MODEL = "mock-model"
KEY_ID = "bench"
TEAM = "bench"
HUGE_RPS = 1_000_000  # never binds: each Check still runs the GCRA step in Lua
HUGE_TOKENS = 10**15  # never binds: each Check still reserves tokens in Lua
KEY_CONCURRENCY = 10_000  # through Envoy only: ext_proc releases the leases
START_TTL_S = 5.0  # the sidecar's default GATEWAY_LEASE_START_TTL_S
CONCURRENCIES = (1, 64)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"  # sampled
SMALL_BODY = b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}'
CHAT_BODY = (b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}],'
             b'"max_tokens":1,"stream":false}')


def big_body(size: int = 16 * 1024) -> bytes:
    head = b'{"model":"mock-model","messages":[{"role":"user","content":"'
    tail = b'"}]}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


@dataclass(frozen=True)
class Mode:
    name: str
    rounds: int
    warmup_s: float  # gRPC warm-up per run
    duration_s: float  # gRPC measured phase per run (bounded by max_calls too)
    max_calls: int
    http_warmup_s: float  # wrk takes whole seconds: it runs the next whole second up
    http_duration_s: float


QUICK = Mode("quick", rounds=1, warmup_s=0.05, duration_s=0.15, max_calls=20_000,
             http_warmup_s=0.05, http_duration_s=0.15)
FULL = Mode("full", rounds=3, warmup_s=1.0, duration_s=4.0, max_calls=200_000,
            http_warmup_s=1, http_duration_s=4)


@dataclass(frozen=True)
class Direct:
    name: str
    # "redis" | "embedded" | "floor" | "traced" (Redis, traces exported over OTLP)
    # | "baseline" (an older commit, Redis)
    backend: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    key: str = KEY_ID  # whose secret the Check carries


GLOBAL_KEY, GLOBAL_TEAM = "bench_global", "bench_global"  # the same limits + global quotas
GLOBAL = "direct redis global"
DIRECT = (
    Direct("direct redis 70B", "redis", SMALL_BODY),
    Direct(GLOBAL, "redis", SMALL_BODY, key=GLOBAL_KEY),
    Direct("direct floor 70B", "floor", SMALL_BODY),  # grpc.aio alone: a constant answer
    Direct("direct embedded 70B", "embedded", SMALL_BODY),
    Direct("direct redis 16KB", "redis", big_body()),
    # Tracing on and every Check sampled (the caller's traceparent says so): the worst case.
    Direct("direct redis 70B traced", "traced", SMALL_BODY, (("traceparent", TRACEPARENT),)),
    # The same primary found through three Sentinels (redis+sentinel://): DESIGN §10.
    Direct("direct sentinel 70B", "sentinel", SMALL_BODY),
)
PLAIN, FULL_PATH = "envoy plain", "envoy+sidecar"
AUTHZ_ONLY = "envoy+authz"  # ext_authz alone: what issue 2's Check adds through Envoy
# The ext_authz-only path has no ext_proc to release leases or settle reservations, so its
# key, team and model carry RPS limits only: every Check still runs GCRA on three tiers in
# one Lua call, and leaves nothing behind to settle.
AUTHZ_MODEL, AUTHZ_TEAM, AUTHZ_KEY = "authz-model", "authz_team", "authz_key"
AUTHZ_BODY = CHAT_BODY.replace(MODEL.encode(), AUTHZ_MODEL.encode())


# --------------------------------------------------------------------------- policy


def limits(concurrency: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"rps": HUGE_RPS, "tokens_per_day": HUGE_TOKENS}
    if concurrency is not None:
        out["concurrency"] = concurrency
    return out


def policy_doc(secret: str, key_concurrency: int | None,
               authz_secret: str | None = None, global_secret: str | None = None,
               ) -> dict[str, Any]:
    """Limits on the model, team and key tiers, none of which ever binds."""
    doc: dict[str, Any] = {
        "models": {MODEL: {"limits": limits()}},
        "teams": {TEAM: {"models": ["*"], "limits": limits()}},
        "keys": {KEY_ID: {"team": TEAM, "sha256": secrets.digest(secret).hex(),
                          "limits": limits(key_concurrency)}},
    }
    if global_secret is not None:
        quotas = {"tokens_per_day": HUGE_TOKENS, "tokens_per_month": HUGE_TOKENS}
        doc["teams"][GLOBAL_TEAM] = {"models": ["*"], "limits": limits(),
                                     "global_limits": quotas}
        doc["keys"][GLOBAL_KEY] = {"team": GLOBAL_TEAM, "limits": limits(key_concurrency),
                                   "global_limits": quotas,
                                   "sha256": secrets.digest(global_secret).hex()}
    if authz_secret is not None:
        rps = {"rps": HUGE_RPS}
        doc["models"][AUTHZ_MODEL] = {"limits": rps}
        doc["teams"][AUTHZ_TEAM] = {"models": [AUTHZ_MODEL], "limits": rps}
        doc["keys"][AUTHZ_KEY] = {"team": AUTHZ_TEAM, "limits": rps,
                                  "sha256": secrets.digest(authz_secret).hex()}
    return doc


def post(port: int, body: bytes, secret: str) -> tuple[int, dict[str, str], bytes]:
    """One request through an Envoy, checked before any load: (status, headers, body)."""
    req = urllib.request.Request(
        f"http://{LOOP}:{port}/v1/chat/completions", data=body, method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {secret}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


# --------------------------------------------------------------------------- results


@dataclass
class Scenario:
    name: str
    concurrency: int
    runs: list[dict[str, Any]] = field(default_factory=list)

    def _median(self, get: Any) -> float | None:
        values = [v for v in (get(r) for r in self.runs) if v is not None]
        return statistics.median(values) if values else None

    def summary(self) -> dict[str, Any]:
        procs = sorted({p for r in self.runs for p in r.get("cpu_s", {})})
        cpu_us = {p: self._median(lambda r, p=p: _per_call_us(r, p)) for p in procs}
        return {
            "scenario": self.name,
            "concurrency": self.concurrency,
            "rounds": len(self.runs),
            "calls": sum(r["calls"] for r in self.runs),
            "errors": sum(r["errors"] for r in self.runs),
            "error_kinds": _merge(r.get("error_kinds", {}) for r in self.runs),
            "first_error": next((r["first_error"] for r in self.runs if r.get("first_error")),
                                ""),
            "p50_ms": self._median(lambda r: r["latency"].get("p50_ms")),
            "p99_ms": self._median(lambda r: r["latency"].get("p99_ms")),
            "rps": self._median(lambda r: r["rps"]),
            "cpu_us_per_call": cpu_us,
            "lua_calls_per_call": self._median(lambda r: r.get("lua_calls_per_call")),
            "spans_per_call": self._median(lambda r: r.get("spans_per_call")),
            "leases_leaked": sum(r.get("leases_leaked", 0) for r in self.runs),
            "loadgen_cpu_pct": self._median(
                lambda r: 100 * r["loadgen_cpu_s"] / r["elapsed_s"] if r["elapsed_s"] else None),
            "per_round": [{"p50_ms": r["latency"].get("p50_ms"),
                           "p99_ms": r["latency"].get("p99_ms"),
                           "rps": r["rps"], "calls": r["calls"], "errors": r["errors"]}
                          for r in self.runs],
        }


def _per_call_us(run: dict[str, Any], proc: str) -> float | None:
    cpu = run.get("cpu_s", {}).get(proc)
    return None if cpu is None or not run["calls"] else cpu / run["calls"] * 1e6


def _merge(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'scenario':<20} {'c':>3} {'calls':>6} {'err':>3} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'req/s':>6} {'sidecar µs/req':>14}  {'other cpu µs/req':<27} {'lua/req':>7} "
            f"{'lg cpu%':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        cpu = r["cpu_us_per_call"]
        other = " ".join(f"{p} {cpu[p]:.0f}" for p in ("envoy", "engine", "redis", "kafka")
                         if cpu.get(p) is not None)
        lines.append(
            f"{r['scenario']:<20} {r['concurrency']:>3} {r['calls']:>6} {r['errors']:>3} "
            f"{_fmt(r['p50_ms'], '.3f'):>7} {_fmt(r['p99_ms'], '.3f'):>7} "
            f"{_fmt(r['rps'], '.0f'):>6} {_fmt(cpu.get('sidecar'), '.0f'):>14}  {other:<27} "
            f"{_fmt(r['lua_calls_per_call'], '.2f'):>7} {_fmt(r['loadgen_cpu_pct'], '.0f'):>7}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run


class Bench:
    def __init__(self, mode: Mode, workdir: Path, http_client: str, pin_cpus: bool,
                 kafka: bool = False, baseline: str | None = None) -> None:
        self.mode = mode
        self.baseline = baseline  # a git revision whose sidecar runs beside this one
        self.kafka = kafka
        self.workdir = workdir
        self.procs = Processes()
        self.spoke: Spoke | None = None
        self.loadgen: LoadGen | None = None
        self.secret = secrets.new_secret(KEY_ID)
        self.authz_secret = secrets.new_secret(AUTHZ_KEY)
        self.global_secret = secrets.new_secret(GLOBAL_KEY)
        self.scenarios: dict[tuple[str, int], Scenario] = {}
        self.notes: list[str] = []
        self.leases_leaked = 0
        self.stack = contextlib.ExitStack()
        self.spans = Receiver()
        self.access_log: dict[str, dict[str, int]] = {}
        self.loadavg_start = os.getloadavg()
        self.server_cpus, self.load_cpus = split_cpus(pin_cpus)
        if http_client == "auto":
            http_client = "wrk" if shutil.which("wrk") else "python"
        if http_client == "wrk" and not shutil.which("wrk"):
            raise SystemExit("--http-client wrk: wrk is not on PATH (apt-get install wrk)")
        self.http_client = http_client

    # -- helpers

    def scenario(self, name: str, conc: int) -> Scenario:
        return self.scenarios.setdefault((name, conc), Scenario(name, conc))

    def sink_env(self, name: str) -> dict[str, str]:
        """Usage spool and JSONL sink inside the workdir (their defaults are relative to cwd)."""
        return {"GATEWAY_SPOOL_DIR": str(self.workdir / f"spool-{name}"),
                "GATEWAY_USAGE_JSONL": str(self.workdir / f"usage-{name}.jsonl")}

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  ! {text}", flush=True)

    def record(self, name: str, conc: int, result: dict[str, Any]) -> None:
        self.scenario(name, conc).runs.append(result)
        lat = result["latency"]
        print(f"  {name:<22} c={conc:<3} {result['calls']:>7} calls  "
              f"p50 {lat.get('p50_ms', 0):7.3f} ms  p99 {lat.get('p99_ms', 0):7.3f} ms  "
              f"{result['rps']:8.0f}/s  errors {result['errors']}", flush=True)
        if result.get("warmup_errors"):
            self.note(f"{name} c={conc}: {result['warmup_errors']} errors in warm-up, first: "
                      f"{result['warmup_first_error']}")
        if result["errors"]:
            self.note(f"{name} c={conc}: {result['errors']} errors {result['error_kinds']}, "
                      f"first: {result['first_error']}")
        if result.get("leases_leaked"):
            self.note(f"{name} c={conc}: {result['leases_leaked']} concurrency leases still "
                      f"held {START_TTL_S:g}+ s after the run (admitted, never released)")
        if result.get("capped"):
            self.note(f"{name} c={conc}: stopped by the call-count cap, not the time bound")

    # -- A: direct Check

    def direct(self) -> None:
        mode = self.mode
        print("A) direct gRPC Check", flush=True)
        redis = self.procs.start(redis_service(free_port(), self.workdir), self.load_cpus)
        redis_url = f"redis://{redis.address}/0"
        # A healthy Sentinel setup around that primary (every Redis row has its replica):
        # the "sentinel" sidecar finds the primary through the Sentinels.
        watchers = {"redis": redis, "redis-replica": self.procs.start(redis_service(
            free_port(), self.workdir, replica_of=redis.address), self.load_cpus)}
        for i in range(3):
            watchers[f"sentinel-{i}"] = self.procs.start(sentinel_service(
                free_port(), self.workdir, SERVICE, redis.address), self.load_cpus)
        # no ext_proc here to free leases
        doc = policy_doc(self.secret, key_concurrency=None, global_secret=self.global_secret)
        publish(redis_url, doc, "bench")
        policy_file = self.workdir / "policy-embedded.yaml"
        policy_file.write_text(yaml.safe_dump(doc))
        # Direct Checks admit requests that never end (no Envoy, no record): past their
        # lease the sweep would bill tens of thousands of orphans during the run, which the
        # baseline before heartbeats (renewing them forever) never did. Not what A measures.
        common = {"GATEWAY_LOG_LEVEL": "warning", "GATEWAY_WORKERS": "1",
                  "GATEWAY_ORPHAN_GRACE_MS": str(3_600_000)}
        sidecars: dict[str, tuple[Service, int]] = {}
        collector, self.spans = self.stack.enter_context(otlp_receiver())
        backends: list[tuple[str, dict[str, str]]] = [
            ("redis", {"GATEWAY_REDIS_URL": redis_url}),
            ("embedded", {"GATEWAY_REDIS_URL": "", "GATEWAY_POLICY_FILE": str(policy_file)}),
            ("sentinel", {"GATEWAY_REDIS_URL": sentinel_url(watchers)}),
            ("traced", {"GATEWAY_REDIS_URL": redis_url, "OTEL_TRACES_EXPORTER": "otlp",
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{collector}"}),
        ]
        if self.baseline:
            # The older commit's package first on sys.path (PYTHONSAFEPATH: not the cwd's).
            base = baseline_tree(self.baseline, self.workdir / "baseline")
            self.note(f"baseline: {self.baseline} = {base.describe}")
            # Its own database, with the policy it can read (no global_limits before those)
            base_url = f"redis://{redis.address}/1"
            publish(base_url, policy_doc(self.secret, key_concurrency=None), "bench")
            backends.append(("baseline", {"GATEWAY_REDIS_URL": base_url, **base.env}))
        for backend, env in backends:
            metrics_port = free_port()
            env |= self.sink_env(backend)
            svc = sidecar_service(free_port(), metrics_port, self.workdir, {**common, **env})
            svc.name = f"sidecar-{backend}"
            sidecars[backend] = (svc, metrics_port)
        # started together: each start waits for its own port, and those waits overlap
        self.procs.start_all([svc for svc, _ in sidecars.values()], self.server_cpus)
        # The Sentinels meet (hello messages every 2 s) while the sidecars start: the sentinel
        # sidecar needs only the primary, which every Sentinel is configured with.
        wait_sentinels(watchers)
        for _, metrics_port in sidecars.values():
            wait_ready(f"http://{LOOP}:{metrics_port}")
        floor_port = free_port()
        floor = Service("floor", [sys.executable, str(HERE / "floor_server.py"), str(floor_port)],
                        floor_port, self.workdir)
        sidecars["floor"] = (self.procs.start(floor, self.server_cpus), 0)

        marker = str(uuid.uuid4())
        secret = {KEY_ID: self.secret, GLOBAL_KEY: self.global_secret}
        templates = {d.name: base64.b64encode(
            check_request(secret[d.key], body=d.body, request_id=marker,
                          extra_headers=dict(d.headers)).SerializeToString()
        ).decode() for d in self.direct_scenarios()}
        assert self.loadgen is not None
        probe = RedisProbe(redis_url, KEY_ID, START_TTL_S)
        for rnd in range(mode.rounds):
            scenarios = self.direct_scenarios()
            order = scenarios if rnd % 2 == 0 else scenarios[::-1]
            for conc in CONCURRENCIES:
                for d in order:
                    svc, _ = sidecars[d.backend]
                    pids = {"sidecar": svc.pid}
                    if d.backend not in ("embedded", "floor"):
                        pids["redis"] = redis.pid
                    spans0 = len(self.spans.spans)
                    job = {"kind": "grpc", "target": svc.address, "marker": marker,
                           "template_b64": templates[d.name], "concurrency": conc,
                           "warmup_s": mode.warmup_s, "duration_s": mode.duration_s,
                           "max_calls": mode.max_calls, "cpu_pids": pids}
                    timeout = mode.warmup_s + mode.duration_s + 60
                    lua0 = probe.lua_calls()
                    result = self.loadgen.run(job, timeout)
                    if d.backend not in ("embedded", "floor"):  # batches span warm-up too
                        checks = result["calls"] + result["warmup_calls"]
                        result["lua_calls_per_call"] = (probe.lua_calls() - lua0) / max(checks, 1)
                    if d.backend == "traced":  # spans exported by the time the run ends
                        result["spans_per_call"] = (len(self.spans.spans) - spans0) / max(
                            result["calls"] + result["warmup_calls"], 1)
                    self.record(d.name, conc, result)
        probe.close()
        for svc, _ in sidecars.values():
            svc.stop()
        for svc in reversed(watchers.values()):  # Sentinels first: no failover at the end
            svc.stop()

    def direct_scenarios(self) -> tuple[Direct, ...]:
        if not self.baseline:
            return DIRECT
        return (*DIRECT, Direct(f"direct redis 70B @{self.baseline}", "baseline", SMALL_BODY))

    # -- B: through Envoy

    def through_envoy(self) -> None:
        mode = self.mode
        print(f"B) through Envoy (HTTP client: {self.http_client})", flush=True)
        self.spoke = Spoke(workdir=self.workdir / "spoke", listen_port=free_port(),
                           engine_ttft_ms=0, engine_tokens_per_s=0, kafka=self.kafka,
                           sidecar_env={"GATEWAY_LOG_LEVEL": "warning", "GATEWAY_WORKERS": "1",
                                        **self.sink_env("spoke")})
        self.spoke.start()
        for svc in self.spoke.services.values():
            pin(svc.pid, self.server_cpus)
        self.spoke.publish(policy_doc(self.secret, key_concurrency=KEY_CONCURRENCY,
                                      authz_secret=self.authz_secret), "bench")
        self.spoke.wait_ready()

        engine, sidecar = self.spoke["engine"], self.spoke["sidecar"]
        envoys = {FULL_PATH: self.spoke["envoy"]}
        ports = {FULL_PATH: self.spoke.listen_port}
        # The same rendered bootstrap without both ext filters (plain), or without ext_proc.
        for path, drop in ((PLAIN, WITHOUT_GATEWAY), (AUTHZ_ONLY, WITHOUT_EXT_PROC)):
            envoy = envoy_without(drop, sidecar.address, engine.address, self.workdir,
                                  f"envoy-{path.replace(' ', '-').replace('+', '-')}")
            envoys[path], ports[path] = envoy, envoy.port
        self.procs.start_all([envoys[PLAIN], envoys[AUTHZ_ONLY]], self.server_cpus)

        bodies = {PLAIN: CHAT_BODY, FULL_PATH: CHAT_BODY, AUTHZ_ONLY: AUTHZ_BODY}
        keys = {PLAIN: self.secret, FULL_PATH: self.secret, AUTHZ_ONLY: self.authz_secret}
        for path, port in ports.items():  # one request each, checked before any load
            status, headers, body = post(port, bodies[path], keys[path])
            if status != 200:
                raise RuntimeError(f"{path}: sanity request got {status}: {body[:500]!r}")
            via_sidecar = any(h.startswith("x-ratelimit") for h in headers)
            if via_sidecar != (path != PLAIN):
                raise RuntimeError(f"{path}: rate-limit headers {'' if via_sidecar else 'not '}"
                                   f"present; the path is not what it claims: {headers}")

        scripts, requests = {}, {}
        for path in ports:
            scripts[path] = self.workdir / f"bench-{len(scripts)}.lua"
            scripts[path].write_text(WRK_SCRIPT.format(
                body=bodies[path].decode(), secret=keys[path], max_requests=WRK_MAX_REQUESTS))
            requests[path] = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {LOOP}\r\n"
                f"Content-Type: application/json\r\nAuthorization: Bearer {keys[path]}\r\n"
                f"Content-Length: {len(bodies[path])}\r\n\r\n").encode() + bodies[path]
        paths = (PLAIN, AUTHZ_ONLY, FULL_PATH)
        probe = RedisProbe(self.spoke.redis_url, KEY_ID, START_TTL_S)
        try:
            for rnd in range(mode.rounds):
                for conc in CONCURRENCIES:
                    for path in paths if rnd % 2 == 0 else paths[::-1]:
                        pids = {"envoy": envoys[path].pid, "engine": engine.pid}
                        if path != PLAIN:
                            pids |= {name: svc.pid for name, svc in self.spoke.services.items()
                                     if name in ("sidecar", "redis", "kafka")}
                        result = self._http(scripts[path], requests[path], ports[path], conc,
                                            pids, probe if path != PLAIN else None)
                        self.record(path, conc, result)
        finally:
            probe.close()
        for path, envoy in envoys.items():
            self.access_log[path] = access_log_outcomes(envoy.log_path)
            odd = {k: v for k, v in self.access_log[path].items()
                   if not k.startswith("200 ") and "downstream_remote_disconnect" not in k}
            if odd:
                self.note(f"{path}: Envoy access log outcomes other than 200: {odd}")

    def _http(self, script: Path, request: bytes, port: int, conc: int,
              pids: dict[str, int | None], probe: RedisProbe | None) -> dict[str, Any]:
        """Warm-up, then the measured run; with `probe`, count Lua calls and leaked leases."""
        mode = self.mode
        if self.http_client == "wrk":
            run_wrk(script, port, conc, math.ceil(mode.http_warmup_s), self.load_cpus, {})
            leases0 = probe.live_leases() if probe else 0
            lua0 = probe.lua_calls() if probe else 0
            result = run_wrk(script, port, conc, math.ceil(mode.http_duration_s), self.load_cpus,
                             pids)
            requests = result["calls"]
        else:
            assert self.loadgen is not None
            job = {"kind": "http", "host": LOOP, "port": port,
                   "request_b64": base64.b64encode(request).decode(), "concurrency": conc,
                   "warmup_s": mode.http_warmup_s, "duration_s": mode.http_duration_s,
                   "max_calls": mode.max_calls,
                   "cpu_pids": {k: v for k, v in pids.items() if v}}
            leases0 = probe.live_leases() if probe else 0
            lua0 = probe.lua_calls() if probe else 0
            result = self.loadgen.run(job, mode.http_warmup_s + mode.http_duration_s + 60)
            requests = result["calls"] + result["warmup_calls"]
        if probe is not None:
            result["lua_calls_per_call"] = (probe.lua_calls() - lua0) / max(requests, 1)
            result["leases_leaked"] = max(0, probe.live_leases() - leases0)
            self.leases_leaked += result["leases_leaked"]
        return result

    # -- lifecycle

    def run(self) -> None:
        self.loadgen = LoadGen(self.load_cpus, self.workdir / "loadgen.log")
        self.direct()
        self.through_envoy()

    def stop(self) -> None:
        if self.loadgen is not None:
            self.loadgen.close()
        self.stack.close()
        if self.spoke is not None:
            self.spoke.stop()
        self.procs.stop()

    # -- report

    def report(self) -> dict[str, Any]:
        rows = [s.summary() for s in self.scenarios.values()]
        by = {(r["scenario"], r["concurrency"]): r for r in rows}

        def get(name: str, conc: int, what: str) -> float | None:
            row = by.get((name, conc))
            return None if row is None else row.get(what)

        def diff(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a - b

        def ratio(a: float | None, b: float | None) -> float | None:
            return None if a is None or not b else a / b

        def sidecar_cpu(name: str, conc: int) -> float | None:
            return (by.get((name, conc)) or {}).get("cpu_us_per_call", {}).get("sidecar")

        derived: dict[str, Any] = {}
        if self.baseline:
            base = f"direct redis 70B @{self.baseline}"
            for c in CONCURRENCIES:
                derived[f"baseline_cpu_ratio_c{c}"] = ratio(
                    sidecar_cpu("direct redis 70B", c), sidecar_cpu(base, c))
                derived[f"baseline_rps_ratio_c{c}"] = ratio(get("direct redis 70B", c, "rps"),
                                                            get(base, c, "rps"))
        for c in CONCURRENCIES:
            for prefix, path in (("envoy", FULL_PATH), ("authz", AUTHZ_ONLY)):
                for q in ("p50", "p99"):
                    derived[f"{prefix}_added_{q}_ms_c{c}"] = diff(
                        get(path, c, f"{q}_ms"), get(PLAIN, c, f"{q}_ms"))
                derived[f"{prefix}_rps_ratio_c{c}"] = ratio(get(path, c, "rps"),
                                                            get(PLAIN, c, "rps"))
            derived[f"redis_admission_added_p50_ms_c{c}"] = diff(
                get("direct redis 70B", c, "p50_ms"), get("direct embedded 70B", c, "p50_ms"))
        red64 = by.get(("direct redis 70B", 64))
        derived["redis_checks_per_s_per_process_c64"] = red64["rps"] if red64 else None
        cpu64 = red64["cpu_us_per_call"].get("sidecar") if red64 else None
        derived["redis_sidecar_cpu_us_per_check_c64"] = cpu64
        derived["redis_checks_per_s_per_core_from_cpu_c64"] = 1e6 / cpu64 if cpu64 else None
        floor64 = by.get(("direct floor 70B", 64))
        derived["floor_cpu_us_per_check_c64"] = (
            floor64["cpu_us_per_call"].get("sidecar") if floor64 else None)
        derived["floor_checks_per_s_c64"] = floor64["rps"] if floor64 else None
        for c in CONCURRENCIES:
            derived[f"global_cpu_ratio_c{c}"] = ratio(
                sidecar_cpu(GLOBAL, c), sidecar_cpu("direct redis 70B", c))
            derived[f"global_redis_cpu_ratio_c{c}"] = ratio(
                ((by.get((GLOBAL, c)) or {}).get("cpu_us_per_call") or {}).get("redis"),
                ((by.get(("direct redis 70B", c)) or {}).get("cpu_us_per_call") or {}).get(
                    "redis"))
            derived[f"global_rps_ratio_c{c}"] = ratio(get(GLOBAL, c, "rps"),
                                                      get("direct redis 70B", c, "rps"))
            derived[f"traced_cpu_ratio_c{c}"] = ratio(
                sidecar_cpu("direct redis 70B traced", c), sidecar_cpu("direct redis 70B", c))
            traced = by.get(("direct redis 70B traced", c))
            derived[f"traced_spans_per_check_c{c}"] = traced["spans_per_call"] if traced else None
        for c in CONCURRENCIES:
            derived[f"sentinel_cpu_ratio_c{c}"] = ratio(
                sidecar_cpu("direct sentinel 70B", c), sidecar_cpu("direct redis 70B", c))
            derived[f"sentinel_added_p50_ms_c{c}"] = diff(
                get("direct sentinel 70B", c, "p50_ms"), get("direct redis 70B", c, "p50_ms"))
        derived["leases_leaked_through_envoy"] = self.leases_leaked
        derived["baseline"] = self.baseline
        return {"rows": rows, "derived": derived}


def derived_lines(d: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:+.3f} ms"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    def n(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    return "\n".join([
        f"added by ext_authz alone through Envoy, c=1:  p50 {ms(d['authz_added_p50_ms_c1'])}, "
        f"p99 {ms(d['authz_added_p99_ms_c1'])}",
        f"added by ext_authz alone through Envoy, c=64: p50 {ms(d['authz_added_p50_ms_c64'])}, "
        f"p99 {ms(d['authz_added_p99_ms_c64'])}",
        f"req/s ratio envoy+authz / envoy plain:  c=1 {x(d['authz_rps_ratio_c1'])}, "
        f"c=64 {x(d['authz_rps_ratio_c64'])}",
        f"added by the sidecar through Envoy, c=1:  p50 {ms(d['envoy_added_p50_ms_c1'])}, "
        f"p99 {ms(d['envoy_added_p99_ms_c1'])}",
        f"added by the sidecar through Envoy, c=64: p50 {ms(d['envoy_added_p50_ms_c64'])}, "
        f"p99 {ms(d['envoy_added_p99_ms_c64'])}",
        f"req/s ratio envoy+sidecar / envoy plain:  c=1 {x(d['envoy_rps_ratio_c1'])}, "
        f"c=64 {x(d['envoy_rps_ratio_c64'])}",
        f"checks/s per sidecar process at c=64 with Redis: "
        f"{n(d['redis_checks_per_s_per_process_c64'])} measured; "
        f"{n(d['redis_checks_per_s_per_core_from_cpu_c64'])} per fully-busy core "
        f"(from {n(d['redis_sidecar_cpu_us_per_check_c64'])} µs CPU/check)",
        f"grpc.aio floor (constant answer) at c=64: {n(d['floor_checks_per_s_c64'])} checks/s, "
        f"{n(d['floor_cpu_us_per_check_c64'])} µs CPU/check",
        f"Redis admission vs embedded, direct p50: c=1 "
        f"{ms(d['redis_admission_added_p50_ms_c1'])}, "
        f"c=64 {ms(d['redis_admission_added_p50_ms_c64'])}",
        f"tracing on, every Check sampled and exported over OTLP: sidecar CPU/check "
        f"c=1 {x(d['traced_cpu_ratio_c1'])}, c=64 {x(d['traced_cpu_ratio_c64'])} of untraced "
        f"(spans exported per Check: {_fmt(d['traced_spans_per_check_c64'], '.2f')} at c=64)",
        f"global quotas in force (team and key, day and month), direct Redis Check: sidecar "
        f"CPU/check c=1 {x(d['global_cpu_ratio_c1'])}, c=64 {x(d['global_cpu_ratio_c64'])}; "
        f"Redis CPU/check c=1 {x(d['global_redis_cpu_ratio_c1'])}, "
        f"c=64 {x(d['global_redis_cpu_ratio_c64'])}; req/s c=1 {x(d['global_rps_ratio_c1'])}, "
        f"c=64 {x(d['global_rps_ratio_c64'])} of the same Check without",
        f"Sentinel URL vs plain URL to the same primary, direct Check: sidecar CPU/check "
        f"c=1 {x(d['sentinel_cpu_ratio_c1'])}, c=64 {x(d['sentinel_cpu_ratio_c64'])}; p50 "
        f"c=1 {ms(d['sentinel_added_p50_ms_c1'])}, c=64 {ms(d['sentinel_added_p50_ms_c64'])}",
        *([f"this code vs baseline {d['baseline']}, direct Redis Check: sidecar CPU/check "
           f"c=1 {x(d['baseline_cpu_ratio_c1'])}, c=64 {x(d['baseline_cpu_ratio_c64'])}; "
           f"req/s c=1 {x(d['baseline_rps_ratio_c1'])}, c=64 {x(d['baseline_rps_ratio_c64'])}"]
          if d.get("baseline") else []),
        f"concurrency leases still held 5 s after the measured Envoy runs (should be 0): "
        f"{d['leases_leaked_through_envoy']}",
    ])


def machine_info(bench: Bench) -> dict[str, Any]:
    return common.machine_info(
        loadavg_start=bench.loadavg_start, loadavg_end=os.getloadavg(),
        server_cpus=sorted(bench.server_cpus) if bench.server_cpus else None,
        load_cpus=sorted(bench.load_cpus) if bench.load_cpus else None,
        http_client=bench.http_client, wrk=wrk_version())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test, under a minute")
    parser.add_argument("--out", default=str(HERE / "results" / "authz.json"))
    parser.add_argument("--http-client", choices=["auto", "wrk", "python"], default="auto",
                        help="load generator for the Envoy scenarios (auto: wrk if installed)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run this git revision's sidecar (direct, Redis) in the same "
                             "rounds, and report this code's CPU and req/s against it")
    parser.add_argument("--kafka", action="store_true",
                        help="B: let the Spoke run its Kafka broker (default: JSONL usage sink)")
    parser.add_argument("--keep-workdir", action="store_true",
                        help="keep the logs and configs (always kept on failure)")
    args = parser.parse_args()
    mode = QUICK if args.quick else FULL

    def interrupted(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)

    workdir = Path(tempfile.mkdtemp(prefix="bench-authz-"))
    bench = Bench(mode, workdir, args.http_client, pin_cpus=not args.no_pin, kafka=args.kafka,
                  baseline=args.baseline)
    started = datetime.now(UTC)
    t0 = time.monotonic()
    print(f"bench_authz: {mode.name} mode, {mode.rounds} round(s), workdir {workdir}", flush=True)
    ok = False
    try:
        bench.run()
        ok = True
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process", file=sys.stderr)
    finally:
        bench.stop()
        if ok and not args.keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs and configs kept in {workdir}", file=sys.stderr)
    if not ok:
        return 130

    report = bench.report()
    print()
    print(table(report["rows"]))
    print()
    print(derived_lines(report["derived"]))
    for text in bench.notes:
        print(f"note: {text}")
    doc = {
        "benchmark": "bench_authz",
        "mode": mode.name,
        "timestamp": started.isoformat(),
        "wall_s": round(time.monotonic() - t0, 1),
        "machine": machine_info(bench),
        "git": git_state(),
        "config": {**mode.__dict__, "concurrencies": CONCURRENCIES,
                   "direct_bodies": {d.name: len(d.body) for d in DIRECT},
                   "chat_body_bytes": len(CHAT_BODY),
                   "limits": {"rps": HUGE_RPS, "tokens_per_day": HUGE_TOKENS,
                              "key_concurrency_through_envoy": KEY_CONCURRENCY}},
        "scenarios": report["rows"],
        "envoy_access_log": bench.access_log,
        "derived": report["derived"],
        "notes": bench.notes,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
