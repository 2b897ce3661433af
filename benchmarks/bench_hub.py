"""Time from `gateway hub publish` to ACK on every instance of two spokes.

    .venv/bin/python benchmarks/bench_hub.py [--quick] [-n 30] [--out benchmarks/results/hub.json]

A fleet as the e2e test runs it (testkit.fleet: one Tansu; per spoke Redis, mock engine,
sidecar, Envoy and `gateway policy sync`; 4 instances in all: 2 sidecars, 2 syncers). Each
round publishes the test policy as the next revision for `*` through the hub's own code
(`gateway.hub.publish.publish`, in process: no CLI start-up in the number) and waits until
every instance has reported ACK of that revision on `llm.gateway.status.v1`.

Per round and instance two times, from the moment publish() was called:
* `ack`: the report's own `at` (the instance's clock; same machine): when it held the
  revision (a syncer: stored in Redis; a sidecar: loaded and serving);
* `seen`: when this benchmark read that report off the topic (what `hub status` would see;
  adds the status producer's and this consumer's fetch delays).
`all` is the slowest instance of the round. Reported: p50, p99 and max over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from common import git_state, machine_info, markdown_table

from gateway.hub.publish import publish
from gateway.hub.topics import STATUS_TOPIC, Follower
from testkit.fleet import Fleet, start_fleet
from testkit.spoke import policy_doc

HERE = Path(__file__).resolve().parent
TARGET_S = 1.0  # the bound: a revision served by both spokes within 1 s


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


async def rounds(fleet: Fleet, n: int, gap_s: float) -> list[dict[str, Any]]:
    import yaml

    text = yaml.safe_dump(policy_doc(fleet.keys)).encode()
    instances = {f"{s}/{s}-{kind}" for s in fleet.spokes for kind in ("sidecar", "sync")}
    seen: dict[tuple[str, int], float] = {}  # (key, revision) → wall time read off the topic
    acked: dict[tuple[str, int], float] = {}  # (key, revision) → the report's own `at`
    follower = Follower(fleet.bootstrap, STATUS_TOPIC, probe_s=2.0)

    async def follow() -> None:
        async for records in follower.batches():
            now = time.time()
            for key, raw in records:
                if raw is None:
                    continue
                s = json.loads(raw)
                if s["state"] == "ack":
                    k = (key, s["revision"])
                    seen.setdefault(k, now)
                    acked.setdefault(k, datetime.fromisoformat(s["at"]).timestamp())

    task = asyncio.create_task(follow())
    out = []
    try:
        for i in range(n):
            t0 = time.time()
            rev = await publish(fleet.bootstrap, text, "bench", idempotence=False)
            published = time.time() - t0
            deadline = time.monotonic() + 30
            while not all((k, rev) in seen for k in instances):
                if time.monotonic() > deadline:
                    missing = sorted(k for k in instances if (k, rev) not in seen)
                    raise RuntimeError(f"revision {rev}: no ACK from {missing} in 30 s")
                await asyncio.sleep(0.005)
            row = {"round": i, "revision": rev, "publish_call_s": published,
                   "ack_s": {k: acked[(k, rev)] - t0 for k in sorted(instances)},
                   "seen_s": {k: seen[(k, rev)] - t0 for k in sorted(instances)}}
            out.append(row)
            print(f"  revision {rev}: all ACK {max(row['ack_s'].values()) * 1000:.0f} ms, "
                  f"seen {max(row['seen_s'].values()) * 1000:.0f} ms", flush=True)
            await asyncio.sleep(gap_s)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    def stats(values: list[float]) -> dict[str, float]:
        return {"p50_ms": statistics.median(values) * 1000, "p99_ms": pct(values, 99) * 1000,
                "max_ms": max(values) * 1000}

    out = {"publish call": stats([r["publish_call_s"] for r in rows])}
    for kind in ("sync", "sidecar"):
        out[f"ack, {kind}s"] = stats([v for r in rows for k, v in r["ack_s"].items()
                                      if k.endswith(kind)])
    out["ack, all 4 (slowest)"] = stats([max(r["ack_s"].values()) for r in rows])
    out["seen by the hub, all 4"] = stats([max(r["seen_s"].values()) for r in rows])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("-n", type=int, default=None, help="rounds (default 30)")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between rounds")
    parser.add_argument("--out", default=str(HERE / "results" / "hub.json"))
    args = parser.parse_args()
    n = args.n or (5 if args.quick else 30)
    load_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-hub-"))
    fleet = start_fleet(workdir, status_interval_s=10.0)
    try:
        rows = asyncio.run(rounds(fleet, n, args.gap))
    finally:
        fleet.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    stats = summary(rows)
    print()
    print("\n".join(markdown_table(
        ("from hub publish() to", "p50 ms", "p99 ms", "max ms"),
        [(k, f"{v['p50_ms']:.0f}", f"{v['p99_ms']:.0f}", f"{v['max_ms']:.0f}")
         for k, v in stats.items()])))
    worst = stats["ack, all 4 (slowest)"]["p99_ms"] / 1000
    print(f"\n{n} publishes; target: every instance ACKs within {TARGET_S:g} s: "
          f"{'met' if worst <= TARGET_S else 'NOT met'} at p99 ({worst * 1000:.0f} ms)")
    doc = {"bench": "hub", "rounds": n, "summary": stats, "rows": rows, "git": git_state(),
           "machine": machine_info(), "loadavg_start": load_start,
           "loadavg_end": os.getloadavg(), "argv": sys.argv[1:]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
