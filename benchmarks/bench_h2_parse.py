"""What an h2c HTTP door would cost the sidecar per Check in Python, against today's
HTTP/1.1 door: in-process, no sockets, no event loop.

    .venv/bin/python benchmarks/bench_h2_parse.py [--checks 20000] [--repeat 5]

* `h2`: one long-lived server-side h2.connection.H2Connection (the `h2` package) fed each
  Check as Envoy would send it on its one connection (HEADERS + DATA frames, HPACK state
  carried over from the Checks before: the pseudo-headers, authorization and the like are
  indexed, x-request-id changes), events read (RequestReceived, DataReceived with its flow
  control acknowledged, StreamEnded), then the answer (ANSWER: the allowed Check's ~21
  headers) sent with send_headers(end_stream=True) and data_to_send() taken. The frames are
  recorded first from an h2 client talking to a twin server (so the client's window
  updates and settings ACKs are in them), then replayed into a fresh server, timed.
* `h1`: the door's own work for the same Check over HTTP/1.1: gateway.server.authz_http's
  parse_head on the request head and the answer's bytes joined as check_http does.

Reported: µs per Check, the best of --repeat runs of --checks Checks. The Check's own logic
(the key, Redis) is the same either way and not in either.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

import h2.config
import h2.connection
import h2.events
from bench_check_transport import ANSWER
from common import git_state, machine_info

from gateway.server.authz_http import parse_head

HERE = Path(__file__).resolve().parent
BODY = (b'{"model":"mock-model","max_tokens":8,"messages":[{"role":"user",'
        b'"content":"classify: the sky is blue"}]}')
SECRET = "gw_bench_" + "x" * 43


def request_headers(rid: str) -> list[tuple[str, str]]:
    """What Envoy's ext_authz http_service sends (the reference config's allowed_headers)."""
    return [(":method", "POST"), (":scheme", "http"), (":authority", "127.0.0.1:10000"),
            (":path", "/v1/chat/completions"), ("content-length", str(len(BODY))),
            ("authorization", f"Bearer {SECRET}"), ("x-request-id", rid),
            ("x-envoy-expected-rq-timeout-ms", "500")]


def record(checks: int) -> list[bytes]:
    """The bytes Envoy would write, one entry per Check (the preface in the first)."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    client.initiate_connection()
    server.initiate_connection()
    out = []
    for i in range(checks):
        sid = 2 * i + 1
        client.send_headers(sid, request_headers(str(uuid.uuid4())))
        client.send_data(sid, BODY, end_stream=True)
        sent = client.data_to_send()
        out.append(sent)
        serve(server, sent)
        client.receive_data(server.data_to_send())
    return out


def serve(server: h2.connection.H2Connection, data: bytes) -> int:
    """One Check's frames in, its answer's frames queued; the answer's stream id."""
    sid = 0
    for ev in server.receive_data(data):
        if isinstance(ev, h2.events.RequestReceived):
            sid = ev.stream_id
            dict(ev.headers)  # the door would read them
        elif isinstance(ev, h2.events.DataReceived):
            server.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
    server.send_headers(sid, [(":status", "200"), ("content-length", "0"), *ANSWER],
                        end_stream=True)
    return sid


def time_h2(frames: list[bytes]) -> float:
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    server.initiate_connection()
    server.data_to_send()
    t0 = time.perf_counter()
    for data in frames:
        serve(server, data)
        server.data_to_send()
    return (time.perf_counter() - t0) / len(frames) * 1e6


def time_h1(checks: int) -> float:
    heads = [b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:10000\r\n"
             b"content-length: %d\r\nauthorization: Bearer %s\r\nx-request-id: %s\r\n"
             b"x-envoy-expected-rq-timeout-ms: 500\r\n\r\n" % (
                 len(BODY), SECRET.encode(), str(uuid.uuid4()).encode()) + BODY
             for _ in range(checks)]
    answer = [(k.encode(), v.encode()) for k, v in ANSWER]
    t0 = time.perf_counter()
    for raw in heads:
        end = raw.find(b"\r\n\r\n")
        parse_head(raw[:end])
        b"".join((b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n",
                  b"".join(k + b": " + v + b"\r\n" for k, v in answer), b"\r\n"))
    return (time.perf_counter() - t0) / checks * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "h2_parse.json"))
    args = parser.parse_args()
    frames = record(args.checks)
    h2_us = min(time_h2(frames) for _ in range(args.repeat))
    h1_us = min(time_h1(args.checks) for _ in range(args.repeat))
    print(f"per Check: h2 {h2_us:.1f} µs, h1 {h1_us:.1f} µs, h2 - h1 {h2_us - h1_us:+.1f} µs "
          f"(best of {args.repeat} x {args.checks}; h2 {h2.__version__}, "
          f"{sum(map(len, frames[1:])) / max(1, len(frames) - 1):.0f} B of frames a Check)")
    doc = {"bench": "h2_parse", "checks": args.checks, "repeat": args.repeat,
           "h2_us": h2_us, "h1_us": h1_us, "h2_version": h2.__version__,
           "frame_bytes_per_check": sum(map(len, frames[1:])) / max(1, len(frames) - 1),
           "machine": machine_info(), "git": git_state()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
