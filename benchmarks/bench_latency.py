"""Where the latency the gateway adds at c=1 goes: one client, one request at a time.

    .venv/bin/python benchmarks/bench_latency.py [--requests 300] [--rounds 3] [--no-pin]
        [--drop lua,json_to_metadata]

Paths, interleaved per round (A B C D, then D C B A): `plain` (testkit.envoys.envoy_without:
no ext_authz, no ext_proc) and `spoke` (the reference config: Envoy-fed metering, the Check
through the HTTP door), chat with max_tokens 8 and an engine that answers at once; and the
HTTP door asked directly, as Envoy asks it, by a keep-alive raw-socket client: `door_allow`
(the spoke's key; it has no limits, so no Redis round trip) and `door_401`.

The spoke's Envoy is the reference config with two additions for this measurement only:
ext_authz's `emit_filter_state_stats`, and access log fields from its request's first byte
(µs): `authz_us` (the Check as Envoy saw it, sent to answered), `to_engine_us` (to the
first byte sent to the engine), `first_byte_us` (to the engine's first byte back) and
`tx_end_us` (to the last byte sent to the client). Their medians are printed, beside
plain's `to_engine_us`. `--drop` removes filters from the spoke's chain (by a part of
their names), to see what each costs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import yaml
from common import pin
from streaming import serve_one_key

from devspoke.procs import Service, free_port
from devspoke.stack import Spoke
from gateway.envoyconf.bootstrap import EnvoyPorts, render
from gateway.policy import secrets
from testkit.envoys import WITHOUT_GATEWAY, envoy_without

MODEL = "mock-model"
BODY = orjson.dumps({"model": MODEL, "max_tokens": 8,
                     "messages": [{"role": "user", "content": "classify: the sky is blue"}]})
FIELDS = {  # access log field -> Envoy's format string
    "authz_us": "%FILTER_STATE(envoy.filters.http.ext_authz:FIELD:latency_us)%",
    "to_engine_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "first_byte_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%",
    "tx_end_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
}
GATEWAY_CPU, OTHER_CPU = 0, 1


def spoke_config(drop: list[str]) -> Any:
    def config(ports: EnvoyPorts, metering: Any) -> str:
        doc = yaml.safe_load(render(ports, metering=metering))
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        tc = hcm["typed_config"]
        tc["http_filters"] = [f for f in tc["http_filters"]
                              if not any(d in f["name"] for d in drop)]
        for f in tc["http_filters"]:
            if f["name"] == "envoy.filters.http.ext_authz":
                f["typed_config"]["emit_filter_state_stats"] = True
        stdout = next(a for a in tc["access_log"] if a["name"].endswith("stdout"))
        stdout["typed_config"]["log_format"]["json_format"].update(FIELDS)
        return yaml.safe_dump(doc, sort_keys=False)
    return config


def request(path: str, headers: dict[str, str]) -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST {path} HTTP/1.1\r\nhost: bench\r\n{head}content-length: {len(BODY)}\r\n\r\n"
            .encode() + BODY)


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
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(20):  # warm-up
            round_trip(sock, raw)
        return [round_trip(sock, raw) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def log_medians(svc: Service) -> dict[str, float]:
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
    ap.add_argument("--drop", default="", help="filters to drop from the spoke's chain")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    secret = secrets.new_secret("bench")
    spoke = Spoke(workdir=workdir / "spoke", listen_port=free_port(), metering="envoy",
                  envoy_config=spoke_config([d for d in args.drop.split(",") if d])).start()
    plain: Service | None = None
    try:
        serve_one_key(spoke, secret, MODEL)
        plain = envoy_without(WITHOUT_GATEWAY, spoke["sidecar"].address,
                              spoke["engine"].address, workdir / "plain", "envoy-plain").start()
        if not args.no_pin and {GATEWAY_CPU, OTHER_CPU} <= os.sched_getaffinity(0):
            os.sched_setaffinity(0, {OTHER_CPU})
            for name, svc in {**spoke.services, "plain": plain}.items():
                pin(svc.pid, {GATEWAY_CPU} if name in ("envoy", "sidecar", "plain")
                    else {OTHER_CPU})
        chat = {"content-type": "application/json", "authorization": f"Bearer {secret}",
                "x-mock-ttft-ms": "0", "x-mock-tokens-per-s": "0"}
        rid = {"x-request-id": "0b6a9a48-cd1b-4bb4-9a1c-6d1d9a1f0e11"}
        door = spoke.authz_http_address
        assert door is not None
        paths = {
            "plain": (f"127.0.0.1:{plain.port}", request("/v1/chat/completions", chat)),
            "spoke": (f"127.0.0.1:{spoke.listen_port}", request("/v1/chat/completions", chat)),
            "door_allow": (door, request("/v1/chat/completions",
                                         {"authorization": f"Bearer {secret}", **rid})),
            "door_401": (door, request("/v1/chat/completions",
                                       {"authorization": "Bearer nope", **rid})),
        }
        times: dict[str, list[float]] = {k: [] for k in paths}
        order = list(paths)
        for rnd in range(args.rounds):
            for name in order if rnd % 2 == 0 else order[::-1]:
                times[name] += series(*paths[name], args.requests)
        for name, xs in times.items():
            print(f"{name:11s} p50 {statistics.median(xs) * 1e3:6.3f} ms  "
                  f"p90 {pct(xs, .9) * 1e3:6.3f}  p99 {pct(xs, .99) * 1e3:6.3f}")
        added = statistics.median(times["spoke"]) - statistics.median(times["plain"])
        print(f"added p50 {added * 1e3:.3f} ms")
        print("spoke's Envoy, medians µs from the request's first byte:",
              {k: round(v) for k, v in log_medians(spoke["envoy"]).items()})
        print("plain Envoy:", {k: round(v) for k, v in log_medians(plain).items()})
    finally:
        if plain is not None:
            plain.stop()
        spoke.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
