"""One admission through the limiter's own client, stage by stage (issue 26's c=1 p50).

    .venv/bin/python benchmarks/bench_admit_client.py [--calls 2000] [--gap-ms 0.5]
        [--same-cpu] [--no-pin] [--unix]

A private redis-server on a free port, the bench key's three tiers as bench_latency's
`bench` key has them (rps 1,000,000, concurrency 100,000, tokens a minute 10^10 on model,
team and key), one admission at a time through `RedisLimiter` on uvloop, `--gap-ms` apart,
each released right after (as a real c=1 spoke settles its few requests), the way the
HTTP door calls it. The stages are stamped with `perf_counter_ns` by wrapping the
limiter's and the client's own methods (no gateway code changed):

  call → pump: from `admit()` to the pump's batch leaving `batching.gather`
  args: building the EVALSHA's arguments (`_args`) and packing them (hiredis)
  write: `transport.write`
  in flight: from the write to `data_received` (the round trip: Redis's wake-up, the
             script, the reply's wake-up of this process)
  parse: hiredis's `gets()` and the reply future's result set
  → pump resumes: the loop turn until the pump Task runs again
  → Check resumes: the verdict built, its future set, and the loop turn until the
             caller's Task runs again

Beside it, the same connection's PING (its round trip with nothing to run), and Redis's own
µs per call (INFO commandstats, `usec_per_call`) for EVALSHA and each command the script
ran. Placement as bench_latency's: this process on CPU 0, Redis on CPU 1 (`--same-cpu`:
both on CPU 0; `--no-pin`: the kernel decides). `--unix`: the client reaches Redis over a
Unix socket (`unix://` in GATEWAY_REDIS_URL) instead of TCP on the loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import uvloop
from common import pin
from redis import Redis

from devspoke.procs import free_port, redis_service
from gateway import batching
from gateway.limits import redis_store, resp
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import AdmitRequest, Release
from gateway.policy.model import LimitSpec, TierLimit

ns = time.perf_counter_ns
STAGES = ("call → pump", "args", "write", "in flight", "parse",
          "→ pump resumes", "→ Check resumes", "total")


class Stamps:
    def __init__(self) -> None:
        self.t: dict[str, int] = {}
        self.rows: list[dict[str, int]] = []

    def __call__(self, name: str) -> None:
        self.t.setdefault(name, ns())


def instrument(st: Stamps) -> None:
    """Wrap the stages' code in place (this process only)."""
    gather = batching.gather

    async def timed_gather(*a: Any, **kw: Any) -> None:
        await gather(*a, **kw)
        st("gathered")

    redis_store.batching.gather = timed_gather  # type: ignore[attr-defined]

    args = RedisLimiter._args

    def timed_args(self: RedisLimiter, reqs: list[AdmitRequest]) -> list[Any]:
        out = args(self, reqs)
        st("args")
        return out

    RedisLimiter._args = timed_args  # type: ignore[method-assign]

    pack = resp.hiredis.pack_command

    class Hiredis:  # the module as resp.py sees it, pack_command timed
        def __getattr__(self, name: str) -> Any:
            return getattr(__import__("hiredis"), name)

        @staticmethod
        def pack_command(a: Any) -> bytes:
            out = pack(a)
            st("packed")
            return out

    resp.hiredis = Hiredis()  # type: ignore[assignment]

    send = resp._Connection.send

    def timed_send(self: resp._Connection, packed: bytes) -> Any:
        st("write0")
        out = send(self, packed)
        st("written")
        return out

    resp._Connection.send = timed_send  # type: ignore[method-assign]

    received = resp._Connection.data_received

    def timed_received(self: resp._Connection, data: bytes) -> None:
        st("received")
        received(self, data)
        st("parsed")

    resp._Connection.data_received = timed_received  # type: ignore[method-assign]

    verdict = RedisLimiter._verdict

    def timed_verdict(req: AdmitRequest, row: list[int]) -> Any:
        st("pump")
        return verdict(req, row)

    RedisLimiter._verdict = staticmethod(timed_verdict)  # type: ignore[method-assign]


def limiter_sha(name: str) -> str:
    return hashlib.sha1(redis_store._lua(name).encode()).hexdigest()


def bench_tiers() -> tuple[TierLimit, ...]:
    spec = LimitSpec(rps=1_000_000, burst=1_000_000, concurrency=100_000,
                     tokens_per_minute=10_000_000_000)
    return tuple(TierLimit(t, "bench", spec) for t in ("model", "team", "key"))


async def run(url: str, calls: int, gap: float, st: Stamps) -> list[int]:
    client = RespClient(url)
    limiter = RedisLimiter(client)
    tiers = bench_tiers()
    pings = []
    for i in range(calls + 200):
        rid = str(uuid.uuid4())
        req = AdmitRequest(rid, tiers, 100, time.time(), "meta")
        st.t = {}
        st("call")
        await limiter.admit(req)
        st("resumed")
        if i >= 200:  # the first 200 warm up
            st.rows.append(st.t)
        await limiter.end_many([Release(rid)])
        await asyncio.sleep(gap)
        t0 = ns()
        await client.call("PING")
        if i >= 200:
            pings.append(ns() - t0)
        await asyncio.sleep(gap)
    await limiter.close()
    return pings


def split(t: dict[str, int]) -> list[int]:
    return [t["gathered"] - t["call"], t["packed"] - t["gathered"], t["written"] - t["write0"],
            t["received"] - t["written"], t["parsed"] - t["received"],
            t["pump"] - t["parsed"], t["resumed"] - t["pump"], t["resumed"] - t["call"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--gap-ms", type=float, default=0.5)
    ap.add_argument("--same-cpu", action="store_true")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--unix", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        svc = redis_service(free_port(), Path(tmp))
        sock = Path(tmp) / "redis.sock"
        if a.unix:
            svc.argv += ["--unixsocket", str(sock), "--unixsocketperm", "700"]
        svc.start()
        try:
            if not a.no_pin and {0, 1} <= os.sched_getaffinity(0):
                os.sched_setaffinity(0, {0})
                pin(svc.pid, {0} if a.same_cpu else {1})
            url = f"unix://{sock}?db=0" if a.unix else f"redis://{svc.address}/0"
            r = Redis.from_url(url)
            st = Stamps()
            instrument(st)
            r.config_resetstat()
            r.config_set("slowlog-log-slower-than", 0)
            r.config_set("slowlog-max-len", 1_000_000)
            r.slowlog_reset()
            pings = uvloop.run(run(url, a.calls, a.gap_ms / 1e3, st))
            r.config_set("slowlog-log-slower-than", 10_000)
            slow = r.slowlog_get(1_000_000)
            stats = r.info("commandstats")
            shas = {limiter_sha("admit.lua"): "admit.lua", limiter_sha("settle.lua"): "settle.lua"}
            by: dict[str, list[int]] = {}
            for e in slow:
                parts = e["command"].split()
                if len(parts) > 1 and parts[0].upper() == b"EVALSHA":
                    by.setdefault(shas.get(parts[1].decode(), "?"), []).append(e["duration"])
            rows = [split(t) for t in st.rows]
            print(f"{len(rows)} admissions, µs: p50 / p90 "
                  f"(gap {a.gap_ms} ms, Redis {'beside' if a.same_cpu else 'apart'}, "
                  f"{'Unix socket' if a.unix else 'TCP'})")
            for i, name in enumerate(STAGES):
                xs = sorted(row[i] for row in rows)
                print(f"  {name:22s} {xs[len(xs) // 2] / 1e3:7.1f} / "
                      f"{xs[int(len(xs) * .9)] / 1e3:7.1f}")
            print(f"  {'PING round trip':22s} {statistics.median(pings) / 1e3:7.1f} / "
                  f"{sorted(pings)[int(len(pings) * .9)] / 1e3:7.1f}")
            for name, xs in by.items():
                xs.sort()
                print(f"Redis SLOWLOG: {name} p50 {xs[len(xs) // 2]} µs, p90 "
                      f"{xs[int(len(xs) * .9)]} ({len(xs)} calls)")
            evalsha = stats["cmdstat_evalsha"]
            print(f"Redis: evalsha {evalsha['usec_per_call']:.1f} µs a call "
                  f"({evalsha['calls']} calls, admit and release)")
            for k, v in sorted(stats.items()):
                if k != "cmdstat_evalsha":
                    print(f"  {k[8:]:18s} {v['calls']:6d} calls {v['usec_per_call']:6.2f} µs")
        finally:
            svc.stop()


if __name__ == "__main__":
    main()
