"""Bounded soak (`make soak`, ~10 min, not in CI): mixed traffic through the whole spoke with
policy changes, then the fault suite's invariants and a summary table.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--concurrency 8] [--out FILE]
        [--no-policy-changes] [--sidecar-env KEY=VALUE ...]

`--no-policy-changes` keeps the first policy revision (to tell revision-driven memory growth
from traffic-driven); `--sidecar-env` adds to the sidecar's environment (e.g.
MALLOC_ARENA_MAX=2, PYTHONMALLOC=malloc) to tell native fragmentation from a leak.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from testkit.invariants import check
from testkit.load import Load
from testkit.spoke import policy_doc, publish, start_spoke

ROOT = Path(__file__).resolve().parent.parent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def histogram(metrics_url: str) -> dict[float, float]:
    text = httpx.get(f"{metrics_url}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("gateway_authz_check_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.split()[-1])
    return out


def quantile(delta: dict[float, float], q: float) -> float:
    total = delta.get(float("inf"), 0)
    if not total:
        return 0.0
    for le in sorted(delta):
        if delta[le] >= q * total:
            return le
    return float("inf")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--interval", type=float, default=30, help="seconds per row")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/soak.json"))
    ap.add_argument("--no-policy-changes", action="store_true",
                    help="publish no policy revision during the run")
    ap.add_argument("--sidecar-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra variable in the sidecar's environment (repeatable)")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    sidecar_env = {"GATEWAY_LEASE_TTL_S": "10", "GATEWAY_LOG_LEVEL": "warning"}
    for item in args.sidecar_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--sidecar-env wants KEY=VALUE, not {item!r}")
        sidecar_env[key] = value
    spoke, keys = start_spoke(workdir / "spoke", sidecar_env=sidecar_env)
    rows = []
    try:
        pid = spoke["sidecar"].pid
        assert pid is not None
        rss_start = rss_mib(pid)
        load = Load(spoke.base_url, keys["fault"], concurrency=args.concurrency,
                    max_requests=10**7, max_seconds=args.minutes * 60 + 5).start()
        start = time.monotonic()
        prev, prev_n = histogram(spoke.metrics_url), 0
        revision = 0
        while time.monotonic() - start < args.minutes * 60:
            time.sleep(args.interval)
            if not args.no_policy_changes:
                doc = policy_doc(keys)  # a policy change every row: a limit flips
                doc["teams"]["t1"]["limits"] = {"rps": 100000 + revision % 2}
                revision = publish(spoke.redis_url, doc)
            now = histogram(spoke.metrics_url)
            delta = {k: now[k] - prev.get(k, 0) for k in now}
            n = len(load.results)
            rows.append({"t_s": round(time.monotonic() - start), "requests": n - prev_n,
                         "check_p50_ms": quantile(delta, 0.5) * 1000,
                         "check_p99_ms": quantile(delta, 0.99) * 1000,
                         "rss_mib": round(rss_mib(pid), 1), "revision": revision})
            print(rows[-1], flush=True)
            prev, prev_n = now, n
        results = load.stop()
        engine = httpx.get(f"{spoke.engine_url}/mock/stats").json()
        stats = check(spoke, results, "fault", lease_ttl=10)
        summary = {
            "minutes": args.minutes, "requests": len(results),
            "statuses": {str(s): sum(1 for r in results if r.status == s)
                         for s in {r.status for r in results}},
            "events": stats["events"], "duplicates_on_topic": stats["duplicates"],
            "outcomes": dict(stats["outcomes"]), "billed_tokens": stats["billed_tokens"],
            "engine_reported_tokens": engine["usage_reported"]["prompt_tokens"]
            + engine["usage_reported"]["completion_tokens"],
            "leaked_slots": 0, "rss_start_mib": round(rss_start, 1),
            "rss_end_mib": round(rss_mib(pid), 1), "invariants": "hold",
            "policy_changes": not args.no_policy_changes, "sidecar_env": args.sidecar_env,
            "rows": rows,
        }
    finally:
        spoke.stop()
    print("\n| t (s) | requests | check p50 ms | check p99 ms | sidecar RSS MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['t_s']} | {r['requests']} | {r['check_p50_ms']:.1f} | "
              f"{r['check_p99_ms']:.1f} | {r['rss_mib']} |")
    print()
    for k, v in summary.items():
        if k != "rows":
            print(f"{k}: {v}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
