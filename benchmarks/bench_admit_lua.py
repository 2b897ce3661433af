"""admit.lua's own cost per admission inside Redis, allowed and denied, against a baseline
revision's script in the same Redis, interleaved (best of N rounds: the machine is shared).

    .venv/bin/python benchmarks/bench_admit_lua.py [--baseline REV] [--rounds 3] [--calls 1500]
        [--all-limits | --bench-key] [--batch 16] [--per-call]

Each call admits a batch of 16 requests over three tiers (model, team, key), each tier with
rps and the three token windows; with --all-limits, also concurrency and both global quotas
(an allowance for the day's, the fallback share for the month's), the leases dropped after
each call; with --bench-key, the limits bench_latency's and bench_capacity's key has on each
tier (rps, concurrency and tokens a minute only: the c=1 latency target's shape; use
`--batch 1` for c=1's lone admissions). Allowed: limits that never bind. Denied: an rps
of 0.001 that refuses at the first tier. Redis's own `usec_per_call` (INFO commandstats)
divided by the batch: no client or network cost. With --per-call, the two scripts alternate
call by call and each call's own time comes from SLOWLOG (threshold 0, which adds a few µs
to every call alike): percentiles over all calls, steadier on a loaded machine than the
best of whole rounds.
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


def _tiers(deny: bool, full: bool, bench_key: bool = False) -> str:
    """admit.lua's tier fields: key, rps, burst, concurrency, tpm, tpd, tpmo, gtpd, gtpmo."""
    rps, burst = (0.001, 1) if deny else (1e9, 10**9)
    big = 10**10
    if bench_key:
        return "3\x1f" + "\x1f".join(
            f"{t}:bench\x1f{rps}\x1f{burst}\x1f100000\x1f{big}\x1f\x1f\x1f\x1f" for t in TIERS)
    conc, glob = (big, f"{big}\x1f{big}") if full else ("", "\x1f")
    return "3\x1f" + "\x1f".join(
        f"{t}:bench\x1f{rps}\x1f{burst}\x1f{conc}\x1f{big}\x1f{big}\x1f{big}\x1f{glob}"
        for t in TIERS)


def us_per_admission(r: Redis, script: str, deny: bool, calls: int, full: bool = False,
                     bench_key: bool = False, batch: int = BATCH) -> float:
    r.flushall()
    if full:  # the day's allowance is set; the month's is not (its fallback share applies)
        r.mset({f"gw:allow:tpd:{t}:bench:20261202": 10**10 for t in TIERS})
    r.config_resetstat()
    sha = r.script_load(script)
    tiers, now = _tiers(deny, full, bench_key), int(time.time() * 1000)
    leases = [f"gw:conc:{t}:bench" for t in TIERS] if full or bench_key else []
    for i in range(calls):
        args: list[object] = [now, 60000, 180000, "20261202", "202612", 10**6, 10**7, batch]
        args += [f"r{i}-{j}\x1f100\x1fmeta\x1f{tiers}" for j in range(batch)]
        r.evalsha(sha, 0, *args)
        if not deny:  # keep the request records (and leases) from piling up
            r.delete(*[f"gw:req:r{i}-{j}" for j in range(batch)], *leases)
    return float(r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]) / batch


def per_call(r: Redis, scripts: dict[str, str], deny: bool, calls: int, full: bool,
             bench_key: bool, batch: int) -> dict[str, list[float]]:
    """Each script's µs per admission, call by call, the two alternated (SLOWLOG)."""
    r.flushall()
    if full:
        r.mset({f"gw:allow:tpd:{t}:bench:20261202": 10**10 for t in TIERS})
    shas = {name: r.script_load(script) for name, script in scripts.items()}
    r.config_set("slowlog-log-slower-than", 0)
    r.config_set("slowlog-max-len", 128)
    tiers, now = _tiers(deny, full, bench_key), int(time.time() * 1000)
    leases = [f"gw:conc:{t}:bench" for t in TIERS] if full or bench_key else []
    times: dict[str, list[float]] = {name: [] for name in shas}
    for i in range(calls):
        order = list(shas.items())
        for j, (name, sha) in enumerate(order if i % 2 else order[::-1]):
            rid = f"r{i}-{j}"
            r.slowlog_reset()
            args: list[object] = [now, 60000, 180000, "20261202", "202612", 10**6, 10**7, batch]
            args += [f"{rid}-{k}\x1f100\x1fmeta\x1f{tiers}" for k in range(batch)]
            r.evalsha(sha, 0, *args)
            took = [e["duration"] for e in r.slowlog_get(8)
                    if e["command"].startswith(b"EVALSHA")]
            times[name].append(took[0] / batch)
            if not deny:
                r.delete(*[f"gw:req:{rid}-{k}" for k in range(batch)], *leases)
    r.config_set("slowlog-log-slower-than", 10_000)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="HEAD~1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--all-limits", action="store_true",
                    help="also concurrency and both global quotas on every tier")
    ap.add_argument("--bench-key", action="store_true",
                    help="rps, concurrency and tokens a minute only, as the benches' key")
    ap.add_argument("--batch", type=int, default=BATCH, help="admissions a call")
    ap.add_argument("--per-call", action="store_true",
                    help="alternate the scripts call by call, each call timed by SLOWLOG")
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
            if a.per_call:
                rows = []
                for deny in (False, True):
                    times = per_call(r, scripts, deny, a.calls, a.all_limits, a.bench_key,
                                     a.batch)
                    for name, xs in times.items():
                        xs.sort()
                        rows.append((name, "denied" if deny else "allowed",
                                     *(f"{xs[int(len(xs) * q)]:.1f}" for q in (.1, .25, .5))))
                print("\n".join(markdown_table(
                    ("admit.lua", "admission", "p10 µs", "p25 µs", "p50 µs"), rows)))
                return
            best: dict[tuple[str, bool], float] = {}
            for _ in range(a.rounds):
                for deny in (False, True):
                    for name, script in scripts.items():
                        us = us_per_admission(r, script, deny, a.calls, a.all_limits,
                                              a.bench_key, a.batch)
                        best[name, deny] = min(best.get((name, deny), us), us)
        finally:
            svc.stop()
    rows = [(name, f"{best[name, False]:.1f}", f"{best[name, True]:.1f}") for name in scripts]
    print("\n".join(markdown_table(("admit.lua", "µs/admission allowed", "µs/denied"), rows)))


if __name__ == "__main__":
    main()
