"""Where the latency the gateway adds at c=1 goes: one client, one request at a time.

    .venv/bin/python benchmarks/bench_latency.py [--requests 300] [--rounds 3] [--no-pin]
        [--floor] [--door-times] [--drop lua,json_to_metadata,records] [--no-limits]
        [--sidecar-apart] [--redis-with-gateway] [--admit-ahead-ms 250]
        [--door-workers 1 [--door-cpu free|same|other]] [--records-flush-ms 50]
        [--envoy-workers 1] [--baseline REV]

Paths, interleaved per round (A B C D, then D C B A), chat with max_tokens 8 and an engine
that answers at once, each over one keep-alive raw-socket connection:
* `plain`: testkit.envoys.envoy_without (no ext_authz, no ext_proc);
* `spoke`: the reference config (Envoy-fed metering, the Check through the HTTP door) with
  the key `bench`, admitted in Redis on three tiers (limits too high to trip, as
  bench_capacity's key; `--no-limits`: none);
* `spoke_free`: the same spoke, a key with no limits anywhere (its Check never waits);
* `door_allow`, `door_free`, `door_401`: the HTTP door asked directly, as Envoy asks it;
* with `--floor`, the ladder from plain Envoy to the spoke, each an Envoy of the reference
  config with no records, its ext_authz asking benchmarks/ok_server.py (uvloop): `floor`
  (ext_authz + router, a constant `200 OK`: Envoy + any ext_authz over HTTP),
  `floor_answer` (the same, the answer a real allowed Check of `bench` gave: its headers
  and metadata), `floor_lua` (+ the Lua filter), `floor_chain` (+ json_to_metadata: the
  whole chain). Each step's p50 minus the one before is what that part adds.
* with `--door-workers N`, `doors` and `doors_free`: a second whole spoke, its sidecar with
  GATEWAY_DOOR_WORKERS=N (the Check in processes of its own, away from the records).
* with `--baseline REV`, `base` and `base_free`: a second whole spoke (Redis of its own, the
  same Envoy config) whose sidecar runs REV's code (`git archive`), pinned as the spoke's:
  an A/B of a sidecar change in one run, interleaved with the rest. The `door_*` paths are
  then left out: they would load the spoke's sidecar and Redis only.

Printed per path: p50/p90/p99 and CPU µs a request of its Envoy and of the sidecar
(schedstat, all threads, 60 ms after each series for the records). The Envoys log, from a
request's first byte (µs): `authz_us` (the Check as ext_authz saw it), `to_engine_us`,
`first_byte_us` (the engine's first byte back), `tx_end_us` (the last byte to the client);
their medians are printed. Also: Redis's own µs per command (INFO commandstats), the door
cluster's connection counters, and with `--door-times` the door's own time per Check, from
its request's read to its answer's write (benchmarks/door_timing, patched in at import),
beside the sidecar's records batches (records each, µs reading them), settles and renewals;
the spoke's slowest 1 % of requests joined to their Checks by request id (where their time
went, and how many met a records batch being read or a settle/renewal in Redis); and Redis's
SLOWLOG (over 200 µs) by script. The `door_allow` path's Checks are admitted and never
ended (no Envoy, no record): they stay live and are renewed (~320 ids a renewal) until their
lease runs out, which a real c=1 spoke never has.

Placement (2+ CPUs, unless --no-pin): the Envoys, the sidecar and the floor servers on CPU
0; the client, the engine, Redis and Tansu on CPU 1 (`--sidecar-apart`: the sidecar on 1;
`--redis-with-gateway`: Redis on 0). `--drop` removes filters from the spoke's chain (by a
part of their names; `records`: its OpenTelemetry access log, so no records, settles,
spool or Kafka). `--records-flush-ms`: how often the spoke's Envoy (and the `doors` spoke's)
sends its records (default: `gateway envoy-config`'s, 50 ms); to compare settings,
alternate whole runs (docs/benchmarks.md, "2026-12-06: a shorter records flush").
`--envoy-workers N`: every Envoy of the run (plain, the spokes', the floor's) runs N worker
threads (`--concurrency N`; default 1, what every run before measured).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import yaml
from common import (
    DOOR_CPU,
    baseline_tree,
    envoy_flags,
    envoy_stats,
    pin,
    pin_sidecar,
    tree_sched_ns,
)

from devspoke.envoy_proc import envoy_service
from devspoke.procs import Service, free_port
from devspoke.stack import Spoke
from gateway.envoy_contract import RECORDS_FLUSH_MS
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from gateway.policy import secrets
from testkit.envoys import WITHOUT_GATEWAY, envoy_without

MODEL = "mock-model"
FREE_MODEL = "mock-free"
BODY = orjson.dumps({"model": MODEL, "max_tokens": 8,
                     "messages": [{"role": "user", "content": "classify: the sky is blue"}]})
FIELDS = {  # access log field -> Envoy's format string
    "authz_us": "%FILTER_STATE(envoy.filters.http.ext_authz:FIELD:latency_us)%",
    "to_engine_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "first_byte_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%",
    "tx_end_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
}
GATEWAY_CPU, OTHER_CPU = 0, 1
RID = "0b6a9a48-cd1b-4bb4-9a1c-6d1d9a1f0e11"  # replaced by a fresh one in each door request


def spoke_config(drop: list[str], flush_s: float = RECORDS_FLUSH_MS / 1e3) -> Any:
    def config(ports: EnvoyPorts, metering: Any) -> str:
        doc = yaml.safe_load(render(ports, metering=metering, records_flush_s=flush_s))
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        tc = hcm["typed_config"]
        tc["http_filters"] = [f for f in tc["http_filters"]
                              if not any(d in f["name"] for d in drop)]
        if "records" in drop:  # no records to the sidecar: no settle, spool, Kafka
            tc["access_log"] = [a for a in tc["access_log"] if a["name"].endswith("stdout")]
        for f in tc["http_filters"]:
            if f["name"] == "envoy.filters.http.ext_authz":
                f["typed_config"]["emit_filter_state_stats"] = True
        stdout = next(a for a in tc["access_log"] if a["name"].endswith("stdout"))
        stdout["typed_config"]["log_format"]["json_format"].update(
            FIELDS, start_s="%START_TIME(%s.%6f)%")  # to set beside the door's times
        return yaml.safe_dump(doc, sort_keys=False)
    return config


def floor_config(ports: EnvoyPorts, ok_port: int, keep: tuple[str, ...]) -> str:
    """The reference config with its ext_authz asking a constant-answer server
    (benchmarks/ok_server.py) on `ok_port`, no records (no OpenTelemetry access log), and
    of its HTTP filters only ext_authz, the router and `keep` (lua, json_to_metadata)."""
    doc = yaml.safe_load(render(ports, metering="envoy"))
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    tc = hcm["typed_config"]
    tc["http_filters"] = [f for f in tc["http_filters"]
                          if f["name"].endswith(("ext_authz", "router", *keep))]
    for f in tc["http_filters"]:
        if f["name"].endswith("ext_authz"):
            f["typed_config"]["emit_filter_state_stats"] = True
    tc["access_log"] = [a for a in tc["access_log"] if a["name"].endswith("stdout")]
    tc["access_log"][0]["typed_config"]["log_format"]["json_format"].update(FIELDS)
    for c in doc["static_resources"]["clusters"]:
        if c["name"] == "sidecar_authz_http":
            sa = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            sa["address"]["socket_address"]["port_value"] = ok_port
    return yaml.safe_dump(doc, sort_keys=False)


def floor_envoy(engine: str, ok_port: int, keep: tuple[str, ...], workdir: Path,
                name: str, workers: int = 1) -> Service:
    port, admin = free_port(), free_port()
    ports = EnvoyPorts(listen=f"127.0.0.1:{port}", engine=engine, admin=f"127.0.0.1:{admin}")
    svc = envoy_service(floor_config(ports, ok_port, keep), admin, port, workdir,
                        concurrency=workers)
    svc.name = name
    return svc


def cluster_stats(svc: Service, cluster: str) -> dict[str, int]:
    """A few of Envoy's counters for `cluster` (is the connection reused?)."""
    admin = getattr(svc, "admin_port", None)
    if admin is None:
        return {}
    want = ("upstream_cx_total", "upstream_rq_total", "upstream_cx_destroy",
            "upstream_cx_destroy_remote", "upstream_rq_pending_total")
    stats = envoy_stats(admin, f"cluster.{cluster}.", timeout=2)
    return {k: v for k, v in stats.items() if k in want}


def door_lines(path: Path) -> dict[str, list[list[str]]]:
    """benchmarks/door_timing's lines (--door-times), by kind: check, export, settle, renew."""
    by: dict[str, list[list[str]]] = defaultdict(list)
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            kind, *rest = line.split()
            by[kind].append(rest)
    return by


def door_medians(lines: dict[str, list[list[str]]]) -> dict[str, str]:
    """The door's own times by who asked and whether Redis admitted; and the sidecar's
    records batches (records each, µs holding the loop) and store calls."""
    by: dict[str, list[float]] = defaultdict(list)
    for who, leased, us, *_ in lines["check"]:
        by[f"{who}{' admitted' if leased == '1' else ''}"].append(float(us))
    for kind, at in (("export records", 0), ("export µs reading", 1), ("settle ends", 0),
                     ("settle µs", 1), ("renew ids", 0), ("renew µs", 1)):
        by[kind] = [float(x[at]) for x in lines[kind.split()[0]]]
    for gen in ("0", "1", "2"):
        by[f"gc{gen} µs"] = [float(us) for g, us, *_ in lines["gc"] if g == gen]
        # objects found unreachable (cyclic garbage) by that generation's collections
        by[f"gc{gen} collected"] = [float(x[3]) for x in lines["gc"] if x[0] == gen and len(x) > 3]
    return {k: f"p50 {statistics.median(v):.0f} p90 {pct(v, .9):.0f} p99 {pct(v, .99):.0f} "
               f"(n={len(v)})" for k, v in sorted(by.items()) if v}


def tail_report(envoy_log: Path, lines: dict[str, list[list[str]]]) -> None:
    """The spoke's slowest 1 % of requests (Envoy's tx_end_us) against all of them, each
    joined to its Check in the door by request id: where the extra time went (µs, medians)
    and how many overlapped a records batch being read (from Envoy's first byte to the
    door's answer), or a settle or renewal in Redis (while the door waited). Then the
    Checks that met a batch against the others of the same run (Envoy's authz_us): what a
    batch costs the Check that meets it, whatever else disturbs the run."""
    checks = {rid: (float(us), float(wall), leased)
              for _, leased, us, wall, rid in lines["check"]}
    exports = [(float(w), float(w) + float(h) / 1e6) for _, h, _, w in lines["export"]]
    store = [(float(w), float(w) + float(us) / 1e6)
             for kind in ("settle", "renew") for _, us, w in lines[kind]]
    collections = [(float(w), float(w) + float(us) / 1e6) for _, us, w, *_ in lines["gc"]]
    rows = []
    for line in envoy_log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            e = orjson.loads(line)
            door_us, read, leased = checks[e["request_id"]]
            start, authz, total = float(e["start_s"]), float(e["authz_us"]), float(e["tx_end_us"])
            before = (read - start) * 1e6  # Envoy's first byte to the door's read
            rows.append({
                "tx_end": total, "authz": authz, "to_read": before, "door": door_us,
                "after_door": authz - before - door_us, "after_authz": total - authz,
                "leased": leased,
                "export": any(a < read + door_us / 1e6 and b > start for a, b in exports),
                "store": any(a < read + door_us / 1e6 and b > read for a, b in store),
                "gc": any(a < read + door_us / 1e6 and b > start for a, b in collections)})
    if len(rows) < 100:
        print("tail: too few requests joined", len(rows))
        return
    rows.sort(key=lambda r: r["tx_end"])
    for name, part in (("all", rows), ("slowest 1%", rows[-max(1, len(rows) // 100):])):
        med = {k: round(statistics.median(r[k] for r in part))
               for k in ("tx_end", "authz", "to_read", "door", "after_door", "after_authz")}
        print(f"tail, {name} (n={len(part)}): medians µs {med}; overlapping a records "
              f"batch being read {sum(r['export'] for r in part) / len(part):.0%}, "
              f"a settle/renewal {sum(r['store'] for r in part) / len(part):.0%}, "
              f"a garbage collection {sum(r['gc'] for r in part) / len(part):.0%}")
    for leased, name in (("1", "admitted"), ("0", "no limits")):
        met = [r["authz"] for r in rows if r["leased"] == leased and r["export"]]
        rest = [r["authz"] for r in rows if r["leased"] == leased and not r["export"]]
        if met and rest:
            print(f"authz_us, {name}: meeting a records batch p50 {statistics.median(met):.0f} "
                  f"p90 {pct(met, .9):.0f} (n={len(met)}); the others p50 "
                  f"{statistics.median(rest):.0f} p90 {pct(rest, .9):.0f} (n={len(rest)})")


def redis_slowlog(url: str) -> dict[str, str]:
    """Redis's SLOWLOG (set to 200 µs by --door-times) by script: how long one script held
    Redis, and every admission queued behind it."""
    import hashlib

    import redis

    from gateway import limits
    names = {hashlib.sha1(p.read_bytes()).hexdigest(): p.stem
             for p in Path(limits.__file__).parent.glob("*.lua")}
    by: dict[str, list[int]] = defaultdict(list)
    for entry in redis.Redis.from_url(url).slowlog_get(100_000):
        cmd = entry["command"]
        args = (cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)).split()
        by[names.get(args[1], " ".join(args[:2])) if len(args) > 1 else "?"].append(
            entry["duration"])
    return {k: f"n={len(v)} p50 {statistics.median(v)} max {max(v)} µs"
            for k, v in sorted(by.items())}


def redis_stats(url: str) -> dict[str, tuple[int, float]]:
    """Redis's own time per command (INFO commandstats: calls, µs a call) for the scripts
    and commands the spoke sent: what the admission costs inside Redis."""
    import redis
    stats = redis.Redis.from_url(url).info("commandstats")
    return {k.removeprefix("cmdstat_"): (v["calls"], v["usec_per_call"])
            for k, v in stats.items() if v["calls"] >= 100}


def door_answer(address: str, raw: bytes) -> bytes:
    """The door's whole answer to one request."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(raw)
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
    assert buf.startswith(b"HTTP/1.1 200") and b"content-length: 0\r\n" in buf, buf[:200]
    return buf


def request(path: str, headers: dict[str, str], body: bytes = BODY) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST {path} HTTP/1.1\r\nhost: bench\r\n{head}content-length: {len(body)}\r\n\r\n"
            .encode() + body)


def serve_keys(spoke: Spoke, secret: str, free_secret: str, limited: bool) -> None:
    """`bench` (MODEL; with `limited`, admitted in Redis on three tiers, limits too high to
    trip, as bench_capacity's key) and `free` (FREE_MODEL, no limits anywhere: its Check
    never waits on Redis), side by side in one policy."""
    limits = {"limits": {"rps": 1_000_000, "concurrency": 100_000,
                         "tokens_per_minute": 10_000_000_000}} if limited else {}
    spoke.publish({"models": {MODEL: {**limits}, FREE_MODEL: {}},
                   "teams": {"bench": {"models": [MODEL], **limits},
                             "free": {"models": [FREE_MODEL]}},
                   "keys": {"bench": {"team": "bench", **limits,
                                      "sha256": secrets.digest(secret).hex()},
                            "free": {"team": "free",
                                     "sha256": secrets.digest(free_secret).hex()}}}, "bench")
    spoke.wait_ready()


def round_trip(sock: socket.socket, raw: bytes) -> float:
    t0 = time.perf_counter()
    sock.sendall(raw)
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the server")
        buf += chunk
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            continue
        head = buf[:end].lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15:].split(b"\r\n")[0]) if at >= 0 else 0
        if len(buf) >= end + 4 + length:
            if not buf.startswith((b"HTTP/1.1 200", b"HTTP/1.1 401")):
                raise ValueError(f"unexpected answer {buf[:40]!r}")
            return time.perf_counter() - t0


def series(address: str, raw: bytes, n: int) -> list[float]:
    """n timed round trips after 20 untimed; each door request has its own x-request-id
    (an admitted Check refuses a request id it has seen)."""
    host, port = address.rsplit(":", 1)
    raws = [raw.replace(RID.encode(), str(uuid.uuid4()).encode()) for _ in range(n + 20)]
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for r in raws[:20]:  # warm-up
            round_trip(sock, r)
        return [round_trip(sock, r) for r in raws[20:]]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def log_medians(svc: Service, key_id: str | None = None) -> dict[str, float]:
    """Medians of the FIELDS over the access log's chat requests (`key_id`: that key's only,
    from the Check's metadata)."""
    values: dict[str, list[float]] = defaultdict(list)
    for line in svc.log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if entry.get("path") != "/v1/chat/completions":
            continue
        authz = entry.get("authz")
        if key_id is not None and not (isinstance(authz, dict) and authz.get("key_id") == key_id):
            continue
        for k in FIELDS:
            with contextlib.suppress(KeyError, TypeError, ValueError):  # "-": not set
                values[k].append(float(entry[k]))
    return {k: statistics.median(v) for k, v in values.items() if v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="per path per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--drop", default="", help="filters to drop from the spoke's chain "
                    "(`records`: its OpenTelemetry access log, the records to the sidecar)")
    ap.add_argument("--no-limits", action="store_true",
                    help="the bench key carries no limits: no Redis admission in the Check")
    ap.add_argument("--redis-with-gateway", action="store_true",
                    help="pin Redis to the gateway's core (default: the other core, with the "
                         "engine and the client): what waking an idle core costs its round trip")
    ap.add_argument("--sidecar-apart", action="store_true",
                    help="pin the sidecar to the other core (default: beside Envoy)")
    ap.add_argument("--door-times", action="store_true",
                    help="the door's own time per Check, read to write (benchmarks/door_timing)")
    ap.add_argument("--admit-ahead-ms", type=float, default=0.0,
                    help="the spoke's GATEWAY_ADMIT_AHEAD_MS (docs/admit-ahead.md): tickets "
                         "admitted ahead, the Check answered without waiting on Redis")
    ap.add_argument("--door-workers", type=int, default=0,
                    help="also a second spoke, its sidecar with GATEWAY_DOOR_WORKERS=N (paths "
                         "`doors`, `doors_free`), in the same rounds")
    ap.add_argument("--door-cpu", choices=DOOR_CPU, default="free",
                    help="where its door workers run: either core (the kernel decides, the "
                         "default), the sidecar's and Envoy's core, or the other one")
    ap.add_argument("--floor", action="store_true",
                    help="add the ladder from plain Envoy to the spoke (see the docstring)")
    ap.add_argument("--baseline", metavar="REV", default=None,
                    help="also a second spoke whose sidecar runs REV's code (paths `base`, "
                         "`base_free`), in the same rounds")
    envoy_flags(ap)
    args = ap.parse_args()
    flush_s = args.records_flush_ms / 1e3
    print(f"bench_latency: {args.rounds} rounds of {args.requests}; records flushed every "
          f"{args.records_flush_ms:g} ms; {args.envoy_workers} Envoy worker(s) each; "
          f"drop {args.drop or 'nothing'}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    secret, free_secret = secrets.new_secret("bench"), secrets.new_secret("free")
    door_times = workdir / "door-times"
    if args.door_times:  # the spoke's sidecar inherits this environment
        here = Path(__file__).resolve().parent
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(here / "door_timing"), os.environ.get("PYTHONPATH", "")])
        os.environ["GATEWAY_BENCH_DOOR_TIMES"] = str(door_times)
    ahead = {"GATEWAY_ADMIT_AHEAD_MS": f"{args.admit_ahead_ms:g}"} if args.admit_ahead_ms else {}
    spoke = Spoke(workdir=workdir / "spoke", listen_port=free_port(), metering="envoy",
                  envoy_config=spoke_config([d for d in args.drop.split(",") if d], flush_s),
                  envoy_workers=args.envoy_workers, sidecar_env=ahead).start()
    plain: Service | None = None
    extra: dict[str, Service] = {}
    doors: Spoke | None = None
    based: Spoke | None = None
    try:
        serve_keys(spoke, secret, free_secret, limited=not args.no_limits)
        if args.baseline:
            tree = baseline_tree(args.baseline, workdir / "baseline-tree")
            print(f"baseline {tree.rev} = {tree.describe}", flush=True)
            based = Spoke(workdir=workdir / "base", listen_port=free_port(), metering="envoy",
                         envoy_config=spoke_config(
                             [d for d in args.drop.split(",") if d], flush_s),
                         envoy_workers=args.envoy_workers,
                         sidecar_env={**ahead, **tree.env}).start()
            serve_keys(based, secret, free_secret, limited=not args.no_limits)
        if args.door_workers:
            doors = Spoke(workdir=workdir / "doors", listen_port=free_port(), metering="envoy",
                          envoy_config=spoke_config(
                              [d for d in args.drop.split(",") if d], flush_s),
                          envoy_workers=args.envoy_workers,
                          sidecar_env={**ahead,
                                       "GATEWAY_DOOR_WORKERS": str(args.door_workers)}).start()
            serve_keys(doors, secret, free_secret, limited=not args.no_limits)
        if args.door_times:
            import redis
            r = redis.Redis.from_url(spoke.redis_url)
            r.config_set("slowlog-log-slower-than", 200)
            r.config_set("slowlog-max-len", 100_000)
            r.slowlog_reset()
        plain = envoy_without(WITHOUT_GATEWAY, spoke["sidecar"].address,
                              spoke["engine"].address, workdir / "plain", "envoy-plain",
                              args.envoy_workers).start()
        if args.floor:
            door = spoke.authz_http_address
            assert door is not None
            answer = workdir / "door-answer"  # a real allowed answer, headers and metadata
            answer.write_bytes(door_answer(door, request("/v1/chat/completions", {
                "authorization": f"Bearer {secret}", "x-request-id": str(uuid.uuid4())})))
            ok = sys.executable, str(Path(__file__).with_name("ok_server.py"))
            for name, extra_argv in (("ok", []), ("ok_answer", [str(answer)])):
                port = free_port()
                extra[name] = Service(name.replace("_", "-"), [*ok, str(port), "uvloop",
                                                               *extra_argv], port, workdir).start()
            for name, ok_name, keep in (("floor", "ok", ()), ("floor_answer", "ok_answer", ()),
                                        ("floor_lua", "ok_answer", ("lua",)),
                                        ("floor_chain", "ok_answer",
                                         ("lua", "json_to_metadata"))):
                extra[name] = floor_envoy(spoke["engine"].address, extra[ok_name].port, keep,
                                          workdir / name, f"envoy-{name}",
                                          args.envoy_workers).start()
        if not args.no_pin and {GATEWAY_CPU, OTHER_CPU} <= os.sched_getaffinity(0):
            os.sched_setaffinity(0, {OTHER_CPU})
            for name, svc in {**spoke.services, "plain": plain, **extra}.items():
                gateway = name in ("envoy", "plain") or (
                    name == "sidecar" and not args.sidecar_apart) or name.startswith(
                    ("floor", "ok")) or (name == "redis" and args.redis_with_gateway)
                pin(svc.pid, {GATEWAY_CPU} if gateway else {OTHER_CPU})
            if doors is not None:  # as the spoke's, but for the door workers (--door-cpu)
                for name, svc in doors.services.items():
                    if name == "sidecar":
                        pin_sidecar(svc.pid, {GATEWAY_CPU}, doors.authz_http_address,
                                    args.door_cpu, {OTHER_CPU})
                    else:
                        pin(svc.pid, {GATEWAY_CPU} if name == "envoy" or (
                            name == "redis" and args.redis_with_gateway) else {OTHER_CPU})
            if based is not None:  # as the spoke's
                for name, svc in based.services.items():
                    gateway = name == "envoy" or (
                        name == "sidecar" and not args.sidecar_apart) or (
                        name == "redis" and args.redis_with_gateway)
                    pin(svc.pid, {GATEWAY_CPU} if gateway else {OTHER_CPU})
        chat = {"content-type": "application/json", "authorization": f"Bearer {secret}",
                "x-mock-ttft-ms": "0", "x-mock-tokens-per-s": "0"}
        rid = {"x-request-id": RID, "x-bench": "direct"}
        door = spoke.authz_http_address
        assert door is not None
        paths = {
            "plain": (f"127.0.0.1:{plain.port}", request("/v1/chat/completions", chat)),
            "spoke": (f"127.0.0.1:{spoke.listen_port}", request("/v1/chat/completions", chat)),
            "spoke_free": (f"127.0.0.1:{spoke.listen_port}", request(
                "/v1/chat/completions", {**chat, "authorization": f"Bearer {free_secret}"},
                BODY.replace(MODEL.encode(), FREE_MODEL.encode()))),
            "door_allow": (door, request("/v1/chat/completions",
                                         {"authorization": f"Bearer {secret}", **rid})),
            "door_free": (door, request("/v1/chat/completions",
                                        {"authorization": f"Bearer {free_secret}", **rid},
                                        BODY.replace(MODEL.encode(), FREE_MODEL.encode()))),
            "door_401": (door, request("/v1/chat/completions",
                                       {"authorization": "Bearer nope", **rid})),
        }
        for name, svc in extra.items():
            if name.startswith("floor"):
                paths[name] = (f"127.0.0.1:{svc.port}", request("/v1/chat/completions", chat))
        if doors is not None:
            paths["doors"] = (f"127.0.0.1:{doors.listen_port}", paths["spoke"][1])
            paths["doors_free"] = (f"127.0.0.1:{doors.listen_port}", paths["spoke_free"][1])
        if based is not None:
            # the door's own paths load only the spoke's sidecar and Redis (door_allow's
            # admissions stay live: ~300 a round in its concurrency sets, renewed), which
            # would make the two spokes unequal
            for name in ("door_allow", "door_free", "door_401"):
                del paths[name]
            paths["base"] = (f"127.0.0.1:{based.listen_port}", paths["spoke"][1])
            paths["base_free"] = (f"127.0.0.1:{based.listen_port}", paths["spoke_free"][1])
        times: dict[str, list[float]] = {k: [] for k in paths}
        # whose CPU each path's requests cost: its Envoy (the door's paths: none), the sidecar
        procs = {"plain": plain, "spoke": spoke["envoy"], "spoke_free": spoke["envoy"],
                 **({"doors": doors["envoy"], "doors_free": doors["envoy"]} if doors else {}),
                 **({"base": based["envoy"], "base_free": based["envoy"]} if based else {}),
                 **{k: v for k, v in extra.items() if k.startswith("floor")}}
        cpu: dict[str, dict[str, int]] = {k: defaultdict(int) for k in paths}
        order = list(paths)
        for rnd in range(args.rounds):
            for name in order if rnd % 2 == 0 else order[::-1]:
                sidecar = doors if doors is not None and name.startswith("doors") else (
                    based if based is not None and name.startswith("base") else spoke)
                watch = {"envoy": procs.get(name), "sidecar": sidecar["sidecar"]}
                before = {k: tree_sched_ns(v.pid) for k, v in watch.items() if v is not None}
                times[name] += series(*paths[name], args.requests)
                # the records Envoy flushes every --records-flush-ms, and their settle
                time.sleep(max(0.06, flush_s + 0.01))
                for k, b in before.items():
                    a = tree_sched_ns(watch[k].pid)  # type: ignore[union-attr]
                    if a is not None and b is not None:
                        cpu[name][k] += a[0] - b[0]
        for name, xs in times.items():
            per = {k: f"{v / 1e3 / len(xs):.0f}" for k, v in cpu[name].items()}
            print(f"{name:11s} p50 {statistics.median(xs) * 1e3:6.3f} ms  "
                  f"p90 {pct(xs, .9) * 1e3:6.3f}  p99 {pct(xs, .99) * 1e3:6.3f}  "
                  f"CPU µs/req {per}")
        for name in ("spoke", "doors", "base"):
            if name in times:
                xs, base = times[name], times["plain"]
                p50 = statistics.median(xs) - statistics.median(base)
                print(f"added by {name}: p50 {p50 * 1e3:.3f} ms, "
                      f"p99 {(pct(xs, .99) - pct(base, .99)) * 1e3:.3f} ms")
        print("spoke's Envoy, medians µs from the request's first byte:",
              {k: round(v) for k, v in log_medians(spoke["envoy"], "bench").items()})
        print("the same, spoke_free:",
              {k: round(v) for k, v in log_medians(spoke["envoy"], "free").items()})
        if based is not None:
            print("the baseline's Envoy, base:",
                  {k: round(v) for k, v in log_medians(based["envoy"], "bench").items()})
            print("the same, base_free:",
                  {k: round(v) for k, v in log_medians(based["envoy"], "free").items()})
        print("plain Envoy:", {k: round(v) for k, v in log_medians(plain).items()})
        for name, svc in extra.items():
            if name.startswith("floor"):
                print(f"{name}'s Envoy:", {k: round(v) for k, v in log_medians(svc).items()})
        print("Redis, µs a call:", redis_stats(spoke.redis_url))
        if based is not None:
            print("the baseline's Redis, µs a call:", redis_stats(based.redis_url))
        print("spoke's Envoy, the door's cluster:",
              cluster_stats(spoke["envoy"], "sidecar_authz_http"))
        if args.door_times:
            spoke["sidecar"].stop()  # its last lines flushed or not: a sample is enough
            lines = door_lines(door_times)
            print("inside the sidecar (benchmarks/door_timing), µs:")
            for k, v in door_medians(lines).items():
                print(f"  {k}: {v}")
            tail_report(spoke["envoy"].log_path, lines)
            print("Redis SLOWLOG (> 200 µs):", redis_slowlog(spoke.redis_url))
    finally:
        if doors is not None:
            doors.stop()
        if based is not None:
            based.stop()
        for svc in extra.values():
            svc.stop()
        if plain is not None:
            plain.stop()
        spoke.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
