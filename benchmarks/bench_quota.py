"""One quota across spokes: how far two spokes sharing a global daily quota overshoot it,
and how much of an idle spoke's share moves to the busy one (README "One quota across
spokes").

    .venv/bin/python benchmarks/bench_quota.py [--rounds 5] [--quota 3000] [--interval-s 1]
        [--concurrency 3] [--out benchmarks/results/quota.json]

Two whole spokes (Redis, mock engine, sidecar, Envoy each) report usage to one Tansu; one
allowance follower per spoke and the allocator (`gateway hub allocate`) run as processes.
Each round is a fresh team with the same quota, driven through both spokes at once, each
with `--concurrency` requests in flight (non-stream chat, max_tokens 20: 22 tokens each),
until every answer for 3 s was a 429. Overshoot = tokens served (the engine's own usage in
the responses) minus the quota. Then one more team is driven through one spoke alone: the
share it got. Doorman (the published anchor) reports peak 106 %, average 102 % of capacity.

`--admission-only`: what a global limit costs admission in Redis itself: the same batch
of admissions (team and key tiers with rps and tokens_per_day; then the same plus a global
day and month quota on both) alternated in rounds against one Redis, timed by Redis
(INFO commandstats: microseconds per admit.lua call), so a busy machine's client side does
not blur it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import redis
from common import git_state, machine_info

from devspoke.procs import free_port, redis_service
from devspoke.stack import Spoke
from gateway.limits import maths
from gateway.limits.redis_store import RedisLimiter
from gateway.limits.resp import RespClient, Script
from gateway.limits.types import AdmitRequest
from gateway.policy.model import LimitSpec, TierLimit
from testkit import quota as hub

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 20


class BeforeLimiter(RedisLimiter):
    """The limiter with admit.lua as it was before global quotas (REV's script, which takes
    7 fields a tier): the same-run baseline of the path without a global limit."""

    def __init__(self, url: str, source: str) -> None:
        super().__init__(RespClient(url), lease_ttl=60, deadline=5.0)
        self._admit = Script(self.redis, source)

    def _tiers_arg(self, tiers: tuple[TierLimit, ...]) -> str:
        return "\x1f".join(super()._tiers_arg(tiers).split("\x1f")[:-2])  # one tier only


async def _admissions(url: str, tiers: tuple[TierLimit, ...], n: int, tag: str,
                      before: str | None = None) -> None:
    lim = (RedisLimiter(RespClient(url), lease_ttl=60, deadline=5.0) if before is None
           else BeforeLimiter(url, before))
    now = time.time()
    for i in range(n):
        await lim.admit(AdmitRequest(f"{tag}-{i}", tiers, 10, now))
    await lim.close()


def admission_cost(workdir: Path, before_rev: str, rounds: int = 5, n: int = 3000,
                   ) -> dict[str, float]:
    """Redis µs per admit.lua call, median over rounds: before global quotas existed
    (`before_rev`'s script, one tier), and this code without and with them (one tier)."""
    import asyncio
    import subprocess

    before = subprocess.run(["git", "show", f"{before_rev}:gateway/limits/admit.lua"],
                            capture_output=True, text=True, check=True, cwd=HERE).stdout

    svc = redis_service(free_port(), workdir).start()
    url = f"redis://{svc.address}/0"
    big = 10**15
    plain = (TierLimit("team", "t", LimitSpec(rps=1e6, burst=10**6, tokens_per_day=big)),)
    with_global = (TierLimit("team", "t", LimitSpec(
        rps=1e6, burst=10**6, tokens_per_day=big, global_tokens_per_day=big)),)
    # The worst case: team and key tiers, each with a global day and month quota.
    plain2 = (*plain, TierLimit("key", "k", plain[0].spec))
    global2 = tuple(TierLimit(t.tier, t.name, LimitSpec(
        rps=1e6, burst=10**6, tokens_per_day=big, global_tokens_per_day=big,
        global_tokens_per_month=big)) for t in plain2)
    client = redis.Redis.from_url(url)
    variants = (("before", plain, before), ("plain", plain, None), ("global", with_global, None),
                ("plain2", plain2, None), ("global2", global2, None))
    out: dict[str, list[float]] = {v[0]: [] for v in variants}
    try:
        for r in range(rounds):
            for name, tiers, src in variants[::1 - 2 * (r % 2)]:
                client.config_resetstat()
                asyncio.run(_admissions(url, tiers, n, f"{name}{r}", src))
                stats = client.info("commandstats")
                calls = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0))
                            for c in ("evalsha", "eval"))
                usec = sum(int(stats.get(f"cmdstat_{c}", {}).get("usec", 0))
                           for c in ("evalsha", "eval"))
                out[name].append(usec / max(calls, 1))
    finally:
        svc.stop()
    med = {k: round(statistics.median(v), 2) for k, v in out.items()}
    print(f"admit.lua in Redis, one tier (rps + tokens_per_day), µs per call (median of "
          f"{rounds} rounds of {n}): before global quotas ({before_rev}) {med['before']}, "
          f"now without one {med['plain']} ({med['plain'] / med['before']:.2f}x), "
          f"with a global day quota {med['global']} ({med['global'] / med['plain']:.2f}x); "
          f"team + key tiers {med['plain2']}, each also with a global day and month quota "
          f"{med['global2']} ({med['global2'] / med['plain2']:.2f}x)")
    return {**{f"{k}_us": v for k, v in med.items()},
            "plain_vs_before": round(med["plain"] / med["before"], 3),
            "global_vs_plain": round(med["global"] / med["plain"], 3),
            "global2_vs_plain2": round(med["global2"] / med["plain2"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quota", type=int, default=3000, help="tokens per day, per team")
    ap.add_argument("--interval-s", dest="interval_s", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=3, help="requests in flight per spoke")
    ap.add_argument("--out", default=str(HERE / "results" / "quota.json"))
    ap.add_argument("--before", default="e9d23d7",
                    help="the revision whose admit.lua is the baseline (default: the commit "
                         "global quotas were built on)")
    ap.add_argument("--admission-rounds", dest="admission_rounds", type=int, default=9)
    ap.add_argument("--admission-only", dest="admission_only", action="store_true",
                    help="only the admission cost of a global limit (no spokes)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: one round of each, a 500-token quota, 300 "
                         "admissions per variant, the allocator every 0.5 s, a round ends "
                         "after 1.2 s of 429s")
    args = ap.parse_args()
    # A round ends once every answer for `denied_for` s was a 429: past the allocator's next
    # interval (1 s) and its allowance reaching the follower.
    denied_for, admission_n = 3.0, 3000
    if args.quick:
        args.rounds, args.admission_rounds, args.quota = 1, 1, 500
        args.interval_s = min(args.interval_s, 0.5)  # shares move twice as often
        denied_for, admission_n = 1.2, 300
    workdir = Path(tempfile.mkdtemp(prefix="bench-quota-"))
    cost = admission_cost(workdir, args.before, rounds=args.admission_rounds, n=admission_n)
    if args.admission_only:
        return 0
    teams = [f"r{i}" for i in range(args.rounds)] + ["alone"]
    rounds, started = [], datetime.now(UTC)
    with hub.fleet(workdir, teams, args.quota) as f:
        east, west = f.spokes["east"], f.spokes["west"]
        alloc = hub.allocator(f.kafka.address, workdir, args.interval_s).start()
        f.procs.append(alloc)
        day = maths.day_id(time.time())
        deadline = time.monotonic() + 60
        while not all(redis.Redis.from_url(s.redis_url).get(f"gw:allow:tpd:team:{t}:{day}")
                      for s in (east, west) for t in teams):
            if time.monotonic() > deadline:
                raise SystemExit(f"no allowances after 60 s:\n{alloc.log()[-2000:]}")
            time.sleep(0.2)

        def load(spoke: Spoke, team: str) -> hub.Drive:
            return hub.drive(spoke, f.keys[f"k{team}"], concurrency=args.concurrency,
                             max_tokens=MAX_TOKENS, until_denied_for=denied_for)

        for team in teams[:-1]:
            e, w = hub.together(lambda t=team: load(east, t), lambda t=team: load(west, t))
            total = e.served_tokens + w.served_tokens
            rounds.append({"team": team, "east": e.served_tokens, "west": w.served_tokens,
                           "served": total, "overshoot": total - args.quota,
                           "pct_of_quota": round(100 * total / args.quota, 2)})
            print(f"{team}: east {e.served_tokens} + west {w.served_tokens} = {total} "
                  f"({100 * total / args.quota:.1f} % of {args.quota})", flush=True)
        alone = load(east, "alone")
        share = 100 * alone.served_tokens / args.quota
        print(f"one spoke alone: {alone.served_tokens} ({share:.1f} % of the quota)")
    pcts = [r["pct_of_quota"] for r in rounds]
    # The README's bound: the quota plus what the requests in flight use past their
    # reservations (none here: each reservation covers the 22 tokens its request uses).
    past = 2 * args.concurrency * hub.past_reservation(MAX_TOKENS)
    summary = {"peak_pct": max(pcts), "mean_pct": round(statistics.mean(pcts), 2),
               "min_pct": min(pcts), "past_reservation_tokens_bound": past,
               "alone_pct": round(100 * alone.served_tokens / args.quota, 2)}
    print(f"peak {summary['peak_pct']} %, mean {summary['mean_pct']} %, min "
          f"{summary['min_pct']} % of the quota (bound: quota + {past} tokens past the "
          f"reservations in flight = {100 + 100 * past / args.quota:.1f} %); "
          f"Doorman: peak 106 %, mean 102 %")
    doc = {"benchmark": "bench_quota", "timestamp": started.isoformat(),
           "config": vars(args), "machine": machine_info(), "git": git_state(),
           "rounds": rounds, "summary": summary, "admission_cost": cost}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
