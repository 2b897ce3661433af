"""admit.lua's own cost per admission inside Redis, allowed and denied, against a baseline
revision's script in the same Redis, interleaved (best of N rounds: the machine is shared).

    .venv/bin/python benchmarks/bench_admit_lua.py [--baseline REV] [--rounds 3] [--calls 1500]
        [--all-limits]

Each call admits a batch of 16 requests over three tiers (model, team, key), each tier with
rps and the three token windows; with --all-limits, also concurrency and both global quotas
(an allowance for the day's, the fallback share for the month's), the leases dropped after
each call. Allowed: limits that never bind. Denied: an rps of 0.001 that refuses at the
first tier. Redis's own `usec_per_call` (INFO commandstats) divided by the batch: no client
or network cost.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from common import markdown_table
from redis import Redis

from devspoke.procs import free_port, redis_service

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "gateway/limits/admit.lua"
BATCH = 16
TIERS = ("model", "team", "key")


def _tiers(deny: bool, full: bool) -> str:
    """admit.lua's tier fields: key, rps, burst, concurrency, tpm, tpd, tpmo, gtpd, gtpmo."""
    rps, burst = (0.001, 1) if deny else (1e9, 10**9)
    big = 10**10
    conc, glob = (big, f"{big}\x1f{big}") if full else ("", "\x1f")
    return "3\x1f" + "\x1f".join(
        f"{t}:bench\x1f{rps}\x1f{burst}\x1f{conc}\x1f{big}\x1f{big}\x1f{big}\x1f{glob}"
        for t in TIERS)


def us_per_admission(r: Redis, script: str, deny: bool, calls: int, full: bool = False) -> float:
    r.flushall()
    if full:  # the day's allowance is set; the month's is not (its fallback share applies)
        r.mset({f"gw:allow:tpd:{t}:bench:20261202": 10**10 for t in TIERS})
    r.config_resetstat()
    sha = r.script_load(script)
    tiers, now = _tiers(deny, full), int(time.time() * 1000)
    leases = [f"gw:conc:{t}:bench" for t in TIERS] if full else []
    for i in range(calls):
        args: list[object] = [now, 60000, 180000, "20261202", "202612", 10**6, 10**7, BATCH]
        args += [f"r{i}-{j}\x1f100\x1fmeta\x1f{tiers}" for j in range(BATCH)]
        r.evalsha(sha, 0, *args)
        if not deny:  # keep the request records (and leases) from piling up
            r.delete(*[f"gw:req:r{i}-{j}" for j in range(BATCH)], *leases)
    return float(r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]) / BATCH


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="HEAD~1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--all-limits", action="store_true",
                    help="also concurrency and both global quotas on every tier")
    a = ap.parse_args()
    scripts = {
        "this tree": (REPO / SCRIPT).read_text(),
        a.baseline: subprocess.run(["git", "show", f"{a.baseline}:{SCRIPT}"], cwd=REPO,
                                   check=True, capture_output=True, text=True).stdout,
    }
    with tempfile.TemporaryDirectory() as tmp:
        svc = redis_service(free_port(), Path(tmp)).start()
        try:
            r = Redis.from_url(f"redis://{svc.address}/0")
            best: dict[tuple[str, bool], float] = {}
            for _ in range(a.rounds):
                for deny in (False, True):
                    for name, script in scripts.items():
                        us = us_per_admission(r, script, deny, a.calls, a.all_limits)
                        best[name, deny] = min(best.get((name, deny), us), us)
        finally:
            svc.stop()
    rows = [(name, f"{best[name, False]:.1f}", f"{best[name, True]:.1f}") for name in scripts]
    print("\n".join(markdown_table(("admit.lua", "µs/admission allowed", "µs/denied"), rows)))


if __name__ == "__main__":
    main()
