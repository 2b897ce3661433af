"""What renewing many live streams' leases does to the admissions waiting behind it.

    .venv/bin/python benchmarks/bench_renew.py [--live 5000,20000] [--rounds 3] [--quick]

A spoke following thousands of long streams renews every lease each third of the lease
TTL. Redis runs one script at a time, so while a renewal runs every admission waits. Here
`--live` admissions hold leases on three tiers, then the ledger's renewal call runs while
a probe admits one request a millisecond. It prints the probe's worst and p99 wait, how
many of its admissions passed the deadline (a Check's 503), and the whole renewal's time.
Two variants run in turn: the store's bounded batches, and one script for every id, as
before the batching (MAX_BATCH set past the live count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import markdown_table

from devspoke.procs import free_port, redis_service
from gateway.errors import StoreInDoubt
from gateway.limits import redis_store
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient
from gateway.limits.types import AdmitRequest, Admitted
from gateway.policy.model import LimitSpec, TierLimit

BATCH = redis_store.MAX_BATCH  # the store's own bound
BIG = 10**12
TIERS = tuple(TierLimit(t, f"{t}-bench", LimitSpec(rps=1e9, burst=10**9, concurrency=10**7,
                                                    tokens_per_day=BIG))
              for t in ("model", "team", "key"))


async def one_round(url: str, live: int, batch: int, tag: str) -> dict[str, float]:
    lim = RedisLimiter(RespClient(url), lease_ttl=60.0)
    try:
        now = time.time()
        ids = [f"{tag}-{i}" for i in range(live)]
        for i in range(0, live, BATCH):
            verdicts = await asyncio.gather(*(lim.admit(AdmitRequest(rid, TIERS, 100, now))
                                              for rid in ids[i:i + BATCH]))
            assert all(isinstance(v, Admitted) for v in verdicts)
        waits: list[float] = []
        failed: list[int] = []
        done = asyncio.Event()

        async def probe() -> None:
            n = 0
            while not done.is_set():
                n += 1
                t0 = time.perf_counter()
                try:
                    await lim.admit(AdmitRequest(f"{tag}-probe-{n}", TIERS, 1, time.time()))
                except StoreInDoubt:  # past the admission deadline: the Check answers 503
                    failed.append(n)
                waits.append(time.perf_counter() - t0)
                await asyncio.sleep(0.001)

        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.05)
        redis_store.MAX_BATCH = batch
        try:
            t0 = time.perf_counter()
            await lim.renew(ids, time.time())
            renew_s = time.perf_counter() - t0
        finally:
            redis_store.MAX_BATCH = BATCH
        await asyncio.sleep(0.02)
        done.set()
        await prober
        waits.sort()
        return {"worst_ms": waits[-1] * 1000,
                "p99_ms": waits[int(len(waits) * 0.99)] * 1000,
                "renew_ms": renew_s * 1000, "denied_503": float(len(failed))}
    finally:
        await lim.close()


async def run(url: str, lives: list[int], rounds: int) -> dict[str, dict[str, float]]:
    results: dict[str, list[dict[str, float]]] = {}
    for r in range(rounds):
        for live in lives:
            for name, batch in ((f"batches of {BATCH}", BATCH), ("one script", 10**9)):
                key = f"{live} live, {name}"
                got = await one_round(url, live, batch, f"r{r}-{live}-{batch}")
                results.setdefault(key, []).append(got)
    return {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--live", default="5000,20000", help="live admissions, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1,000 live, one round")
    a = ap.parse_args()
    if a.quick:
        a.live, a.rounds = "1000", 1
    lives = [int(x) for x in a.live.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        svc = redis_service(free_port(), Path(tmp)).start()
        try:
            med = asyncio.run(run(f"redis://{svc.address}/0", lives, a.rounds))
        finally:
            svc.stop()
    rows = [(k, f"{v['renew_ms']:.1f}", f"{v['p99_ms']:.2f}", f"{v['worst_ms']:.2f}",
             f"{v['denied_503']:g}") for k, v in med.items()]
    head = ("renewal (median of rounds)", "renewal ms", "probe p99 ms", "probe worst ms",
            "probe 503s (deadline)")
    print("\n".join(markdown_table(head, rows)))
    if a.out:
        a.out.write_text(json.dumps(med, indent=2))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
